"""From rollouts to a training batch: collate, forward passes (old / reference / teacher
logprobs, values).

The step's data is one `StepBatch` (the collated tensors, then the fields the named steps of
`megarl.trainer.loop` set: forward passes, advantages) and its rewards one `Scored`. All
per-token tensors are `[B, S]` aligned with `targets`: position t holds quantities about the
token at t + 1 (its logprob, the value of the state before it, its advantage). `loss_mask` is 1
exactly where that token is a response token. Forward passes go through megatron's schedule
(`megarl.models.forward.forward_backward`, forward-only), so they work at any TP/PP; their
results exist on the last pipeline stage only (None elsewhere), which is the only stage that
computes losses.
Micro-batches are the plain dicts `split_micro_batches(batch.fields(), ...)` makes: megatron's
data-iterator items.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megarl.data.batch import MicroBatching, collate, split_micro_batches
from megarl.metrics.reduce import LocalMetrics
from megarl.models import forward
from megarl.models.routing import collate_routes


@dataclass(frozen=True, kw_only=True)
class Scored:
    """This rank's scored samples (`megarl.trainer.loop.score`), in the rollout's order: what
    balancing, the advantages, the metrics and `samples.jsonl` read."""

    rewards: torch.Tensor
    """[B]: each sample's total reward."""
    per_function: dict[str, torch.Tensor]
    """{reward function (and "rm"): [B]}: each function's value per sample, NaN where it does
    not apply."""
    metrics: LocalMetrics
    """The reward metrics of the step (reward/<name>, reward_errors, ...)."""
    group_ids: torch.Tensor
    """[B] long: each sample's global prompt id (its advantage group)."""
    positions: torch.Tensor | None = None
    """[B] long: each sample's place in the step's global batch, which the update draws its
    mini-batches over (`megarl.trainer.update.mini_batches`); it travels with the sample when
    balancing moves it. None: this rank's rows in rank order (`update.local_positions`)."""


@dataclass(kw_only=True)
class StepBatch:
    """One RL step's batch on this rank: B sequences, right-padded to width S.

    The collated fields come from `build_batch`; the forward-pass outputs and the advantages
    are None until `megarl.trainer.loop.forward_passes` / `advantages` (or
    `megarl.trainer.update.train_policy`, for `old_logprobs`) set them, and stay None off the
    last pipeline stage."""

    tokens: torch.Tensor
    """[B, S] long: prompt + response token ids, `pad_id` after `seq_len`."""
    targets: torch.Tensor
    """[B, S] long: `tokens` shifted left by one (the token each position predicts)."""
    loss_mask: torch.Tensor
    """[B, S] float32: 1 where the target is a response token."""
    prompt_len: torch.Tensor
    """[B] long: prompt tokens."""
    response_len: torch.Tensor
    """[B] long: response tokens."""
    seq_len: torch.Tensor
    """[B] long: prompt + response tokens."""
    sampler_logprobs: torch.Tensor
    """[B, S] float32: the sampler's (vLLM's) logprob of each response token, 0 elsewhere."""
    routed_experts: torch.Tensor | None = None
    """[B, S, layers, top_k] long: the sampler's MoE routes (routing replay); None without."""
    old_logprobs: torch.Tensor | None = None
    """[B, S] float32: the old policy's logprobs (`forward_passes`, or the update's own forward:
    `megarl.trainer.update.recompute_old_logprobs`)."""
    ref_logprobs: torch.Tensor | None = None
    """[B, S] float32: the reference model's logprobs (when there is a reference)."""
    teacher_logprobs: torch.Tensor | None = None
    """[B, S] float32: the distillation teacher's logprobs (when there is a teacher)."""
    teacher_top1: torch.Tensor | None = None
    """[B, S] float32: 1 where the sampled token is the teacher's argmax."""
    old_values: torch.Tensor | None = None
    """[B, S] float32: the critic's values at rollout (PPO)."""
    advantages: torch.Tensor | None = None
    """[B, S]: per-token advantages, 0 outside `loss_mask` (`loop.advantages`)."""
    returns: torch.Tensor | None = None
    """[B, S]: GAE returns, the critic's targets (PPO)."""

    def __len__(self) -> int:
        """B, the number of sequences."""
        return self.tokens.shape[0]

    def fields(self) -> dict[str, torch.Tensor]:
        """The fields that are set, by name: what `split_micro_batches` cuts into micro-batch
        dicts (`megarl.models.forward`'s data-iterator items)."""
        return {
            f.name: value
            for f in dataclasses.fields(self)
            if (value := getattr(self, f.name)) is not None
        }

    def select(self, rows: torch.Tensor) -> StepBatch:
        """The batch of the sequences `rows` ([b] long), in that order."""
        return StepBatch(**{k: v[rows] for k, v in self.fields().items()})


