"""`megarl train CONFIG --dry-run --world-size N [--rank R]`: one rank's share of an N-rank run,
checked on this CPU machine without Transformer-Engine, GPUs, weights or data.

Per-rank parameter counts are checked against arithmetic from the HF config (the 70B example at
32 and 64 ranks, every pipeline stage); on tiny models at TP2 x PP2 (with VPP; with tied
embeddings and SP) against the trainer's own build (`build_model`: real tensors, megatron's
init, DDP) and, in the slow test, against 4 real gloo ranks; group lists against megatron-core's
rank order. Layout mistakes are the one-line user error. The dry runs run in a fresh spawned
interpreter: they install the CPU emulation of CUDA, which must not leak into other tests.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import re
import subprocess
import sys

import pytest

from megarl.distributed.launch import spawn
from tests.tiny import TINY_LLAMA, TINY_QWEN3

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE_70B = "examples/grpo_llama3_70b_fp8.yaml"
# meta-llama/Meta-Llama-3-70B-Instruct config.json (the fields megarl reads)
LLAMA3_70B = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=128256,
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=False,
    hidden_act="silu",
    bos_token_id=128000,
    eos_token_id=128009,
)
LLAMA3_70B_PARAMS = 70_553_706_496  # the published count


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megarl", "train", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _in_fresh_process(fn, *args):
    pool = multiprocessing.get_context("spawn").Pool(1)
    try:
        return pool.apply_async(fn, args).get(timeout=120)
    finally:  # a child still running (hung, or past the timeout) is killed, not left behind
        pool.terminate()
        pool.join()


def _expected_chunks(hf: dict, *, tp: int, pp: int, vpp: int, pp_rank: int) -> list[tuple]:
    """(0-based layers, parameters) of each chunk on a rank of pipeline stage `pp_rank`, from the
    HF config alone (dense Llama: no biases, no q/k norms, untied embeddings): linear weights are
    split over TP, the two RMSNorms per layer replicated; the embedding (vocab padded to a
    multiple of 128 x TP) on the first chunk of the first stage, the final norm and the output
    layer on the last chunk of the last stage; interleaved chunks hold every (PP x VPP)-th block."""
    h, f, n_layers = hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"]
    d = h // hf["num_attention_heads"]
    q, kv = hf["num_attention_heads"] * d, hf["num_key_value_heads"] * d
    vocab = -(-hf["vocab_size"] // (128 * tp)) * 128 * tp
    layer = (h * (q + 2 * kv) + q * h + h * 2 * f + f * h) // tp + 2 * h
    per_chunk = n_layers // (pp * vpp)
    out = []
    for v in range(vpp):
        first = (v * pp + pp_rank) * per_chunk
        params = per_chunk * layer
        if pp_rank == 0 and v == 0:
            params += vocab // tp * h
        if pp_rank == pp - 1 and v == vpp - 1:
            params += vocab // tp * h + h
        out.append((tuple(range(first, first + per_chunk)), params))
    return out


def _dry_runs(hf: dict, overrides: list[str], world: int, ranks: list[int], path=None) -> dict:
    """rank -> its `DryRun` (run in a fresh process)."""
    from megarl.config import load_config
    from megarl.trainer.dry_run import dry_run

    cfg = load_config(path, overrides)
    cfg = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, config=hf, mcore_ckpt=None, hf=None)
    )
    return {r: dry_run(cfg, world_size=world, rank=r) for r in ranks}


# ------------------------------------------------------------------ (a) the 70B example
# CI: test_examples.py dry-runs the example at its 32 ranks
@pytest.mark.parametrize("world", [pytest.param(w, marks=pytest.mark.extended) for w in (32, 64)])
def test_70b_example_dry_run(tmp_path, world):
    model = tmp_path / "llama3-70b"  # the shape only: the example's checkpoint is not here
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA3_70B))
    dp = world // 32
    for rank, pp_rank in ((0, 0), (world - 1, 3)):
        proc = _cli(
            EXAMPLE_70B,
            "--dry-run",
            f"--world-size={world}",
            f"--rank={rank}",
            "--set",
            "model.mcore_ckpt=null",
            "--set",
            f"model.hf={model}",
        )
        text = proc.stdout
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        assert "Traceback" not in proc.stderr
        assert f"layout: TP 8 x PP 4 x CP 1 x DP {dp} = {world} ranks; VPP 5" in text
        assert "sequence parallel on" in text
        padded = LLAMA3_70B_PARAMS + (129024 - 128256) * 8192 * 2  # embedding + output rows
        assert (
            f"of the model's {padded:,} with its padded vocab; {LLAMA3_70B_PARAMS:,} in HF" in text
        )
        assert "Transformer-Engine layers with FP8 hybrid, recipe tensorwise" in text
        expected = _expected_chunks(LLAMA3_70B, tp=8, pp=4, vpp=5, pp_rank=pp_rank)
        chunks = re.findall(r"^  chunk (\d)\s+layers (\d+)-(\d+) .* = ([\d,]+)$", text, re.M)
        got = [(int(a), int(b), int(n.replace(",", ""))) for _, a, b, n in chunks]
        assert got == [(ls[0], ls[-1], n) for ls, n in expected], text
        total = int(re.search(r"^  total\s+([\d,]+)", text, re.M).group(1).replace(",", ""))
        assert total == sum(n for _, n in expected)
        groups = dict(re.findall(r"^  (TP|PP|DP) {2,}(.*)$", text, re.M))
        tp0 = rank - rank % 8
        assert groups["TP"] == f"{tp0}-{tp0 + 7} (8 ranks)"
        stages = [rank % (8 * dp) + s * 8 * dp for s in range(4)]
        assert groups["PP"] == f"{', '.join(map(str, stages))} (4 ranks)"
        dp0 = rank - rank % 16 + rank % 8  # DP neighbours are a TP group apart
        assert groups["DP"] == (str(rank) if dp == 1 else f"{dp0}, {dp0 + 8} (2 ranks)")
    # every pipeline stage and TP rank position, in one process
    ranks = [0, 9, 18, 27, world - 1]
    runs = _in_fresh_process(
        _dry_runs, LLAMA3_70B, [], world, ranks, os.path.join(ROOT, EXAMPLE_70B)
    )
    for rank, run in runs.items():
        assert run.coords["PP"] == rank // (8 * dp)
        expected_groups = _dense_groups(rank, tp=8, pp=4, world=world)
        assert {k: run.groups[k] for k in expected_groups} == expected_groups, rank
        expected = _expected_chunks(LLAMA3_70B, tp=8, pp=4, vpp=5, pp_rank=run.coords["PP"])
        assert [(c.layers, c.total) for c in run.chunks] == expected, rank
        assert run.model_params == LLAMA3_70B_PARAMS


# ------------------------------------------------------------------ (b) against a real build
CASES = {
    "llama TP2 x PP2 x VPP2": (
        TINY_LLAMA,
        dict(tensor_parallel=2, pipeline_parallel=2, virtual_pipeline_parallel=2),
    ),
    "qwen3 TP2 x PP2, tied embeddings, SP": (
        TINY_QWEN3,
        dict(tensor_parallel=2, pipeline_parallel=2, sequence_parallel=True),
    ),
}


def _overrides(parallel: dict) -> list[str]:
    return [f"parallel.{k}={str(v).lower()}" for k, v in parallel.items()]


def _dense_groups(rank: int, *, tp: int, pp: int, world: int) -> dict[str, list[int]]:
    """megatron-core's rank order for a dense model at CP 1 ("tp-cp-ep-dp-pp"): TP fastest,
    then DP, then PP: rank = tp_rank + TP x (dp_rank + DP x pp_rank)."""
    dp = world // (tp * pp)
    t, d, p = rank % tp, rank // tp % dp, rank // (tp * dp)
    return {
        "TP": [rank - t + i for i in range(tp)],
        "PP": [t + tp * (d + dp * s) for s in range(pp)],
        "DP": [t + tp * (i + dp * p) for i in range(dp)],
    }


def _shares(chunks) -> list[tuple]:
    """(0-based layers, parameters) of each built chunk."""
    from megarl.models.builder import unwrap

    return [
        (
            tuple(layer.layer_number - 1 for layer in unwrap(c).decoder.layers),
            sum(p.numel() for p in unwrap(c).parameters()),
        )
        for c in chunks
    ]


def _trainer_build(hf: dict, parallel: dict, world: int, rank: int) -> list[tuple]:
    """(layers, parameters) of each actor chunk of `rank` as the trainer builds it
    (`build_model`: real CPU tensors, megatron's init, DDP), under torch's fake process group."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megarl.distributed import ParallelConfig, Topology, device
    from megarl.models.builder import build_model
    from megarl.models.hf_config import PrecisionConfig, arch_from_hf

    arch = arch_from_hf(hf)
    topo = Topology.for_model(ParallelConfig(**parallel), world, arch)
    device.setup()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        topo.initialize(seed=1234, gloo_groups=False)
        chunks = build_model(arch, topo.parallel, PrecisionConfig(), role="actor")
        assert all(p.device.type == "cpu" for c in chunks for p in c.parameters())
        return _shares(chunks)
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def _dry_and_trainer_builds(cases: dict, world: int) -> dict:
    """case -> rank -> (its `DryRun`, the trainer's chunks), in one fresh process."""
    return {
        name: {
            rank: (run, _trainer_build(hf, parallel, world, rank))
            for rank, run in _dry_runs(hf, _overrides(parallel), world, list(range(world))).items()
        }
        for name, (hf, parallel) in cases.items()
    }


def test_tiny_dry_run_matches_the_trainers_build_at_tp2_pp2():
    results = _in_fresh_process(_dry_and_trainer_builds, CASES, 4)
    for name in CASES:
        for rank, (run, trainer) in results[name].items():
            assert [(c.layers, c.total) for c in run.chunks] == trainer, (name, rank)
            expected = _dense_groups(rank, tp=2, pp=2, world=4)
            assert {k: run.groups[k] for k in expected} == expected, (name, rank)
        counts = [run.rank_params for run, _ in results[name].values()]
        assert counts[0] == counts[1] and counts[2] == counts[3]  # TP ranks hold equal shares
    # the tied embedding lives on the first and the last stage, the output layer on the last
    tied = results["qwen3 TP2 x PP2, tied embeddings, SP"]
    assert tied[0][0].groups["embedding (tied)"] == [0, 2]
    assert tied[0][0].chunks[0].params["output layer"] == 0
    assert tied[3][0].chunks[0].params["output layer"] == 256 // 2 * 64


def _gloo_build(rank: int, world: int, cases: dict) -> dict:
    """In each of `world` gloo ranks: the actor's chunks and the groups, as a training run has
    them (`Topology.initialize`, `build_model`)."""
    from megarl.distributed import ParallelConfig, Topology
    from megarl.models.builder import build_model
    from megarl.models.hf_config import PrecisionConfig, arch_from_hf
    from megarl.trainer.dry_run import _groups

    out = {}
    for name, (hf, parallel) in cases.items():
        arch = arch_from_hf(hf)
        topo = Topology.for_model(ParallelConfig(**parallel), world, arch)
        topo.initialize()
        chunks = build_model(arch, topo.parallel, PrecisionConfig(), role="actor")
        out[name] = {"chunks": _shares(chunks), "groups": _groups(topo, arch)}
    return out


def _dry_run_cases(cases: dict, world: int) -> dict:
    return {
        name: _dry_runs(hf, _overrides(parallel), world, list(range(world)))
        for name, (hf, parallel) in cases.items()
    }


@pytest.mark.slow
@pytest.mark.extended  # four ranks; CI: the same cases against the trainer's build (above)
def test_tiny_dry_run_matches_a_real_four_process_gloo_run():
    """The fake process group's groups and the meta build against 4 real gloo ranks (4
    interpreters: the one slow test here, ~70 s on 2 busy cores)."""
    real = spawn(_gloo_build, 4, CASES, timeout=300)
    dry = _in_fresh_process(_dry_run_cases, CASES, 4)
    for name in CASES:
        for rank in range(4):
            run, want = dry[name][rank], real[rank][name]
            assert [(c.layers, c.total) for c in run.chunks] == want["chunks"], (name, rank)
            assert run.groups == want["groups"], (name, rank)


# ------------------------------------------------------------------ (c) user errors
@pytest.mark.parametrize(
    "args, needle",
    [
        (
            ["--dry-run", "--world-size=3", "--set", "parallel.tensor_parallel=2"],
            "parallel: world size 3 is not divisible by TP x PP x CP = 2 x 1 x 1 = 2",
        ),
        (
            ["--dry-run", "--world-size=4", "--set", "parallel.tensor_parallel=4"],
            "num_query_groups=2 (KV heads) is not divisible by TP=4",
        ),
        (["--dry-run", "--world-size=4", "--rank=4"], "--rank 4: accepted: 0 to 3"),
        (
            ["--dry-run", "--world-size=3", "--rank=2", "--set", "rollout.placement.mode=separate"],
            "--rank 2 hosts a vLLM engine only (rollout.placement.mode=separate: ranks 2-2 of 3)",
        ),
        (
            ["--dry-run", "--world-size=1", "--set", "rollout.placement.mode=separate"],
            "rollout.placement.ranks=1 of a 1-rank job leaves 0 trainer ranks",
        ),
        (["--world-size=4"], "--world-size / --rank go with --dry-run only"),
        (["--dry-run"], "--dry-run needs --world-size N"),
        (
            [EXAMPLE_70B, "--dry-run", "--world-size=32"],
            "model.mcore_ckpt='/ckpt/llama3-70b' does not exist on this machine",
        ),
    ],
    ids=[
        "world-not-divisible",
        "tp-vs-kv-heads",
        "rank-out-of-range",
        "engine-rank",
        "no-trainer-left",
        "no-dry-run",
        "no-world",
        "no-ckpt",
    ],
)
def test_layout_errors_are_one_line_user_errors(args, needle):
    proc = _cli(*args)
    text = proc.stdout + proc.stderr
    lines = [ln for ln in text.splitlines() if ln.startswith("megarl: error:")]
    assert proc.returncode == 2, text[-3000:]
    assert len(lines) == 1 and needle in lines[0], text[-3000:]
    assert "Traceback" not in text
    assert "layout: TP" not in text  # refused before the layout was laid out


def test_a_kv_cache_smaller_than_one_sequence_fails_the_dry_run():
    """The run's own KV-cache check (`check_kv_cache`) runs in the dry run too: a set budget
    below one sequence of max_model_len is the same one-line error before anything is built."""
    proc = _cli("--dry-run", "--world-size", "1",
                   "--set", "rollout.engine.kv_cache_memory_bytes=1048576",
                   "--set", "rollout.engine.max_model_len=2048")  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "rollout.engine.kv_cache_memory_bytes=1048576" in proc.stderr
    assert "fewer than one sequence of max_model_len" in proc.stderr


def test_separate_placement_dry_runs_the_trainers_layout():
    """With rollout.placement.mode=separate the layout is the trainer ranks': 3 ranks with one
    engine rank are TP 2 x DP 1 for the trainers, and the report names the engine rank."""
    proc = _cli("--dry-run", "--world-size=3", "--rank=1", "--set",
                   "rollout.placement.mode=separate", "--set", "parallel.tensor_parallel=2")
    text = proc.stdout
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "TP 2 x PP 1 x CP 1 x DP 1 = 2 ranks" in text, text
    assert "ranks 2-2 of 3 host vLLM engines only" in text
