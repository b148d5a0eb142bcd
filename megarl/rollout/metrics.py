"""What a step's samples say, as metrics: how far the sampler's logprobs are from the trainer's
(`logprob_mismatch`), how far behind the policy they were generated (`staleness_metrics`) and
what their trajectories did (`trajectory_metrics`). Each returns `LocalMetrics`, reduced over
the DP group by the caller.
"""

from __future__ import annotations

import torch

from megarl.metrics.reduce import LocalMetrics
from megarl.rollout.multi_turn.trajectory import FINISH_REASONS
from megarl.rollout.samples import Samples


def logprob_mismatch(
    trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor
) -> LocalMetrics:
    """`logprob_mismatch` (mean) and `logprob_mismatch_max` of |trainer - sampler| over the
    tokens where `mask` is set: with the same weights the difference is numerical (kernels,
    reduction order, dtype), so a drifting figure means the sync or a kernel is wrong, or the
    importance ratios of off-policy corrections are biased.

    trainer_logprobs, sampler_logprobs, mask: [B, T] (mask 0/1 or bool)."""
    if trainer_logprobs.shape != sampler_logprobs.shape or trainer_logprobs.shape != mask.shape:
        raise ValueError(
            f"logprob_mismatch: shapes differ: trainer {tuple(trainer_logprobs.shape)}, sampler "
            f"{tuple(sampler_logprobs.shape)}, mask {tuple(mask.shape)}"
        )
    diff = (trainer_logprobs.double() - sampler_logprobs.double()).abs()[mask.bool()]
    local = LocalMetrics()
    local.add_ratio("logprob_mismatch", diff.sum(), diff.numel())
    local.add_max("logprob_mismatch_max", diff.max() if diff.numel() else 0.0)
    return local


def staleness_metrics(rollout: Samples, max_staleness: int) -> LocalMetrics:
    """`rollout/staleness_mean`, `rollout/staleness_max` and the histogram: the share of the
    step's samples at each staleness 0..`max_staleness` (`rollout/staleness_share_<s>`), a
    sample being as old as its oldest token. With per-token versions also
    `rollout/token_staleness_mean` (over the response tokens) and `rollout/inflight_share`
    (the share of samples whose tokens span a weight update). Empty when the run is on-policy
    (max_staleness 0)."""
    local = LocalMetrics()
    if max_staleness == 0:
        return local
    versions = rollout.versions
    ages = versions.staleness if versions is not None and versions.staleness is not None else None
    ages = ages if ages is not None else [0] * len(rollout)
    local.add_ratio("rollout/staleness_mean", float(sum(ages)), len(ages))
    local.add_max("rollout/staleness_max", float(max(ages, default=0)))
    for s in range(max_staleness + 1):
        local.add_ratio(f"rollout/staleness_share_{s}", float(ages.count(s)), len(ages))
    if versions is not None:
        token_ages, spanning, tokens = 0, 0, 0
        for age, toks in zip(ages, versions.tokens, strict=True):
            if toks:  # a token `v - oldest` versions newer than the sample's oldest
                token_ages += age * len(toks) - (sum(toks) - min(toks) * len(toks))
                spanning += max(toks) > min(toks)
                tokens += len(toks)
        local.add_ratio("rollout/token_staleness_mean", float(token_ages), tokens)
        local.add_ratio("rollout/inflight_share", float(spanning), len(ages))
    return local


def trajectory_metrics(rollout: Samples, prefix: str = "rollout") -> LocalMetrics:
    """Per-step figures of multi-turn samples (none for single-turn ones): turns, tool calls,
    tool errors and environment time per trajectory, environment errors and malformed tool
    calls (counts), the share of each finish reason, and `retokenize_diff` (the share of
    trajectories whose ids differ from one tokenization of their final conversation)."""
    m = LocalMetrics()
    if rollout.turns is None:
        return m
    recs = rollout.turns.records
    b = len(recs)
    m.add_ratio(f"{prefix}/turns", sum(r.turns for r in recs), b)
    m.add_ratio(f"{prefix}/tool_calls", sum(r.info.get("tool_calls", 0) for r in recs), b)
    m.add_ratio(f"{prefix}/tool_errors", sum(r.info.get("tool_errors", 0) for r in recs), b)
    m.add_ratio(f"{prefix}/env_time_s", sum(r.env_time_s for r in recs), b)
    m.add_sum(f"{prefix}/env_errors", sum(r.finish_reason == "env_error" for r in recs))
    m.add_sum(f"{prefix}/malformed_tool_calls", sum(r.malformed_calls for r in recs))
    for reason in FINISH_REASONS:
        m.add_ratio(f"{prefix}/finish_{reason}", sum(r.finish_reason == reason for r in recs), b)
    checked = [r.retokenize_diff for r in recs if r.retokenize_diff is not None]
    m.add_ratio(f"{prefix}/retokenize_diff", sum(checked), len(checked))
    return m


def sample_metrics(samples: Samples, max_staleness: int) -> LocalMetrics:
    """A training step's figures of its samples: their trajectories' and their staleness."""
    local = trajectory_metrics(samples)
    local.update(staleness_metrics(samples, max_staleness))
    return local
