"""From rollouts to a training batch: collate, forward passes (old / reference logprobs, values).

All per-token tensors are `[B, S]` aligned with `targets`: position t holds quantities about the
token at t + 1 (its logprob, the value of the state before it, its advantage). `loss_mask` is 1
exactly where that token is a response token. Forward passes go through megatron's schedule
(`megarl.models.forward.run`, forward-only), so they work at any TP/PP; their results exist on the
last pipeline stage only (None elsewhere), which is the only stage that computes losses.
"""

from __future__ import annotations

import torch

from megarl.data.batch import collate, split_micro_batches
from megarl.models import forward


def build_batch(
    prompt_ids,
    response_ids,
    response_logprobs,
    *,
    pad_id: int,
    pad_to: int,
    routed_experts: list | None = None,
) -> dict:
    """Collate prompts + responses and place the sampler's logprobs on the loss-mask positions;
    with MoE routing replay also the sampler's routes, as `routed_experts` [B, S, layers, top_k]
    (`megarl.models.routing.collate_routes`)."""
    batch = collate(prompt_ids, response_ids, pad_id, pad_to_multiple=pad_to)
    if routed_experts is not None:
        from megarl.models.routing import collate_routes

        width = batch["tokens"].shape[1]
        batch["routed_experts"] = collate_routes(routed_experts, batch["seq_len"], width)
    sampler = torch.zeros_like(batch["loss_mask"])
    for b, lps in enumerate(response_logprobs):
        start = int(batch["prompt_len"][b]) - 1
        sampler[b, start : start + len(lps)] = torch.tensor(lps, dtype=torch.float32)
    batch["sampler_logprobs"] = sampler
    return batch


def _assemble(outputs: list[dict], key: str, shape: torch.Size) -> torch.Tensor:
    out = torch.zeros(shape, dtype=torch.float32)
    for m in outputs:
        idx = m["index"]
        val = m[key][: len(idx)].float().cpu()  # results live on the host, like the batch
        out[idx, : val.shape[1]] = val[:, : shape[1]]
    return out


def forward_logprobs(
    chunks,
    batch: dict,
    *,
    micro_batch_size: int,
    vocab_size: int,
    groups,
    temperature: float,
    pad_to: int = 1,
    max_tokens: int | None = None,
) -> torch.Tensor | None:
    """Per-token logprobs of `targets` under `chunks` (no grad). [B, S] on the last PP stage."""

    def loss_fn(mb, logits):
        lp = forward.vocab_parallel_logprobs(
            logits,
            mb["targets"],
            vocab_size=vocab_size,
            tp_group=groups.tp,
            temperature=temperature,
        )
        return torch.zeros(()), {"index": mb["index"], "logprobs": lp.detach()}

    mbs = split_micro_batches(
        batch, micro_batch_size, pad_to_multiple=pad_to, max_tokens=max_tokens
    )
    with torch.no_grad():
        out = forward.run(chunks, mbs, loss_fn, forward_only=True, dp_size=groups.dp_size)
    if not groups.is_last_stage:
        return None
    return _assemble(out, "logprobs", batch["tokens"].shape)


def forward_values(
    chunks, batch: dict, *, micro_batch_size: int, groups, pad_to: int = 1, max_tokens=None
):
    """Critic values [B, S] (no grad) on the last PP stage, None elsewhere."""

    def loss_fn(mb, values):
        return torch.zeros(()), {"index": mb["index"], "values": values.squeeze(-1).detach()}

    mbs = split_micro_batches(
        batch, micro_batch_size, pad_to_multiple=pad_to, max_tokens=max_tokens
    )
    with torch.no_grad():
        out = forward.run(chunks, mbs, loss_fn, forward_only=True, dp_size=groups.dp_size)
    if not groups.is_last_stage:
        return None
    return _assemble(out, "values", batch["tokens"].shape)


def final_token_rewards(rewards: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Sequence rewards [B] placed on each sequence's last response token -> [B, S]."""
    out = torch.zeros_like(loss_mask)
    has = loss_mask.sum(1) > 0
    last = (loss_mask.shape[1] - 1) - loss_mask.flip(1).argmax(1)
    rows = torch.arange(len(rewards))[has]
    out[rows, last[has]] = rewards[has].to(out.dtype)
    return out
