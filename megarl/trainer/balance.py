"""Equal tokens per data-parallel rank (`algorithm.balance_dp_tokens`).

Each DP rank generates its own prompts, so one rank can end a step with most of the long
responses and hold every other rank at the gradient all-reduce while it finishes. After scoring,
the samples of a step are re-dealt over the DP ranks: every rank keeps the same number of
samples (mini-batch splits and megatron's schedules stay as they are) and the token totals
(prompt + response) become as equal as a greedy longest-first assignment makes them.

Nothing in the math depends on which rank holds a sample: group advantages are gathered by global
prompt id (`gather_advantages`), loss denominators are counted over the whole mini-batch across
DP (`megarl.algorithms.losses`) and metrics are global. With one mini-batch the update is the same
up to the order of float sums (`tests/test_balance.py`); with several, the mini-batches hold
different samples (as with another DP size).

The exchange gathers every rank's samples on every rank of the DP group (one object all-gather
of token ids, sampler logprobs and MoE routes): simple and exact, at the cost of the step's
whole batch in host memory on each rank.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megarl.rollout.engine import Rollout


def balanced_partition(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Indices of `lengths` dealt into `parts` lists of `len(lengths) // parts` each, longest
    first onto the part with the fewest tokens that has room (ties: the lowest part index);
    each list sorted. Deterministic. Requires `len(lengths) % parts == 0`."""
    if parts < 1 or len(lengths) % parts:
        raise ValueError(f"{len(lengths)} samples cannot be dealt equally to {parts} ranks")
    size = len(lengths) // parts
    heap = [(0, p) for p in range(parts)]
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        tokens, p = heapq.heappop(heap)
        out[p].append(i)
        if len(out[p]) < size:
            heapq.heappush(heap, (tokens + lengths[i], p))
    return [sorted(o) for o in out]


def balance_over_dp(
    rollout: Rollout, rewards: torch.Tensor, group_ids: torch.Tensor, group
) -> tuple[Rollout, torch.Tensor, torch.Tensor, dict]:
    """This rank's share of the step's samples after re-dealing them over `group` (the DP group)
    by tokens. `rewards`: [b] or [b, k] (e.g. the total beside each reward function's value).
    Returns (rollout, rewards [b] or [b, k], group_ids [b], metrics): `rollout.prompt_index` is
    then the sample's global prompt id (it no longer indexes this rank's prompts); metrics are
    the largest rank's tokens over the mean, before and after."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n = len(rollout)
    rows = [
        (
            rollout.prompt_ids[i],
            rollout.response_ids[i],
            rollout.response_logprobs[i],
            rollout.finish_reason[i],
            None if rollout.routed_experts is None else rollout.routed_experts[i],
            rewards[i].tolist(),
            int(group_ids[i]),
        )
        for i in range(n)
    ]
    gathered: list = [None] * world
    dist.all_gather_object(gathered, rows, group=group)
    if any(len(g) != n for g in gathered):
        raise RuntimeError(f"balance_over_dp: ranks hold {[len(g) for g in gathered]} samples")
    every = [r for g in gathered for r in g]
    lengths = [len(r[0]) + len(r[1]) for r in every]
    plan = balanced_partition(lengths, world)
    mine = [every[i] for i in plan[rank]]

    def imbalance(parts: list[list[int]]) -> float:
        sums = [sum(lengths[i] for i in p) for p in parts]
        return max(sums) / max(sum(sums) / world, 1e-9)

    before = [list(range(r * n, (r + 1) * n)) for r in range(world)]
    metrics = {
        "dp_tokens_max_over_mean_before": imbalance(before),
        "dp_tokens_max_over_mean": imbalance(plan),
    }
    ids = [r[6] for r in mine]
    out = dataclasses.replace(
        rollout,
        prompt_index=ids,
        prompt_ids=[r[0] for r in mine],
        response_ids=[r[1] for r in mine],
        response_logprobs=[r[2] for r in mine],
        finish_reason=[r[3] for r in mine],
        routed_experts=None if rollout.routed_experts is None else [r[4] for r in mine],
    )
    new_rewards = torch.tensor([r[5] for r in mine], dtype=rewards.dtype)
    return out, new_rewards, torch.tensor(ids, dtype=torch.long), metrics
