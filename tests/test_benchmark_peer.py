"""`--suite peer` without running either system: its megarl config is a valid megarl config,
and the suite's bookkeeping (medians of the measured steps, rates, SKIP records without TRL,
the ratio, the table) on fake runs."""

from __future__ import annotations

import argparse
import math

import pytest
import yaml

from megarl.benchmarks import peer
from megarl.config import load_config


def test_megarl_config_loads_and_matches_the_workload(tmp_path):
    path = tmp_path / "peer.yaml"
    path.write_text(yaml.safe_dump(peer.megarl_config("/models/x", "bf16", 12)))
    cfg = load_config(str(path))
    assert cfg.model.hf == "/models/x"
    assert cfg.precision.dtype == "bf16"
    assert (cfg.rollout.sampling.n, cfg.data.prompts_per_step) == (peer.N, peer.PROMPTS)
    sampling = cfg.rollout.sampling
    assert sampling.max_tokens == peer.MAX_TOKENS and sampling.temperature == 1.0
    alg = cfg.algorithm
    assert (alg.ppo_epochs, alg.mini_batches, alg.kl_coef) == (1, 1, 0.0)
    assert alg.micro_batch_size == peer.PROMPTS * peer.N
    assert cfg.optim.lr == peer.LR and cfg.trainer.steps == 12


def test_the_workload_data_is_fixed(tmp_path):
    """The benchmark ships its own prompts and reward (the embedded default task may change):
    55 prompts of 4 tokens, graded on the first character, loaded as megarl loads them."""
    from megarl.data import DataConfig, PromptDataset, load_tokenizer
    from megarl.rewards import load_reward_function

    peer.write_model(str(tmp_path))
    run = peer.megarl_config(str(tmp_path), "fp32", 1)
    data = DataConfig(**run["data"])
    ds = PromptDataset.from_config(data, load_tokenizer(tmp_path))
    assert len(ds) == 55 and {len(p) for p in ds.prompt_ids} == {peer.PROMPT_TOKENS}
    fn = load_reward_function(run["reward"]["functions"][0])
    assert fn(["3+4="] * 3, ["7", "78", "8"], answer=["7"] * 3) == [1.0, 1.0, 0.0]


def _fake_run(step_s: float, completion_len: float, steps: int) -> dict:
    samples = peer.PROMPTS * peer.N
    stages = {k: [0.0] * steps for k in peer.STAGES}
    stages["rollout"] = [step_s / 2] * steps
    stages["train"] = [step_s / 2] * steps
    # two slow warm-up steps that the medians must leave out
    return {
        "step_s": [100.0, 100.0] + [step_s] * (steps - 2),
        "completion_tokens": [completion_len * samples] * steps,
        "tokens": [(completion_len + 4) * samples] * steps,
        "stages": stages,
        "exit_hung": False,
    }


def _patch(monkeypatch, trl_reason, bf16_reason=None):
    from megarl.distributed import device

    measured = []
    monkeypatch.setattr(peer, "write_model", lambda d: 18_948_608)
    monkeypatch.setattr(peer, "gemm_flops", lambda dtype: measured.append(dtype) or 1e11)
    monkeypatch.setattr(peer, "trl_missing", lambda: trl_reason)
    monkeypatch.setattr(device, "cpu_half_precision_note", lambda dtype: bf16_reason)
    times = {("megarl", "fp32"): 8.0, ("megarl", "bf16"): 4.0, ("trl", "fp32"): 8.0}
    times.update({("trl", "bf16"): 16.0, ("trl", "bf16w"): 10.0})
    for system in ("megarl", "trl"):
        monkeypatch.setitem(
            peer.RUNNERS,
            system,
            lambda model_dir, precision, steps, threads, s=system, **kw: _fake_run(
                times[(s, precision)], 60.0, steps
            ),
        )
    return measured


def test_suite_without_trl_reports_megarl_and_skips(monkeypatch):
    _patch(monkeypatch, "TRL is not installed")
    records = peer.suite(argparse.Namespace(quick=True, rounds=1, threads=1))
    by_name = {r["name"]: r for r in records}
    assert math.isclose(by_name["megarl_bf16_step_seconds"]["value"], 4.0)
    assert math.isclose(by_name["megarl_bf16_completion_tokens_per_s"]["value"], 60 * 64 / 4.0)
    skipped = by_name["trl_fp32_completion_tokens_per_s"]
    assert skipped["params"]["status"] == "SKIP" and "not installed" in skipped["params"]["reason"]
    assert "megarl_over_trl_best" not in by_name
    table = peer.markdown_table(records)
    assert "| megarl | bf16 | 4.00 |" in table and "SKIP: TRL is not installed" in table


