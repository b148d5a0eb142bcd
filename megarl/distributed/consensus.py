"""One verdict for every rank of a group, before a step that every rank must enter together.

A check that fails on one rank and raises there leaves the others inside the next collective
(vLLM's start-up, the first weight sync) until the collective timeout ends them with an error
that names nothing. `per_rank` shares each rank's figures, so every rank can raise the same
error, naming the rank that failed and why.

The exchange is one all-reduce of a CPU tensor: on a `cpu:gloo,cuda:nccl` default group it goes
over gloo, so it needs no NCCL communicator (none exists yet before vLLM starts). Without
torch.distributed initialised there is one rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def per_rank(values: list[float], group=None) -> list[list[float]]:
    """`values` of every rank of `group` (default: the default group), by rank; the same list on
    every rank. Collective; `values` must have the same length on every rank."""
    if not dist.is_initialized():
        return [list(values)]
    world, me = dist.get_world_size(group), dist.get_rank(group)
    table = torch.zeros(world, len(values), dtype=torch.float64)
    table[me] = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(table, group=group)  # each row has one writer: the sum is that row
    return table.tolist()


def failed_ranks(failed: bool, group=None) -> list[int]:
    """The ranks of `group` whose `failed` is true, the same list on every rank. Collective."""
    return [r for r, (f,) in enumerate(per_rank([float(failed)], group)) if f]
