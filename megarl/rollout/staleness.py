"""Metrics of how far behind the policy a step's samples were generated
(`algorithm.max_staleness`, `Rollout.staleness`, `Rollout.response_versions`)."""

from __future__ import annotations

from megarl.metrics.reduce import LocalMetrics


def staleness_metrics(rollout, max_staleness: int) -> LocalMetrics:
    """`rollout/staleness_mean`, `rollout/staleness_max` and the histogram: the share of the
    step's samples at each staleness 0..`max_staleness` (`rollout/staleness_share_<s>`), a
    sample being as old as its oldest token. With per-token versions also
    `rollout/token_staleness_mean` (over the response tokens) and `rollout/inflight_share`
    (the share of samples whose tokens span a weight update). Empty when the run is on-policy
    (max_staleness 0)."""
    local = LocalMetrics()
    if max_staleness == 0:
        return local
    ages = rollout.staleness if rollout.staleness is not None else [0] * len(rollout)
    local.add_ratio("rollout/staleness_mean", float(sum(ages)), len(ages))
    local.add_max("rollout/staleness_max", float(max(ages, default=0)))
    for s in range(max_staleness + 1):
        local.add_ratio(f"rollout/staleness_share_{s}", float(ages.count(s)), len(ages))
    if rollout.response_versions is not None:
        token_ages, spanning, tokens = 0, 0, 0
        for age, versions in zip(ages, rollout.response_versions, strict=True):
            if versions:  # a token `v - oldest` versions newer than the sample's oldest
                token_ages += age * len(versions) - (sum(versions) - min(versions) * len(versions))
                spanning += max(versions) > min(versions)
                tokens += len(versions)
        local.add_ratio("rollout/token_staleness_mean", float(token_ages), tokens)
        local.add_ratio("rollout/inflight_share", float(spanning), len(ages))
    return local


def token_versions(switches: list[tuple[int, int]], length: int) -> list[int]:
    """Each of `length` tokens' version from the (token index, version) switches, oldest first:
    token j has the version of the last switch at or before j."""
    out, it = [], 0
    for j in range(length):
        while it + 1 < len(switches) and switches[it + 1][0] <= j:
            it += 1
        out.append(switches[it][1])
    return out
