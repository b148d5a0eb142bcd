"""Colocated engines: who generates which prompts, every prompt of a step exactly once.

The ranks of one trainer model-parallel group (TP x PP) hold the same prompts: one data-parallel
rank's share of the step. vLLM instances are blocks of TP' consecutive global ranks (vLLM's
`external_launcher` executor; on CPU TP' = 1, one instance per rank), and every rank of an
instance must submit the same requests. Letting every rank generate its own prompts would make
each DP share be generated TP x PP / TP' times, and all but one copy thrown away.

The plan, computed once from the layout (`DispatchPlan`): the instances holding at least one
rank of DP rank d (`covering(d)`, in rank order) split d's prompts into contiguous chunks, one
chunk each. An instance's requests are its chunks of every DP rank it covers (usually one; two
or more when TP' > TP spans DP ranks). After generation each instance's leader among d's ranks
hands d's samples to all of d's ranks (one object all-gather inside d's group), which
re-assemble them in prompt order.

The cut and the merge are `megarl.rollout.placement.shares`'.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from megarl.rollout.placement.shares import contiguous, in_prompt_order, route
from megarl.rollout.samples import Samples


@dataclass(frozen=True)
class DispatchPlan:
    """Static assignment of DP shares to vLLM instances (pure; see module docstring)."""

    instances: tuple[tuple[int, ...], ...]
    """Global ranks of each vLLM instance."""
    dp_of: tuple[int, ...]
    """Trainer data-parallel rank of every global rank."""

    @staticmethod
    def create(dp_of: list[int] | tuple[int, ...], vllm_tp: int) -> DispatchPlan:
        world = len(dp_of)
        if vllm_tp < 1 or world % vllm_tp:
            raise ValueError(
                f"rollout.engine.tensor_parallel={vllm_tp} must divide the world size {world}: "
                "vLLM instances are blocks of that many consecutive ranks"
            )
        blocks = tuple(tuple(range(s, s + vllm_tp)) for s in range(0, world, vllm_tp))
        return DispatchPlan(blocks, tuple(dp_of))

    def instance_of(self, rank: int) -> int:
        return rank // len(self.instances[0])

    def covered(self, instance: int) -> list[int]:
        """DP ranks with at least one rank in `instance`, ascending."""
        return sorted({self.dp_of[r] for r in self.instances[instance]})

    def covering(self, dp: int) -> list[int]:
        """Instances holding at least one rank of DP rank `dp`, ascending."""
        return [i for i in range(len(self.instances)) if dp in self.covered(i)]

    def chunk(self, dp: int, instance: int, num_prompts: int) -> range:
        """Indices of DP rank `dp`'s prompts that `instance` generates (contiguous)."""
        cover = self.covering(dp)
        return contiguous(num_prompts, len(cover), cover.index(instance))

    def leader(self, dp: int, instance: int) -> int:
        """The rank of `instance` that hands `dp`'s samples to `dp`'s ranks."""
        return min(r for r in self.instances[instance] if self.dp_of[r] == dp)

    def requests(self, instance: int, counts: dict[int, int]) -> list[tuple[int, int]]:
        """(dp, prompt index) of every request `instance` submits, in submission order;
        `counts[d]` is DP rank d's number of prompts."""
        return [(d, j) for d in self.covered(instance) for j in self.chunk(d, instance, counts[d])]


class RolloutDispatcher:
    """Generates this rank's DP share through the colocated engines, each prompt once.

    Collective over the world at construction (group creation), then per call over this
    rank's vLLM instance (when TP' > 1) and its DP rank's model-parallel group."""

    def __init__(self, vllm_tp: int, dp_rank: int):
        self.rank, world = dist.get_rank(), dist.get_world_size()
        dp_of: list = [None] * world
        dist.all_gather_object(dp_of, dp_rank)
        self.plan = DispatchPlan.create(dp_of, vllm_tp)
        self.dp = dp_rank
        self.instance_index = self.plan.instance_of(self.rank)
        # every rank creates every group, in the same order (new_group is collective)
        self._instance_group = None
        if len(self.plan.instances[0]) > 1:
            for i, ranks in enumerate(self.plan.instances):
                g = dist.new_group(list(ranks))
                if i == self.instance_index:
                    self._instance_group = g
        self._dp_ranks = [r for r in range(world) if dp_of[r] == dp_rank]
        self._dp_group = None
        for d in sorted(set(dp_of)):
            ranks = [r for r in range(world) if dp_of[r] == d]
            g = dist.new_group(ranks) if len(ranks) > 1 else None
            if d == dp_rank:
                self._dp_group = g
        self.samples_generated = 0
        """Samples this rank's instance generated in the last call, counted on its leader
        rank only (sum over ranks = samples generated in the world)."""

    @property
    def instance(self) -> tuple:
        """(process group, first rank, whether this rank is it) of this rank's vLLM instance;
        the group is None when the instance has one rank."""
        first = min(self.plan.instances[self.instance_index])
        return self._instance_group, first, self.rank == first

    def dispatch(self, items: list, positions: list[int], produce) -> Samples:
        """The samples of this DP rank's `items` (prompts: token ids, or whatever `produce`
        reads: picklable); every rank of its model-parallel group gets the same ones, in prompt
        order. `positions`: each item's place in the step's global batch. `produce(items,
        positions) -> Samples` makes the samples of an instance's share, with `prompt_index`
        indexing that share; every rank of the instance calls it with the same share."""
        plan, mine = self.plan, self.plan.chunk(self.dp, self.instance_index, len(items))
        share = {self.dp: ([items[j] for j in mine], [positions[j] for j in mine])}
        if self._instance_group is not None:  # learn the other DP ranks' chunks for us
            parts: list = [None] * len(plan.instances[self.instance_index])
            dist.all_gather_object(parts, (self.dp, share[self.dp]), group=self._instance_group)
            share = dict(parts)
        # (DP rank, index among its items) of each request; ours from the start of our chunk
        owners = [
            (d, j + (mine.start if d == self.dp else 0))
            for d in sorted(share)
            for j in range(len(share[d][0]))
        ]
        reqs = [share[d][0][j] for d in sorted(share) for j in range(len(share[d][0]))]
        pos = [share[d][1][j] for d in sorted(share) for j in range(len(share[d][1]))]
        out = produce(reqs, pos) if reqs else Samples.empty()
        self.samples_generated = len(out) if self.instance[2] else 0
        ours = route(out, owners).get(self.dp, Samples.empty())
        give = ours if self.rank == plan.leader(self.dp, self.instance_index) else None
        pieces: list = [give]
        if self._dp_group is not None:
            pieces = [None] * len(self._dp_ranks)
            dist.all_gather_object(pieces, give, group=self._dp_group)
        return in_prompt_order([p for p in pieces if p is not None], len(items))
