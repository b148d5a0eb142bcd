"""Equal tokens per data-parallel rank (`algorithm.balance_dp_tokens`).

Each DP rank generates its own prompts, so one rank can end a step with most of the long
responses and hold every other rank at the gradient all-reduce while it finishes. After scoring,
the samples of a step are re-dealt over the DP ranks: every rank keeps the number of samples it
held (the same on every rank, except after a short step of dynamic sampling), so mini-batch
splits and megatron's schedules stay as they are, and the token totals
(prompt + response) become as equal as a greedy longest-first assignment makes them.

Nothing in the math depends on which rank holds a sample: group advantages are gathered by global
prompt id (`gather_advantages`), loss denominators are counted over the whole mini-batch across
DP (`megarl.algorithms.losses`) and metrics are global, and the update's mini-batches are drawn
over each sample's place in the global batch, which travels with it. So the update is the same up
to the order of float sums (`tests/test_balance.py`, `tests/test_metrics_global.py`). With
several mini-batches the samples move in whole strata (one sample of each mini-batch), so every
rank still gives every mini-batch the same number of samples.

The exchange gathers every rank's samples on every rank of the DP group (one object all-gather
of every sample's fields: token ids, sampler logprobs, MoE routes, multi-turn masks and
trajectories): simple and exact, at the cost of the step's whole batch in host memory on each
rank.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megarl.rollout import Samples


def balanced_partition(
    lengths: Sequence[int], parts: int, sizes: Sequence[int] | None = None
) -> list[list[int]]:
    """Indices of `lengths` dealt into `parts` lists of `sizes[p]` each (default: all
    `len(lengths) // parts`, which must then divide), longest first onto the part with the
    fewest tokens that has room (ties: the lowest part index); each list sorted.
    Deterministic."""
    if sizes is None:
        if parts < 1 or len(lengths) % parts:
            raise ValueError(f"{len(lengths)} samples cannot be dealt equally to {parts} ranks")
        sizes = [len(lengths) // parts] * parts
    if len(sizes) != parts or sum(sizes) != len(lengths) or min(sizes, default=0) < 0:
        raise ValueError(
            f"{len(lengths)} samples cannot be dealt as {list(sizes)} to {parts} parts"
        )
    heap = [(0, p) for p in range(parts) if sizes[p] > 0]
    heapq.heapify(heap)
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        tokens, p = heapq.heappop(heap)
        out[p].append(i)
        if len(out[p]) < sizes[p]:
            heapq.heappush(heap, (tokens + lengths[i], p))
    return [sorted(o) for o in out]


def strata_partition(
    lengths: Sequence[int], positions: Sequence[int], strata: int, sizes: Sequence[int]
) -> list[list[int]]:
    """`balanced_partition` of whole strata (the `strata` samples at positions s x strata ..
    s x strata + strata - 1, which the update deals one to each mini-batch:
    `megarl.trainer.update.mini_batches`), so that every rank gives every mini-batch the same
    number of samples; per sample when the strata are not whole or `sizes` not multiples."""
    members: dict[int, list[int]] = {}
    for i, p in enumerate(positions):
        members.setdefault(p // strata, []).append(i)
    whole = all(len(m) == strata for m in members.values())
    if strata == 1 or not whole or any(s % strata for s in sizes):
        return balanced_partition(lengths, len(sizes), sizes)
    units = list(members.values())
    unit_lengths = [sum(lengths[i] for i in m) for m in units]
    plan = balanced_partition(unit_lengths, len(sizes), [s // strata for s in sizes])
    return [sorted(i for u in part for i in units[u]) for part in plan]


def balance_over_dp(
    rollout: Samples,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    positions: torch.Tensor,
    group,
    *,
    strata: int = 1,
) -> tuple[Samples, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """This rank's share of the step's samples after re-dealing them over `group` (the DP group)
    by tokens, in whole strata of `strata` positions (`strata_partition`; the update's
    mini-batch count). `rewards`: [b] or [b, k] (e.g. the total beside each reward function's
    value); `positions` [b]: the samples' places in the global batch. Returns (rollout, rewards
    [b] or [b, k], group_ids [b], positions [b], metrics): `rollout.prompt_index` is then the
    sample's global prompt id (it no longer indexes this rank's prompts); metrics are the
    largest rank's tokens over the mean, before and after."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    piece = (rollout, rewards.tolist(), [int(i) for i in group_ids], [int(p) for p in positions])
    gathered: list = [None] * world
    dist.all_gather_object(gathered, piece, group=group)
    sizes = [len(g[0]) for g in gathered]
    every = Samples.concat([g[0] for g in gathered])
    every_rewards = [r for g in gathered for r in g[1]]
    every_ids = [i for g in gathered for i in g[2]]
    every_positions = [p for g in gathered for p in g[3]]
    lengths = [len(p) + len(r) for p, r in zip(every.prompt_ids, every.response_ids, strict=True)]
    plan = strata_partition(lengths, every_positions, strata, sizes)

    def imbalance(parts: list[list[int]]) -> float:
        sums = [sum(lengths[i] for i in p) for p in parts]
        return max(sums) / max(sum(sums) / world, 1e-9)

    starts = [sum(sizes[:r]) for r in range(world)]
    before = [list(range(starts[r], starts[r] + sizes[r])) for r in range(world)]
    metrics = {
        "dp_tokens_max_over_mean_before": imbalance(before),
        "dp_tokens_max_over_mean": imbalance(plan),
    }
    ids = [every_ids[i] for i in plan[rank]]
    out = every.take(plan[rank], prompt_index=ids)
    new_rewards = torch.tensor([every_rewards[i] for i in plan[rank]], dtype=rewards.dtype)
    new_positions = torch.tensor([every_positions[i] for i in plan[rank]], dtype=torch.long)
    return out, new_rewards, torch.tensor(ids, dtype=torch.long), new_positions, metrics
