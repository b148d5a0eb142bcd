"""Work the trainer skips or regroups changes no loss, metric or gradient.

1. One epoch over one mini-batch: the update's own detached logprobs are the old ones. A
   separate old-logprob forward pass cannot change such an update (ratio = 1 by construction),
   also not with truncated importance sampling (its weights exp(old - sampler) come from the
   same logprobs); the trainer skips it (`update.recompute_old_logprobs`).
2. A token budget per micro-batch (`algorithm.max_tokens_per_micro_batch`) only regroups the
   sequences (global loss denominators).
The update runs each way on a real megatron tiny Llama, from the same weights and batch; the
test compares the loss, every metric, the gradients handed to the optimizer, and the old
logprobs the metrics are computed from. Layouts: one process, and PP=2 (only the last stage
holds logprobs; stages exchange one padded shape).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from megarl.distributed.launch import spawn
from tests.test_metrics_global import LENGTHS, PROMPTS, _state
from tests.tiny import TINY_LLAMA


def job(rank: int, world: int, layout: dict) -> dict:
    from megarl.config import RunConfig, build
    from megarl.convert.layout import gather_full_state, load_full_state
    from megarl.data.batch import MicroBatching
    from megarl.distributed import Topology
    from megarl.models.builder import build_model
    from megarl.models.hf_config import arch_from_hf
    from megarl.models.optim import build_optimizer
    from megarl.trainer import experience as xp
    from megarl.trainer import update

    torch.set_num_threads(1)
    cfg = build(
        RunConfig,
        {
            "model": {"config": TINY_LLAMA},
            "parallel": layout,
            "optim": {"lr": 1e-2, "adam_eps": 1e-4},
            "rollout": {"sampling": {"n": 4, "temperature": 0.9, "max_tokens": 12}},
            "algorithm": {"entropy_coef": 0.01, "micro_batch_size": 3},
        },
    )
    assert not update.recompute_old_logprobs(cfg.algorithm)
    assert not update.recompute_old_logprobs(
        dataclasses.replace(cfg.algorithm, off_policy_correction="tis")
    )
    arch = arch_from_hf(TINY_LLAMA)
    groups = Topology.for_model(cfg.parallel, world, arch).initialize(seed=0)
    g = torch.Generator().manual_seed(7)
    responses = [torch.randint(3, 200, (n,), generator=g).tolist() for n in LENGTHS]
    prompts = [PROMPTS[i // 4] for i in range(len(LENGTHS))]
    # sampler logprobs around the tiny model's own (~ -ln 250): TIS weights on both sides of 1
    sampler = [(-6.0 + torch.rand(n, generator=g)).tolist() for n in LENGTHS]
    grads = {}
    original_step = update.optimizer_step

    def capture(optimizer, scheduler, loss_ok, groups_):
        grads[mode] = gather_full_state(actor, grads=True)
        return original_step(optimizer, scheduler, loss_ok, groups_)

    update.optimizer_step = capture
    out = {}
    for mode in ("recompute", "reuse", "budget", "recompute_tis", "reuse_tis"):
        alg = cfg.algorithm
        if mode == "budget":  # 40 tokens: micro-batches of 1 to 4 sequences instead of 3
            alg = dataclasses.replace(alg, max_tokens_per_micro_batch=40)
        if mode.endswith("_tis"):
            alg = dataclasses.replace(alg, off_policy_correction="tis", is_high=1.5)
        actor = build_model(arch, cfg.parallel, cfg.precision, role="actor")
        load_full_state(actor, _state(arch))
        opt, sched = build_optimizer(actor, cfg.optim, dtype="fp32", total_steps=2)
        batch = xp.build_batch(prompts, responses, sampler, pad_id=0, pad_to=1)
        batch.advantages = torch.linspace(-1, 1, len(LENGTHS))[:, None] * batch.loss_mask
        if mode.startswith("recompute"):
            batch.old_logprobs = xp.forward_logprobs(
                actor,
                batch.fields(),
                micro=MicroBatching(size=3, pack=True),
                vocab_size=arch.vocab_size,
                groups=groups,
                temperature=0.9,
            )
        metrics = update.train_policy(
            actor,
            opt,
            sched,
            batch,
            alg=alg,
            sampling=cfg.rollout.sampling,
            vocab_size=arch.vocab_size,
            groups=groups,
            seed=5,
        ).reduce(groups.dp)
        out[mode] = {
            "metrics": metrics,
            "old": batch.old_logprobs,
            "grads": grads[mode],
            "mask": batch.loss_mask,
        }
    return out


@functools.cache
def _results(layout: tuple) -> dict:
    layout = dict(layout)
    return spawn(job, 2 if layout else 1, layout, timeout=600)[-1]  # last rank: last PP stage


@pytest.mark.parametrize("layout", [{}, {"pipeline_parallel": 2}], ids=["1rank", "pp2"])
@pytest.mark.parametrize(
    "pair", [("recompute", "reuse"), ("reuse", "budget"), ("recompute_tis", "reuse_tis")]
)
def test_skipped_or_regrouped_work_changes_nothing(layout, pair):
    res = _results(tuple(sorted(layout.items())))
    a, b = res[pair[0]], res[pair[1]]
    assert a["metrics"].keys() == b["metrics"].keys()
    for k in a["metrics"]:
        assert a["metrics"][k] == pytest.approx(b["metrics"][k], rel=1e-5, abs=1e-6), k
    assert b["metrics"]["ratio_max"] == pytest.approx(1.0, abs=1e-5)
    if pair[0].endswith("_tis"):  # the weights were applied, some of them capped
        assert 0.5 < b["metrics"]["is_weight_mean"] < 1.5
        assert b["metrics"]["loss"] != pytest.approx(res["reuse"]["metrics"]["loss"], rel=1e-3)
    m = a["mask"].bool()
    assert torch.allclose(a["old"][m], b["old"][m], atol=1e-6)
    assert a["grads"].keys() == b["grads"].keys()
    worst = max((a["grads"][k] - b["grads"][k]).abs().max().item() for k in a["grads"])
    scale = max(a["grads"][k].abs().max().item() for k in a["grads"])
    print(f"{layout} {pair}: max |grad diff| {worst:.2e} (max |grad| {scale:.2e})")
    assert worst <= 1e-6 * scale
