"""LoRA beyond the policy, end to end through `megarl train` on CPU: a reward model trained with
adapters (`algorithm.name: rm` + `model.lora.rank`), then PPO at TP2 scored by that reward
model's merged export, with its critic started from it and trained with adapters of its own
(`model.critic_lora.rank`), the value head in full.

What proves it:
- a LoRA model's checkpoint holds what it trains (adapters, scalar head), nothing of the base;
- the base stayed frozen: the reward-model run resumes (its rebuilt base has the fingerprint the
  checkpoint recorded from the trained model), and the critic's recorded base fingerprint is the
  sum of squares of the layers of the export it started from;
- the adapters trained (every critic `B`, zero at the start, is non-zero after two steps); what
  they compute is checked against PEFT on transformers' sequence classifier, values and every
  gradient, at one rank and TP2 + SP, in tests/test_lora.py
  (`test_a_lora_critic_and_reward_model_match_peft_sequence_classification`);
- the reward-model run writes its merged HF export without `trainer.export_hf` (its checkpoint
  alone cannot be scored with), and the checkpoint named as `reward.model` is refused naming
  that export."""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml

from megarl.errors import ConfigError
from tests.test_trainer_e2e import _metrics, _train

pytestmark = pytest.mark.slow

RM_STEPS, PPO_STEPS, RANK = 2, 2, 4
RM = ["algorithm.name=rm", f"model.lora.rank={RANK}", "data.prompts_per_step=8",
      "algorithm.micro_batch_size=16"]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_stages")
    rm, ppo = root / "rm", root / "ppo"
    _train(rm, *RM, f"trainer.steps={RM_STEPS}")
    _train(rm, *RM, f"trainer.steps={RM_STEPS + 1}")  # resumes: the same base is rebuilt
    _train(
        ppo,
        "algorithm.name=ppo",
        f"trainer.steps={PPO_STEPS}",
        f"reward.model={rm / 'hf'}",
        "model.critic_init=reward_model",
        f"model.critic_lora.rank={RANK}",
        "reward.functions=[toy_exact_match]",
        "reward.weights=[0.0]",
        "parallel.tensor_parallel=2",
        "data.prompts_per_step=4",
        "rollout.sampling.n=4",
        nproc=2,
    )
    return rm, ppo


def _tensors(ckpt, prefix: str) -> dict:
    from megatron.core import dist_checkpointing

    return {
        k: v
        for k, v in dist_checkpointing.load_tensors_metadata(str(ckpt)).items()
        if k.startswith(prefix)
    }


def _load(ckpt, metadata: dict) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    sd = {k: torch.empty(m.global_shape, dtype=m.dtype) for k, m in metadata.items()}
    dcp.load(sd, checkpoint_id=str(ckpt), planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    return sd


def _trained_keys(tensors: dict, role: str, run) -> set[str]:
    """The checkpoint holds exactly `role`'s adapters and scalar head; returns the adapters'."""
    layers = yaml.safe_load((run / "config.yaml").read_text())["model"]["config"]
    layers = layers["num_hidden_layers"]
    parts = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    want = {f"{role}.lora.layers.{i}.{p}.{m}" for i in range(layers) for p in parts for m in "AB"}
    assert set(tensors) == want | {f"{role}.output_layer.weight"}, sorted(tensors)[:8]
    return want


def test_a_lora_reward_model_trains_resumes_and_exports_merged(runs):
    rm, _ = runs
    rows = _metrics(rm)
    assert [r["step"] for r in rows] == list(range(1, RM_STEPS + 2))
    assert all(r["grad_norm"] > 0 and math.isfinite(r["loss"]) for r in rows)
    assert f"resumed from {rm}/checkpoints/step_{RM_STEPS:06d}" in (
        rm.parent / "rm.log"
    ).read_text()
    ckpt = rm / "checkpoints" / f"step_{RM_STEPS + 1:06d}"
    _trained_keys(_tensors(ckpt, "reward."), "reward", rm)
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert "reward_lora_base_fingerprint" in state
    cfg = json.loads((rm / "hf" / "config.json").read_text())  # trainer.export_hf was not set
    assert cfg["architectures"] == ["LlamaForSequenceClassification"]
    from megarl.rewards.model import open_scalar_model

    with pytest.raises(ConfigError) as e:
        open_scalar_model(str(rm), "reward.model")
    assert "LoRA adapters" in str(e.value) and f"{rm}/hf" in str(e.value)


def test_a_lora_critic_trains_adapters_and_head_on_a_frozen_base(runs):
    from safetensors.torch import load_file

    rm, ppo = runs
    rows = _metrics(ppo)
    assert [r["step"] for r in rows] == list(range(1, PPO_STEPS + 1))
    for r in rows:  # scored by the LoRA reward model's export alone
        assert r["reward_mean"] == pytest.approx(r["reward/rm"])
        assert math.isfinite(r["value_loss"]) and r["value_grad_norm"] > 0
    ckpt = ppo / "checkpoints" / f"step_{PPO_STEPS:06d}"
    critic = _tensors(ckpt, "critic.")
    b_keys = [k for k in _trained_keys(critic, "critic", ppo) if k.endswith(".B")]
    head = "critic.output_layer.weight"
    trained = _load(ckpt, {k: critic[k] for k in (*b_keys, head)})
    assert all(trained[k].abs().max() > 0 for k in b_keys)  # every B left its zero init
    assert "actor.decoder.final_layernorm.weight" in _tensors(ckpt, "actor.")  # the actor: full
    export = load_file(rm / "hf" / "model.safetensors")
    moved = (trained[head].flatten() - export["score.weight"].flatten()).abs().max()
    assert moved > 0  # the value head (from the reward model's score head) trains in full
    # the critic's base after training = the export it started from (its layers, summed)
    start = sum(v.double().square().sum().item() for k, v in export.items() if ".layers." in k)
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["critic_lora_base_fingerprint"] == pytest.approx(start, rel=1e-12)
    assert "lora_base_fingerprint" not in state  # the actor has no adapters


def test_critic_adapters_need_a_critic_and_start_fresh():
    from megarl.config import load_config

    with pytest.raises(ConfigError, match="model.critic_lora.rank=4 with algorithm.name=grpo"):
        load_config(overrides=["model.critic_lora.rank=4"])
    with pytest.raises(ConfigError, match="model.critic_lora.init_from / merge"):
        load_config(
            overrides=["algorithm.name=ppo", "model.critic_lora.rank=4",
                       "model.critic_lora.merge=true"]  # fmt: skip
        )
    cfg = load_config(overrides=["algorithm.name=rm", "model.lora.rank=4"])
    assert cfg.model.lora.rank == 4  # a reward model trains with adapters