def test_suite_ratio_is_best_against_best(monkeypatch):
    _patch(monkeypatch, None)
    records = peer.suite(argparse.Namespace(quick=False, rounds=2, threads=1))
    ratio = next(r for r in records if r["name"] == "megarl_over_trl_best")
    # megarl bf16 (4 s/step) against TRL's best, fp32 (8 s/step), at equal completion lengths
    assert math.isclose(ratio["value"], 2.0)
    assert ratio["params"]["megarl_config"] == "bf16" and ratio["params"]["trl_config"] == "fp32"
    assert math.isclose(ratio["params"]["same_precision"]["bf16"], 4.0)
    assert "megarl (bf16) / TRL best (fp32): 2.00x" in peer.markdown_table(records)


def test_suite_skips_bf16_where_the_cpu_only_emulates_it(monkeypatch):
    """On a CPU without bf16 instructions the bf16 rows are SKIP records with the reason (a
    megarl bf16 step took 200 s there), no bf16 floor is measured, and fp32 is still compared."""
    import torch

    measured = _patch(monkeypatch, None, bf16_reason="no AVX512-BF16 or AMX")
    records = peer.suite(argparse.Namespace(quick=True, rounds=1, threads=1))
    by_name = {r["name"]: r for r in records}
    for name in ("megarl_bf16", "trl_bf16", "trl_bf16w"):
        rec = by_name[f"{name}_completion_tokens_per_s"]
        assert rec["params"]["status"] == "SKIP" and "AVX512-BF16" in rec["params"]["reason"]
        assert f"{name}_step_seconds" not in by_name
    assert torch.bfloat16 not in measured and "gemm_bf16_flops" not in by_name
    ratio = by_name["megarl_over_trl_best"]
    assert ratio["params"]["megarl_config"] == "fp32" and ratio["params"]["trl_config"] == "fp32"
    assert math.isclose(ratio["value"], 1.0) and list(ratio["params"]["same_precision"]) == ["fp32"]
    assert "SKIP: no AVX512-BF16 or AMX" in peer.markdown_table(records)


def test_ceiling_puts_the_train_stage_at_the_gemm_floor(monkeypatch):
    """The ratio's ceiling: megarl's measured steps with the train stage replaced by its model
    FLOPs at the measured GEMM rate (nothing else changed), over TRL's best rate."""
    _patch(monkeypatch, None)
    records = peer.suite(argparse.Namespace(quick=True, rounds=1, threads=1))
    ratio = next(r for r in records if r["name"] == "megarl_over_trl_best")
    fpt = peer.flops_per_token(peer.MODEL, seq_len=64, training=True, causal=True)
    train_at_floor = fpt * 64 * 64 / 1e11  # (60 completion + 4 prompt tokens) x 64 samples
    for precision, step_s in (("bf16", 4.0), ("fp32", 8.0)):
        rate = 60 * 64 / (step_s / 2 + train_at_floor)  # rollout = half the fake step
        trl_best = 60 * 64 / 8.0
        assert math.isclose(ratio["params"]["train_at_floor"][precision], rate / trl_best)
    assert "the GEMM floor (the ceiling): fp32 0.92x, bf16 1.19x" in peer.markdown_table(records)


def test_smollm2_workload_config_and_trl_spec_match(tmp_path):
    """`--model smollm2`: the megarl side is a valid config of the example's workload with the
    reference pass and held-out evaluation; the TRL side gets the same settings."""
    from megarl.benchmarks import peer_smollm2 as s

    path = tmp_path / "peer.yaml"
    path.write_text(yaml.safe_dump(s.megarl_config("/models/x", "bf16", 6, str(tmp_path))))
    cfg = load_config(str(path))
    alg = cfg.algorithm
    assert (alg.kl_coef, alg.kl_kind, alg.kl_in) == (s.BETA, "k3", "loss")
    sampling = cfg.rollout.sampling
    assert (sampling.n, cfg.data.prompts_per_step, sampling.max_tokens) == (8, 8, 48)
    assert cfg.eval.every == s.EVAL_EVERY and cfg.eval.path.endswith("eval.jsonl")
    assert cfg.reward.functions == ("math_verify",) and cfg.optim.lr == s.LR
    spec = s.trl_spec(str(tmp_path))
    assert (spec["beta"], spec["lr"], spec["max_tokens"]) == (s.BETA, s.LR, 48)
    assert spec["batch"] == 64 and spec["num_generations"] == 8 and spec["chat"]
    # the engine's KV cache holds a whole sequence of SmolLM2 (the check `megarl train` makes)
    import json
    import os

    from megarl.models.hf_config import arch_from_hf
    from megarl.rollout.engine.checks import check_kv_cache

    shape = os.path.join(os.path.dirname(s.TRAIN), "..", "models", "smollm2-135m-instruct")
    with open(os.path.join(shape, "config.json")) as f:
        arch = arch_from_hf(json.load(f))
    check_kv_cache(arch, cfg.rollout.engine, dtype="fp32", gpu=False)


