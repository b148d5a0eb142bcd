"""Trainer-vs-sampler logprob mismatch: how far vLLM's logprobs are from Megatron's.

Both sides score the same tokens of the same sequences; with identical weights the difference is
numerical (kernels, reduction order, dtype). The trainer logs it every step as
`logprob_mismatch` (a drifting figure means the sync or a kernel is wrong, or the importance
ratios of off-policy corrections are biased).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def logprob_mismatch(
    trainer_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    group=None,
) -> dict[str, float]:
    """Mean and max of |trainer - sampler| over the tokens where `mask` is set.

    trainer_logprobs, sampler_logprobs, mask: [B, T] (mask 0/1 or bool). With `group` (e.g. the
    DP group) the figures are over all ranks' tokens: mean = global sum / global count.
    Returns {"mean": float, "max": float, "tokens": int}; zeros when there is no token."""
    if trainer_logprobs.shape != sampler_logprobs.shape or trainer_logprobs.shape != mask.shape:
        raise ValueError(
            f"logprob_mismatch: shapes differ: trainer {tuple(trainer_logprobs.shape)}, sampler "
            f"{tuple(sampler_logprobs.shape)}, mask {tuple(mask.shape)}"
        )
    m = mask.bool()
    diff = (trainer_logprobs.double() - sampler_logprobs.double()).abs()[m]
    stats = torch.tensor([diff.sum().item(), float(diff.numel())], dtype=torch.float64)
    peak = torch.tensor([diff.max().item() if diff.numel() else 0.0], dtype=torch.float64)
    if group is not None:
        dist.all_reduce(stats, group=group)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    count = int(stats[1].item())
    return {
        "mean": float(stats[0] / count) if count else 0.0,
        "max": float(peak[0]),
        "tokens": count,
    }
