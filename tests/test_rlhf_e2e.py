"""The classic RLHF stages end to end through `torchrun -m megarl train` on CPU: a reward model
trained with the Bradley-Terry loss (`algorithm.name: rm`, the embedded copy task's pairs) and
exported as an HF sequence classifier, then PPO at TP2 scored only by it (the task's exact match
logged with weight 0) with the critic started from it (`model.critic_init: reward_model`).

Checked against transformers: each logged sample's `rm` reward is the exported reward model's
logit on the sample's text, and the critic, exported by `megarl convert mcore-to-hf --role
critic` after a step at a negligible critic learning rate, is the reward model's weights."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.test_trainer_e2e import ROOT, _metrics, _train

RM_STEPS, PPO_STEPS = 3, 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rlhf")
    rm, ppo = root / "rm", root / "ppo"
    _train(
        rm,
        "algorithm.name=rm",
        f"trainer.steps={RM_STEPS}",
        "trainer.export_hf=true",
        "data.prompts_per_step=8",
        "algorithm.micro_batch_size=16",
        "eval.fraction=0.05",
        f"eval.every={RM_STEPS}",  # at step 0 and after the last
    )
    _train(
        ppo,
        "algorithm.name=ppo",
        f"trainer.steps={PPO_STEPS}",
        f"reward.model={rm}",
        "model.critic_init=reward_model",
        "reward.functions=[toy_exact_match]",
        "reward.weights=[0.0]",
        "parallel.tensor_parallel=2",
        "data.prompts_per_step=4",
        "rollout.sampling.n=4",
        "logging.samples_per_step=8",
        "critic_optim.lr=1e-12",  # the critic stays the reward model (Adam moves it by ~lr)
        nproc=2,
    )
    return rm, ppo


@pytest.mark.slow
def test_reward_model_trains_evaluates_and_exports_a_sequence_classifier(runs):
    rm, _ = runs
    rows = _metrics(rm)
    assert [r["step"] for r in rows] == list(range(RM_STEPS + 1))
    assert {"eval/loss", "eval/rm/accuracy", "eval/rm/margin"} <= set(rows[0])
    for r in rows[1:]:
        assert {"loss", "rm/accuracy", "rm/margin", "grad_norm"} <= set(r), r
    cfg = json.loads((rm / "hf" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForSequenceClassification"]
    assert cfg.get("num_labels", len(cfg.get("id2label", {0: 0}))) == 1


@pytest.mark.slow
def test_ppo_is_scored_by_the_reward_model_as_transformers_scores(runs):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    rm, ppo = runs
    rows = _metrics(ppo)
    assert [r["step"] for r in rows] == list(range(1, PPO_STEPS + 1))
    for r in rows:  # the function's weight is 0: the reward is the reward model's score
        assert "reward/exact_match" in r and r["reward_mean"] == pytest.approx(r["reward/rm"])
    tok = AutoTokenizer.from_pretrained(rm / "hf")
    model = AutoModelForSequenceClassification.from_pretrained(rm / "hf", dtype=torch.float32)
    samples = [json.loads(x) for x in (ppo / "samples.jsonl").read_text().splitlines()]
    compared = 0
    for s in samples:
        ids = tok(s["prompt"])["input_ids"]
        response = tok(s["completion"], add_special_tokens=False)["input_ids"]
        stop = [tok.eos_token_id] if s["finish_reason"] == "stop" else []
        if len(response) + len(stop) != s["length"]:
            continue  # a special token in the response: its decoded text is not its ids
        with torch.no_grad():
            want = model(torch.tensor([ids + response + stop])).logits[0, 0].item()
        assert s["rewards"]["rm"] == pytest.approx(want, abs=1e-4), s
        compared += 1
    assert compared >= 2, samples


@pytest.mark.slow
def test_the_critic_starts_as_the_reward_model(runs, tmp_path):
    from safetensors.torch import load_file

    rm, ppo = runs
    out = tmp_path / "critic"
    ckpt = ppo / "checkpoints" / f"step_{PPO_STEPS:06d}"
    cmd = [sys.executable, "-m", "megarl", "convert", "mcore-to-hf", "--ckpt", str(ckpt),
           "--role", "critic", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    critic = load_file(out / "model.safetensors")
    reward = load_file(rm / "hf" / "model.safetensors")
    assert critic.keys() == reward.keys()
    assert reward["score.weight"].abs().max() > 1e-3  # not the zero head of an actor-started one
    for k, v in reward.items():
        assert (critic[k] - v).abs().max() <= 1e-9, k