def test_time_to_target_counts_the_step_seconds_up_to_the_first_eval_above_it():
    from megarl.benchmarks.peer_smollm2 import TARGET, time_to_target

    evals = [(0, 0.3), (4, TARGET - 0.01), (8, TARGET), (12, 0.9)]
    t = time_to_target(evals, [10.0] * 12)
    assert (t["seconds"], t["step"], t["start"], t["best"]) == (80.0, 8, 0.3, 0.9)
    never = time_to_target([(0, 0.3), (4, 0.4)], [10.0] * 4)
    assert math.isnan(never["seconds"]) and never["step"] is None and never["best"] == 0.4


def test_smollm2_suite_reports_time_to_target_and_a_ceiling_with_the_reference(monkeypatch):
    from megarl.benchmarks import peer_smollm2 as s

    monkeypatch.setattr(s, "prepare", lambda tmp: ("/models/smollm2", s.PARAMS))
    monkeypatch.setattr(peer, "gemm_flops", lambda dtype: 1e11)
    monkeypatch.setattr(peer, "trl_missing", lambda: None)
    from megarl.distributed import device

    monkeypatch.setattr(device, "cpu_half_precision_note", lambda dtype: None)
    step = {("megarl", "fp32"): 40.0, ("megarl", "bf16"): 20.0}
    step.update({("trl", "fp32"): 80.0, ("trl", "bf16"): 50.0})
    # megarl bf16 needs more steps (12) than fp32 (8); TRL bf16 never gets there
    reach = {("megarl", "fp32"): 8, ("megarl", "bf16"): 12, ("trl", "fp32"): 8}
    calls = []

    def fake(system):
        def run(model_dir, precision, steps, threads, workload, data_dir):
            calls.append((system, precision, workload.name))
            out = _fake_run(step[(system, precision)], 20.0, steps)
            out["step_s"] = [step[(system, precision)]] * steps
            out["stages"]["logprobs"] = [5.0] * steps
            at = reach.get((system, precision), 99)
            out["evals"] = [(k, s.TARGET if k >= at else 0.3) for k in range(0, steps + 1, 4)]
            return out

        return run

    for system in ("megarl", "trl"):
        monkeypatch.setitem(peer.RUNNERS, system, fake(system))
    records = peer.suite(argparse.Namespace(quick=False, rounds=1, threads=1, model="smollm2"))
    assert [c[:2] for c in calls] == list(s.PLAN) and {c[2] for c in calls} == {"smollm2"}
    by = {r["name"]: r for r in records}
    assert by["megarl_fp32_time_to_target_seconds"]["value"] == 8 * 40.0
    assert by["megarl_bf16_time_to_target_seconds"]["value"] == 12 * 20.0
    assert math.isnan(by["trl_bf16_time_to_target_seconds"]["value"])
    ratio = by["megarl_over_trl_time_to_target"]
    assert math.isclose(ratio["value"], 8 * 80.0 / (12 * 20.0))
    assert (ratio["params"]["megarl_config"], ratio["params"]["trl_config"]) == ("bf16", "fp32")
    # the ceiling: megarl's train AND reference passes at the GEMM floor
    best = by["megarl_over_trl_best"]["params"]
    assert best["ceiling_stages"] == ["train", "logprobs"]
    p = by["megarl_fp32_completion_tokens_per_s"]["params"]
    assert set(p["stage_floors"]) == {"train", "logprobs"}
    assert p["max_new_tokens"] == s.MAX_TOKENS == 48  # the workload's, not the random one's
    table = peer.markdown_table(records)
    assert "time to the held-out target: TRL best (fp32) / megarl best (bf16) = 2.67x" in table
    assert "train and logprobs passes at the GEMM floor" in table and "not reached" in table


def test_steps_option_sets_each_runs_steps(monkeypatch):
    """`--steps N` replaces the workload's step count (and --quick's) in every run."""
    _patch(monkeypatch, "TRL is not installed")
    seen = []
    run = peer.RUNNERS["megarl"]
    monkeypatch.setitem(
        peer.RUNNERS, "megarl", lambda d, p, n, t, **kw: seen.append(n) or run(d, p, n, t)
    )
    records = peer.suite(argparse.Namespace(quick=True, steps=7, rounds=1, threads=1))
    by_name = {r["name"]: r for r in records}
    assert seen == [7, 7] and by_name["megarl_fp32_step_seconds"]["params"]["steps"] == 7


def test_steps_below_the_warm_up_is_refused(capsys):
    from megarl.benchmarks.cli import main

    with pytest.raises(SystemExit) as err:
        main(["--suite", "peer", "--steps", "2"])
    assert err.value.code == 2 and "--steps 2: at least 3" in capsys.readouterr().err
