"""Supervised fine-tuning loss: token-mean negative log-likelihood of the trained tokens.

Like the RL losses (`megarl.algorithms.losses`), the function returns one micro-batch's *share*
of the global loss: its numerator over the number of trained tokens of the whole step (all
micro-batches, all DP ranks), so the shares add up to the step's loss and the gradient does not
depend on the micro-batch or DP split. Its metrics are shares in the same sense.
"""

from __future__ import annotations

import torch

Number = float | int | torch.Tensor


def sft_loss(
    logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    global_tokens: Number,
    correct: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`-sum(M * logprobs) / global_tokens`, this micro-batch's share of the token-mean NLL.

    logprobs: `[B, T]` log p(target) under the policy (differentiated); mask: `[B, T]` 1 where
    the target is a trained token; correct: `[B, T]` bool, whether the target is the argmax
    (teacher-forced). `global_tokens`: trained tokens of the whole step (> 0). Metrics (shares,
    detached): `nll` (the loss) and, with `correct`, `token_accuracy` (correct trained tokens
    over `global_tokens`)."""
    if not isinstance(global_tokens, torch.Tensor) and global_tokens <= 0:
        raise ValueError(f"sft_loss: global_tokens must be > 0; got {global_tokens!r}")
    valid = mask.bool()
    # where, not logprobs * mask: padding may hold -inf and -inf * 0 = NaN
    loss = -torch.where(valid, logprobs, 0.0).sum() / global_tokens
    metrics = {"nll": loss.detach()}
    if correct is not None:
        metrics["token_accuracy"] = (correct & valid).sum().to(logprobs.dtype) / global_tokens
    return loss, metrics
