"""Logged metrics are global: DP=1 and DP=2 log the same values for the same data.

The trainer's own step functions (`megarl.trainer.loop`: forward passes, advantages, update,
collect_metrics) run on a real megatron tiny Llama over gloo, once in one process holding the
whole batch and once split over two DP ranks whose halves have different token counts (so a
mean of per-rank means would differ from the global mean). GRPO with KL in the loss, an entropy
bonus and TIS; PPO with a critic and KL in the reward. Two epochs over two mini-batches: the
mini-batches are drawn over the global batch (`megarl.trainer.update.mini_batches`), so DP=1 and
DP=2 take the same optimizer steps on the same samples, equal up to round-off.
With `algorithm.balance_dp_tokens` the DP=2 ranks first re-deal their samples by tokens
(`loop.balance`, as the trainer does before it builds the batch): no global figure may change.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import pytest
import torch

from megarl.distributed.launch import spawn
from tests.tiny import TINY_LLAMA

N = 4  # samples per prompt
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12]]
# response lengths: rank 0's half holds 4 + 9 + 2 + 7 tokens, rank 1's 12 + 1 + 3 + 10
LENGTHS = [4, 9, 2, 7, 12, 1, 3, 10]
REWARDS = [1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.25]


def _config(algo: str):
    from megarl.config import RunConfig, build

    alg = {
        "grpo": dict(name="grpo", kl_coef=0.05, entropy_coef=0.01, off_policy_correction="tis"),
        "ppo": dict(name="ppo", kl_coef=0.05, kl_in="reward"),
    }[algo]
    return build(
        RunConfig,
        {
            "model": {"config": TINY_LLAMA},
            "optim": {"lr": 1e-2, "adam_eps": 1e-4},
            "critic_optim": {"lr": 1e-2, "adam_eps": 1e-4},
            "rollout": {"sampling": {"n": N, "temperature": 0.9, "max_tokens": 12}},
            "algorithm": {**alg, "ppo_epochs": 2, "mini_batches": 2, "micro_batch_size": 3},
        },
    )


def _state(arch):
    from megarl.convert.mapping import canonical_shapes_for

    g = torch.Generator().manual_seed(3)
    return {
        k: (1 + 0.1 * torch.randn(s, generator=g))
        if "norm" in k
        else torch.randn(s, generator=g) / s[-1] ** 0.5
        for k, s in canonical_shapes_for(arch).items()
    }


def job(rank: int, world: int, algo: str, balanced: bool = False) -> dict:
    from megarl.convert.layout import load_full_state
    from megarl.data.batch import MicroBatching
    from megarl.distributed import Topology
    from megarl.metrics.reduce import LocalMetrics
    from megarl.models.builder import build_model
    from megarl.models.hf_config import arch_from_hf
    from megarl.models.optim import build_optimizer
    from megarl.rollout import Samples
    from megarl.rollout.metrics import sample_metrics
    from megarl.trainer import experience as xp
    from megarl.trainer import loop
    from megarl.trainer.models import Models, Trained

    torch.set_num_threads(1)
    cfg = _config(algo)
    arch = arch_from_hf(TINY_LLAMA)
    groups = Topology.for_model(cfg.parallel, world, arch).initialize(seed=0)
    state = _state(arch)

    def make(role, weights):
        chunks = build_model(arch, cfg.parallel, cfg.precision, role=role)
        load_full_state(chunks, weights)
        return chunks

    actor = make("actor", state)
    # a reference some steps behind the actor, so the rollout's KL to it is not 0
    gr = torch.Generator().manual_seed(11)
    ref_state = {k: v + 0.05 * torch.randn(v.shape, generator=gr) for k, v in state.items()}
    opt, sched = build_optimizer(actor, cfg.optim, dtype="fp32", total_steps=4)
    critic = None
    if algo == "ppo":
        chunks = make("critic", {**state, "output_layer.weight": torch.zeros(1, arch.hidden_size)})
        critic = Trained(chunks, *build_optimizer(chunks, cfg.critic_optim, dtype="fp32"))
    g = torch.Generator().manual_seed(7)
    responses = [torch.randint(3, 200, (n,), generator=g).tolist() for n in LENGTHS]
    sampler = [(-torch.rand(n, generator=g) - 0.5).tolist() for n in LENGTHS]
    rows = range(rank * len(LENGTHS) // world, (rank + 1) * len(LENGTHS) // world)
    prompt_of = [i // N for i in range(len(LENGTHS))]
    rollout = Samples(
        prompt_index=[prompt_of[i] for i in rows],
        prompt_ids=[PROMPTS[prompt_of[i]] for i in rows],
        response_ids=[responses[i] for i in rows],
        response_logprobs=[sampler[i] for i in rows],
        finish_reason=["stop"] * len(rows),
    )
    rewards = torch.tensor([REWARDS[i] for i in rows])
    group_ids = torch.tensor([prompt_of[i] for i in rows])  # global prompt ids
    reward_metrics = LocalMetrics()
    run = SimpleNamespace(
        cfg=cfg,
        groups=groups,
        arch=arch,
        step=0,
        pad_to=1,  # Run.pad_to at TP 1 without FP8
        micro_batching=MicroBatching.of(cfg.algorithm, pad_to=1),
        models=Models(
            actor=Trained(actor, opt, sched),
            reference=make("reference", ref_state),
            critic=critic,
        ),
        rollout=SimpleNamespace(
            samples_generated=lambda: len(rows), metrics=lambda s: sample_metrics(s, 0)
        ),
    )
    reward_metrics.add_ratio("reward/toy", rewards.sum(), len(rewards))
    scored = xp.Scored(
        rewards=rewards,
        per_function={"toy": rewards.clone()},
        metrics=reward_metrics,
        group_ids=group_ids,
    )
    if balanced:  # whole strata of two (one sample per mini-batch) move
        rollout, scored = loop.balance(run, rollout, scored)
    batch = xp.build_batch(
        rollout.prompt_ids, rollout.response_ids, rollout.response_logprobs, pad_id=0, pad_to=1
    )
    loop.forward_passes(run, batch)
    loop.advantages(run, batch, scored)
    train = loop.update(run, batch, scored.positions)
    out = loop.collect_metrics(run, rollout, batch, scored, train, {"train": 1.0}, 1.0)
    return out


@functools.cache
def _one_rank(algo: str) -> dict:
    return spawn(job, 1, algo, timeout=600)[0]


@pytest.mark.parametrize("algo,balanced", [("grpo", False), ("ppo", False), ("ppo", True)])
def test_dp1_and_dp2_log_the_same_metrics(algo, balanced):
    one = dict(_one_rank(algo))
    two = spawn(job, 2, algo, balanced, timeout=600)[0]
    one.pop("time_s"), two.pop("time_s")
    if balanced:  # prompt + response tokens: rank 0's half 34, rank 1's 46; then 40 and 40
        before = two.pop("dp_tokens_max_over_mean_before")
        after = two.pop("dp_tokens_max_over_mean")
        assert before > after and after == pytest.approx(1.0, abs=0.1), (before, after)
    assert one.keys() == two.keys()
    must = {
        "loss",
        "pg_loss",
        "kl",
        "kl_loss",
        "entropy",
        "logprob_mismatch",
        "logprob_mismatch_max",
        "reward_mean",
        "reward_std",
        "response_len",
        "rollout/samples_generated",
        "tokens_per_s",
        "clip_frac",
        "ratio_max",
    }
    if algo == "ppo":
        must = (must - {"kl_loss", "entropy"}) | {"value_loss", "value_error"}
    assert must <= one.keys(), must - one.keys()
    for k in sorted(one):
        a, b = one[k], two[k]
        print(f"{algo} {k}: DP1 {a:.6g} DP2 {b:.6g}")
        assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6), (k, a, b)
    assert one["kl"] > 0 and one["reward_mean"] == pytest.approx(sum(REWARDS) / len(REWARDS))
