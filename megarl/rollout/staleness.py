"""Metrics of how far behind the policy a step's samples were generated
(`algorithm.max_staleness`, `Rollout.staleness`)."""

from __future__ import annotations

from megarl.metrics.reduce import LocalMetrics


def staleness_metrics(rollout, max_staleness: int) -> LocalMetrics:
    """`rollout/staleness_mean`, `rollout/staleness_max` and the histogram: the share of the
    step's samples at each staleness 0..`max_staleness` (`rollout/staleness_share_<s>`); empty
    when the run is on-policy (max_staleness 0)."""
    local = LocalMetrics()
    if max_staleness == 0:
        return local
    ages = rollout.staleness if rollout.staleness is not None else [0] * len(rollout)
    local.add_ratio("rollout/staleness_mean", float(sum(ages)), len(ages))
    local.add_max("rollout/staleness_max", float(max(ages, default=0)))
    for s in range(max_staleness + 1):
        local.add_ratio(f"rollout/staleness_share_{s}", float(ages.count(s)), len(ages))
    return local
