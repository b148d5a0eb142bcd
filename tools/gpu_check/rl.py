"""The RL pieces the trainer-path checks share (step 2 and its CPU parity process): the
optimizer, rollout config and GRPO advantages as the trainer builds them, the reference / critic
initialisation from the actor, and parameter snapshots."""

from __future__ import annotations

REWARDS = [1.0, 0.0, 0.0, 1.0]
LR = 1e-3  # large enough that one Adam step changes bf16 matrices (update > half an ulp)


def copy_into(src, dst) -> None:
    """The reference / critic from the actor, as `megarl.trainer.recipe.build_run` does."""
    try:
        from megarl.convert.sharded import copy_weights
    except ImportError:  # an older tree: the canonical-state path
        import torch

        from megarl.convert.layout import gather_full_state, load_full_state
        from megarl.models.builder import ValueHead, unwrap

        full = gather_full_state(src)
        if isinstance(getattr(unwrap(dst[-1]), "output_layer", None), ValueHead):
            full["output_layer.weight"] = torch.zeros(1, next(iter(full.values())).shape[-1])
        load_full_state(dst, full)
        return
    copy_weights(src, dst)


def snapshot(chunks) -> dict:
    from megarl.models.builder import unwrap

    return {n: p.detach().clone() for c in chunks for n, p in unwrap(c).named_parameters()}


def changed(chunks, snap: dict) -> tuple[int, int, int, int]:
    """(matrices changed, matrices, vectors changed, vectors) against `snap`."""
    import torch

    from megarl.models.builder import unwrap

    counts = [0, 0, 0, 0]
    for c in chunks:
        for n, p in unwrap(c).named_parameters():
            k = 0 if p.dim() >= 2 else 2
            counts[k + 1] += 1
            counts[k] += int(not torch.equal(p.detach(), snap[n]))
    return tuple(counts)


def optimizer(chunks, dtype: str):
    from megarl.models.optim import OptimConfig, build_optimizer

    return build_optimizer(chunks, OptimConfig(lr=LR, clip_grad=1.0), dtype=dtype, total_steps=4)


def sampling_cfg(n: int, max_tokens: int):
    from megarl.rollout.config import SamplingConfig

    return SamplingConfig(n=n, max_tokens=max_tokens, temperature=1.0)


def grpo_advantages(groups, batch):
    import torch

    from megarl.algorithms.distributed_advantage import gather_advantages

    n = len(batch)
    adv = gather_advantages(
        torch.tensor(REWARDS[:n]),
        torch.zeros(n, dtype=torch.long),
        estimator="grpo",
        num_generations=n,
        scale="group",
        group=groups.dp,
    )
    return adv[:, None] * batch.loss_mask
