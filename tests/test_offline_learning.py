"""The three-stage CPU pipeline learns (learning tier: `make test-slow`, tens of minutes).

Per seed s: SFT from random init (examples/sft_copy_cpu.yaml, model.init_seed 1234 + s,
data.seed s) -> DPO from its checkpoint (examples/dpo_copy_cpu.yaml, data.seed s) -> GRPO from the
DPO checkpoint (examples/grpo_copy_from_dpo_cpu.yaml: the embedded default at lr 3e-4,
trainer.seed s), beside the embedded default GRPO from random init at the same seed and the same
60 steps. SFT must lower the held-out loss and raise its token accuracy, DPO must raise the
held-out preference accuracy, and the GRPO run from the DPO model must reach the default's 0.9
reward in fewer steps than the one from random init. docs/offline.md lists the figures these
runs printed.
"""

from __future__ import annotations

import pytest

from tests.test_trainer_e2e import _metrics, _train

GRPO_STEPS = 60


def _first(rows: list[dict], key: str, bar: float) -> int | None:
    return next((r["step"] for r in rows if r.get(key, 0.0) >= bar), None)


@pytest.mark.learning
@pytest.mark.parametrize("seed", [0, 1])
def test_sft_dpo_grpo_pipeline_beats_random_init(tmp_path, seed):
    sft, dpo = tmp_path / "sft", tmp_path / "dpo"
    _train(
        sft,
        f"model.init_seed={1234 + seed}",
        f"data.seed={seed}",
        config="examples/sft_copy_cpu.yaml",
    )
    rows = _metrics(sft)
    before, after = rows[0], rows[-1]
    print(
        f"seed {seed} sft: eval/loss {before['eval/loss']:.3f} -> {after['eval/loss']:.3f}, "
        f"eval/token_accuracy {before['eval/token_accuracy']:.3f} -> "
        f"{after['eval/token_accuracy']:.3f}"
    )
    assert after["eval/loss"] < before["eval/loss"] - 1.0
    assert after["eval/token_accuracy"] > before["eval/token_accuracy"] + 0.4

    _train(dpo, f"model.mcore_ckpt={sft}", f"data.seed={seed}", config="examples/dpo_copy_cpu.yaml")
    rows = _metrics(dpo)
    before, after = rows[0], rows[-1]
    print(
        f"seed {seed} dpo: eval/preference_accuracy {before['eval/preference_accuracy']:.3f} "
        f"-> {after['eval/preference_accuracy']:.3f}, eval/rewards/accuracies "
        f"{after['eval/rewards/accuracies']:.3f}, eval/rewards/margins "
        f"{after['eval/rewards/margins']:.3f}"
    )
    assert after["eval/preference_accuracy"] > before["eval/preference_accuracy"] + 0.05
    assert after["eval/rewards/accuracies"] > 0.6 and after["eval/rewards/margins"] > 0

    steps = {}
    for name, start, config in (
        ("dpo", [f"model.mcore_ckpt={dpo}"], "examples/grpo_copy_from_dpo_cpu.yaml"),
        ("random init", [], None),
    ):
        out = tmp_path / f"grpo-{name.replace(' ', '-')}"
        _train(out, *start, f"trainer.seed={seed}", f"trainer.steps={GRPO_STEPS}", config=config)
        rows = _metrics(out)
        steps[name] = _first(rows, "reward_mean", 0.9)
        print(
            f"seed {seed} grpo from {name}: step-1 reward {rows[0]['reward_mean']:.3f}, first "
            f"step >= 0.9: {steps[name]} (of {GRPO_STEPS})"
        )
    assert steps["dpo"] is not None
    assert steps["random init"] is None or steps["dpo"] < steps["random init"]
