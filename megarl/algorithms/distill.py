"""On-policy distillation's per-token signal (docs/algorithms.md#on-policy-distillation).

The student samples y ~ pi_s; a frozen teacher pi_t scores every sampled token. Token t's
advantage is

    A_t = clip(log pi_t(y_t | y_<t) - log pi_s(y_t | y_<t), -c, c)

minus the one-sample (k1) estimate of the reverse KL, KL(pi_s || pi_t), at that position. Under
a policy-gradient loss each token is its own episode (discount 0): E[A_t grad log pi_s(y_t)] is
minus the gradient of the per-token reverse KL, so the update moves the student toward the
teacher where the student puts its own mass (mode-seeking). Both logprobs are taken at the
sampling temperature.
"""

from __future__ import annotations

import torch


def distill_advantages(
    teacher_logprobs: torch.Tensor,
    student_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip: float | None = None,
) -> torch.Tensor:
    """Per-token distillation advantages.

    teacher_logprobs, student_logprobs: [B, S] logprobs of the sampled tokens (the student's
    from the policy that sampled them); loss_mask: [B, S], 1 on sampled response tokens (0 on
    prompt, padding and a multi-turn environment's tokens); clip: bound c > 0, or None.
    Returns [B, S] float32, 0 where `loss_mask` is 0."""
    if teacher_logprobs.shape != student_logprobs.shape != loss_mask.shape:
        raise ValueError(
            f"distill_advantages: shapes {tuple(teacher_logprobs.shape)}, "
            f"{tuple(student_logprobs.shape)}, {tuple(loss_mask.shape)} differ"
        )
    gap = teacher_logprobs.float() - student_logprobs.float()
    if clip is not None:
        gap = gap.clamp(-clip, clip)
    return torch.where(loss_mask.bool(), gap, torch.zeros_like(gap))
