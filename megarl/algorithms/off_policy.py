"""Off-policy corrections: importance weights of the trained samples against the policy that
sampled them, as pure tensor functions.

Three policies meet in one update (the notation of decoupled PPO):
- the behaviour policy `mu`: the one that sampled the tokens, with the logprobs vLLM returned
  (`behaviour_logprobs`). It differs from the trainer's policy by kernels and precision even on
  the same weights, and by whole policy versions when generation runs ahead of training;
- the proximal policy `prox`: the trainer's recomputed logprobs of the same tokens on the
  weights the update starts from (`old_logprobs`). PPO's ratio and clip are taken against it;
- the current policy `pi`, which the loss differentiates.

Every correction is a detached weight `w[b, t]` that multiplies the per-token PPO loss, built
from the token ratio `k_t = exp(prox_t - mu_t)` (log-ratios clamped to [-20, 20]):

- `none`:      w = 1
- `tis`:       w = min(k_t, high)                          truncated IS (Yao et al. 2025)
- `icepop`:    w = k_t if low <= k_t <= high, else 0       two-sided token mask (IcePop,
               Ring-1T); its paper uses [0.5, 5]
- `mis`:       w = rho_b if rho_b <= high, else 0, with the sequence ratio
               rho_b = exp(sum_t M (prox_t - mu_t))        sequence-level masked IS (Liu et
               al. 2025, "When Speed Kills Stability"); every token of row b carries rho_b
- `decoupled`: w = k_t if k_t <= high, else 0              decoupled PPO (Hilton et al. 2021;
               AReaL): the behaviour weight, tokens above the cap dropped

Metrics (local token means over the mask, detached): `is_weight_mean`, `is_weight_max` (of
the weights applied), `is_ratio_mean` (of the raw k_t, or rho_b for mis) and
`is_clipped_frac`, the share of tokens whose weight differs from its raw ratio (truncated or
masked).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.algorithms.advantages import masked_mean

OFF_POLICY_CORRECTIONS = ("none", "tis", "icepop", "mis", "decoupled")

# as in losses.py: one stale token cannot produce inf
_LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True, kw_only=True)
class OffPolicyOptions:
    """`algorithm.off_policy_correction`, `algorithm.is_low` and `algorithm.is_high`."""

    kind: str = "none"
    """One of `OFF_POLICY_CORRECTIONS` (module docstring)."""
    low: float = 0.5
    """Lower bound of icepop's band (the others have none)."""
    high: float = 2.0
    """The cap: tis truncates at it; icepop, mis and decoupled drop what exceeds it."""

    def __post_init__(self):
        if self.kind not in OFF_POLICY_CORRECTIONS:
            raise ValueError(
                f"off-policy correction {self.kind!r}; accepted: {OFF_POLICY_CORRECTIONS}"
            )
        if not 0.0 <= self.low < 1.0 < self.high:
            raise ValueError(
                f"importance-weight bounds low={self.low}, high={self.high}; accepted: "
                "0 <= low < 1 < high"
            )

    @property
    def active(self) -> bool:
        """Whether the loss is weighted (any kind but none)."""
        return self.kind != "none"


def importance_weights(
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    opts: OffPolicyOptions,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The detached weights `[B, T]` of `opts.kind` and their metrics (module docstring).

    old_logprobs: `[B, T]` the proximal policy's (the trainer's recomputed logprobs);
    behaviour_logprobs: `[B, T]` the sampler's; mask: `[B, T]` (bool or 0/1). Weights are 0
    where the mask is 0. `none` returns ones (and the metrics of the raw ratios).
    """
    if old_logprobs.shape != behaviour_logprobs.shape or old_logprobs.shape != mask.shape:
        raise ValueError(
            f"shapes differ: old {tuple(old_logprobs.shape)}, behaviour "
            f"{tuple(behaviour_logprobs.shape)}, mask {tuple(mask.shape)}"
        )
    valid = mask.bool()
    log_k = torch.where(valid, old_logprobs.detach() - behaviour_logprobs.detach(), 0.0)
    if opts.kind == "mis":
        log_rho = log_k.sum(dim=-1, keepdim=True).expand_as(log_k)
        raw = torch.exp(log_rho.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    else:
        raw = torch.exp(log_k.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    zero = torch.zeros_like(raw)
    if opts.kind == "none":
        weight = torch.ones_like(raw)
    elif opts.kind == "tis":
        weight = raw.clamp(max=opts.high)
    elif opts.kind == "icepop":
        weight = torch.where((raw >= opts.low) & (raw <= opts.high), raw, zero)
    else:  # mis, decoupled: drop above the cap
        weight = torch.where(raw <= opts.high, raw, zero)
    weight = torch.where(valid, weight, zero)
    changed = (weight != raw) if opts.active else torch.zeros_like(valid)
    metrics = {
        "is_weight_mean": masked_mean(weight, mask),
        "is_weight_max": weight[valid].max() if valid.any() else weight.new_zeros(()),
        "is_ratio_mean": masked_mean(raw, mask),
        "is_clipped_frac": masked_mean(changed.to(raw.dtype), mask),
    }
    return weight, metrics
