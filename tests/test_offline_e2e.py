"""The offline stages end to end through `torchrun -m megarl train` on CPU: SFT at TP2 (+SP) from
random init, DPO at PP2 from its checkpoint (`model.mcore_ckpt` = the SFT run directory),
resumed at one rank from a PP2 checkpoint, and a GRPO run (real vLLM) started from the SFT
export, and DPO with LoRA from that export. No rollout engine is built for SFT / DPO."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from megarl.checkpoint import files
from tests.test_trainer_e2e import _metrics, _train

SFT = "examples/sft_copy_cpu.yaml"
DPO = "examples/dpo_copy_cpu.yaml"
SMALL = ["eval.fraction=0.05", "eval.every=4"]


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    out = tmp_path_factory.mktemp("offline") / "sft"
    _train(
        out,
        "trainer.steps=8",
        *SMALL,
        "parallel.tensor_parallel=2",
        "parallel.sequence_parallel=true",
        nproc=2,
        config=SFT,
    )
    return out


def _log(out) -> str:
    with open(str(out) + ".log") as f:
        return f.read()


@pytest.mark.slow
def test_sft_at_tp2_learns_evaluates_saves_and_exports(sft):
    rows = _metrics(sft)
    assert [r["step"] for r in rows] == list(range(0, 9))
    assert set(rows[0]) == {"step", "eval/loss", "eval/token_accuracy", "eval/ppl"}
    for key in ("loss", "ppl", "token_accuracy", "tokens_per_s", "time_s", "grad_norm"):
        assert key in rows[-1], key
    assert {r["step"] for r in rows if "eval/loss" in r} == {0, 4, 8}
    print(
        f"sft tp2: loss {rows[1]['loss']:.3f} -> {rows[-1]['loss']:.3f}, eval/loss "
        f"{rows[0]['eval/loss']:.3f} -> {rows[-1]['eval/loss']:.3f}"
    )
    assert rows[-1]["loss"] < rows[1]["loss"] - 0.3
    assert rows[-1]["eval/loss"] < rows[0]["eval/loss"] - 0.3
    assert (sft / "loss.png").exists() and (sft / "hf" / "config.json").exists()
    assert "vllm" not in _log(sft).lower()  # no engine was built
    # the checkpoint a GRPO run writes: the same trainer state keys, the actor's tensors
    ckpt = files.latest_checkpoint(str(sft))
    state = files.read_trainer_state(ckpt)
    assert set(files.STATE_KEYS) <= set(state) and "critic_sched" not in state
    with open(os.path.join(ckpt, "metadata.json")) as f:
        assert json.load(f)["sharded_backend"] == "torch_dist"


@pytest.mark.slow
def test_dpo_at_pp2_from_the_sft_checkpoint_resumes_at_one_rank(sft, tmp_path):
    start = [
        f"model.mcore_ckpt={sft}",  # the run directory: its newest checkpoint's actor
        "trainer.steps=4",
        "trainer.save_every=2",
        *SMALL,
        "optim.decay_steps=16",
    ]
    pp2 = tmp_path / "pp2"
    _train(pp2, *start, "parallel.pipeline_parallel=2", nproc=2, config=DPO)
    rows = _metrics(pp2)
    assert [r["step"] for r in rows] == list(range(0, 5))
    for key in (
        "loss",
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "rewards/accuracies",
        "logps/chosen",
        "logps/rejected",
        "preference_accuracy",
    ):
        assert key in rows[-1] and f"eval/{key}" in rows[-1], key
    # the reference is the starting policy: every reward is 0 before the first update
    assert rows[1]["rewards/chosen"] == pytest.approx(0, abs=1e-5)
    assert rows[1]["loss"] == pytest.approx(0.693147, abs=1e-5)
    assert rows[-1]["rewards/margins"] != 0
    # steps 3-4 again at one rank from the PP2 checkpoint of step 2
    one = tmp_path / "one"
    os.makedirs(one / "checkpoints")
    shutil.copytree(pp2 / "checkpoints" / "step_000002", one / "checkpoints" / "step_000002")
    _train(one, *start, config=DPO)
    again = {r["step"]: r for r in _metrics(one)}
    assert sorted(again) == [3, 4]
    for step in (3, 4):
        a, b = rows[step], again[step]
        print(f"dpo step {step}: loss pp2 {a['loss']:.8f}, resumed at 1 rank {b['loss']:.8f}")
        for key in ("loss", "rewards/margins", "eval/loss") if step == 4 else ("loss",):
            assert abs(a[key] - b[key]) <= 1e-5, (step, key, a[key], b[key])


@pytest.mark.slow
def test_grpo_starts_from_an_offline_export(sft, tmp_path):
    out = tmp_path / "grpo"
    _train(
        out,
        "model.config=null",
        f"model.hf={sft / 'hf'}",
        "trainer.steps=2",
        "rollout.sampling.max_tokens=8",
    )
    rows = _metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert max(r["logprob_mismatch_max"] for r in rows) <= 1e-4
    assert rows[0]["reward_mean"] > 0.05  # random init scores ~0.03; the SFT model does better


@pytest.mark.slow
def test_dpo_with_lora_from_the_sft_export(sft, tmp_path):
    out = tmp_path / "dpo-lora"
    lora = ["model.lora.rank=8", "optim.lr=5e-3", "trainer.steps=3", "trainer.save_every=3"]
    _train(out, "model.mcore_ckpt=null", f"model.hf={sft / 'hf'}", *lora, *SMALL, config=DPO)
    rows = _metrics(out)
    # the reference is the base with the adapters off, and B starts at zero: every reward is 0
    # before the first update, not after it
    assert rows[1]["rewards/chosen"] == pytest.approx(0, abs=1e-6)
    assert rows[1]["loss"] == pytest.approx(0.693147, abs=1e-5)
    assert abs(rows[-1]["rewards/margins"]) > 1e-4
    assert (out / "adapter" / "adapter_model.safetensors").exists()
    # the checkpoint holds the adapters (the frozen base comes from model.hf at a resume)
    from megatron.core import dist_checkpointing

    keys = dist_checkpointing.load_tensors_metadata(files.latest_checkpoint(str(out)))
    model_keys = [k for k in keys if k.startswith("actor.")]
    assert model_keys and all(k.startswith("actor.lora.") for k in model_keys), model_keys[:3]
