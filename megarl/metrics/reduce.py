"""Metrics that mean what a single process would log for the whole batch.

Each rank records what it can see of a metric in one of four forms, and `reduce` combines them
over a process group (the DP group) with one all-reduce per form:
- sum:   additive quantities (token counts, loss *shares*: a micro-batch's numerator over the
         global denominator, so the sum over ranks is the global value);
- ratio: (numerator, denominator) pairs, both summed over ranks, then divided (means over the
         samples or tokens of all ranks, whatever their split);
- max:   maxima (all-reduce MAX);
- same:  values every rank already holds identically (learning rate, a global grad norm).
Every rank of the group must record the same keys (the reduction is positional over sorted keys).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class LocalMetrics:
    sums: dict[str, float] = field(default_factory=dict)
    ratios: dict[str, tuple[float, float]] = field(default_factory=dict)
    maxima: dict[str, float] = field(default_factory=dict)
    same: dict[str, float] = field(default_factory=dict)

    def add_sum(self, key: str, value: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + float(value)

    def add_ratio(self, key: str, num: float, den: float) -> None:
        n, d = self.ratios.get(key, (0.0, 0.0))
        self.ratios[key] = (n + float(num), d + float(den))

    def add_max(self, key: str, value: float) -> None:
        self.maxima[key] = max(self.maxima.get(key, float("-inf")), float(value))

    def add_same(self, key: str, value: float) -> None:
        self.same[key] = float(value)

    def update(self, other: LocalMetrics) -> None:
        for k, v in other.sums.items():
            self.add_sum(k, v)
        for k, (n, d) in other.ratios.items():
            self.add_ratio(k, n, d)
        for k, v in other.maxima.items():
            self.add_max(k, v)
        self.same.update(other.same)

    def reduce(self, group=None) -> dict[str, float]:
        """The global values (collective over `group`; None = no reduction, one process)."""
        sum_keys, ratio_keys, max_keys = sorted(self.sums), sorted(self.ratios), sorted(self.maxima)
        vec = torch.tensor(
            [self.sums[k] for k in sum_keys] + [x for k in ratio_keys for x in self.ratios[k]],
            dtype=torch.float64,
        )
        peak = torch.tensor([self.maxima[k] for k in max_keys], dtype=torch.float64)
        if group is not None:
            if len(vec):
                dist.all_reduce(vec, group=group)
            if len(peak):
                dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        out = dict(zip(sum_keys, vec[: len(sum_keys)].tolist(), strict=True))
        pairs = vec[len(sum_keys) :].view(-1, 2).tolist() if ratio_keys else []
        for k, (n, d) in zip(ratio_keys, pairs, strict=True):
            out[k] = n / d if d else 0.0
        out.update(zip(max_keys, peak.tolist(), strict=True))
        out.update(self.same)
        return out


def from_last_stage(values: dict, pp_group, pp_size: int) -> dict:
    """`values` of the last pipeline stage (the only one that computes losses) on every rank of
    `pp_group` (collective over it; `pp_size` its size)."""
    held = [values]
    dist.broadcast_object_list(
        held, src=dist.get_global_rank(pp_group, pp_size - 1), group=pp_group
    )
    return held[0]