def build_batch(
    prompt_ids,
    response_ids,
    response_logprobs,
    *,
    pad_id: int,
    pad_to: int,
    routed_experts: list | None = None,
    response_mask: list[list[int]] | None = None,
) -> StepBatch:
    """Collate prompts + responses and place the sampler's logprobs on the loss-mask positions;
    with MoE routing replay also the sampler's routes, as `routed_experts` [B, S, layers, top_k]
    (`megarl.models.routing.collate_routes`). `response_mask` (multi-turn: 1 on sampled tokens,
    0 on the environment's) zeroes `loss_mask` where the target is an environment token, so
    every loss, KL, entropy and advantage counts sampled tokens only."""
    collated = collate(prompt_ids, response_ids, pad_id, pad_to_multiple=pad_to)
    if response_mask is not None:
        mask = collated["loss_mask"]
        for b, sampled in enumerate(response_mask):
            if len(sampled) != len(response_ids[b]):
                raise ValueError(
                    f"build_batch: sample {b} has {len(response_ids[b])} response tokens but a "
                    f"response_mask of {len(sampled)}"
                )
            start = int(collated["prompt_len"][b]) - 1
            mask[b, start : start + len(sampled)] *= torch.tensor(sampled, dtype=mask.dtype)
    routes = None
    if routed_experts is not None:
        width = collated["tokens"].shape[1]
        routes = collate_routes(routed_experts, collated["seq_len"], width)
    sampler = torch.zeros_like(collated["loss_mask"])
    for b, lps in enumerate(response_logprobs):
        start = int(collated["prompt_len"][b]) - 1
        sampler[b, start : start + len(lps)] = torch.tensor(lps, dtype=torch.float32)
    return StepBatch(**collated, sampler_logprobs=sampler, routed_experts=routes)


def _assemble(outputs: list[dict], key: str, shape: torch.Size) -> torch.Tensor:
    out = torch.zeros(shape, dtype=torch.float32)
    for m in outputs:
        idx = m["index"]
        val = m[key][: len(idx)].float().cpu()  # results live on the host, like the batch
        out[idx, : val.shape[1]] = val[:, : shape[1]]
    return out


def forward_logprobs(
    chunks, batch: dict, *, micro: MicroBatching, vocab_size: int, groups, temperature: float
) -> torch.Tensor | None:
    """Per-token logprobs of `targets` under `chunks` (no grad). [B, S] on the last PP stage.

    `batch`: the batch's fields by name (`StepBatch.fields()`, or an offline stage's batch)."""

    def loss_fn(mb, logits):
        lp = forward.token_logprobs(
            mb, logits, vocab_size=vocab_size, tp_group=groups.tp, temperature=temperature
        )
        return torch.zeros(()), {"index": mb["index"], "logprobs": lp.detach()}

    out = _forward_only(chunks, batch, loss_fn, ("logprobs",), groups, micro)
    return None if out is None else out[0]


def forward_teacher(
    chunks, batch: dict, *, micro: MicroBatching, vocab_size: int, groups, temperature: float
) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
    """The teacher's logprobs of `targets` and whether each is its argmax (1.0 / 0.0), both
    [B, S] float32 on the last PP stage ((None, None) elsewhere), no grad. `vocab_size`: the
    teacher's. The sampler's MoE routes are the policy's, so they are not passed on."""

    def loss_fn(mb, logits):
        kw = dict(vocab_size=vocab_size, tp_group=groups.tp)
        lp = forward.token_logprobs(mb, logits, temperature=temperature, **kw)
        top1 = forward.token_top1(mb, logits, **kw)
        return torch.zeros(()), {"index": mb["index"], "logprobs": lp.detach(), "top1": top1}

    fields = {k: v for k, v in batch.items() if k != "routed_experts"}
    out = _forward_only(chunks, fields, loss_fn, ("logprobs", "top1"), groups, micro)
    return (None, None) if out is None else out


def forward_values(chunks, batch: dict, *, micro: MicroBatching, groups) -> torch.Tensor | None:
    """Critic values [B, S] (no grad) on the last PP stage, None elsewhere. `batch`: the batch's
    fields by name (`StepBatch.fields()`)."""

    def loss_fn(mb, values):
        v = forward.per_token(mb, values.squeeze(-1))
        return torch.zeros(()), {"index": mb["index"], "values": v.detach()}

    out = _forward_only(chunks, batch, loss_fn, ("values",), groups, micro)
    return None if out is None else out[0]


def _forward_only(
    chunks, batch: dict, loss_fn, keys: tuple[str, ...], groups, micro: MicroBatching
) -> tuple[torch.Tensor, ...] | None:
    """`loss_fn`'s per-row outputs `keys` over the whole batch, each [B, S] float32 on the last
    PP stage (None elsewhere): the batch split into micro-batches, run forward-only through
    megatron."""
    mbs = split_micro_batches(batch, micro)
    with torch.no_grad():
        out = forward.forward_backward(
            chunks, mbs, loss_fn, forward_only=True, dp_size=groups.dp_size
        )
    if not groups.is_last_stage:
        return None
    return tuple(_assemble(out, key, batch["tokens"].shape) for key in keys)


def final_token_rewards(rewards: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Sequence rewards [B] placed on each sequence's last response token -> [B, S]."""
    out = torch.zeros_like(loss_mask)
    has = loss_mask.sum(1) > 0
    last = (loss_mask.shape[1] - 1) - loss_mask.flip(1).argmax(1)
    rows = torch.arange(len(rewards))[has]
    out[rows, last[has]] = rewards[has].to(out.dtype)
    return out
