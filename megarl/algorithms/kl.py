"""Per-token KL estimators between the policy and the frozen reference (Schulman's k1/k2/k3).

Samples come from the policy q; `logprobs = log q(y_t)`, `ref_logprobs = log p(y_t)`. With
`d = ref_logprobs - logprobs = log(p/q)`:
- k1  = -d                      unbiased for KL(q||p), high variance, can be negative;
- abs = |d|                     (verl's "abs");
- k2  = d^2 / 2                 biased, low variance, its gradient is the KL's gradient;
- k3  = exp(d) - d - 1          unbiased, non-negative, low variance ("low_var_kl").
k3 clamps `d` to [-20, 20] before `exp` and the result to [-10, 10] (verl's `low_var_kl`
practice): one token with a collapsed reference probability must not produce inf/NaN and
dominate a batch. The clamps only bite at |d| > ~2.4 (k3 > 10), far outside normal training.

The penalty is used either as a per-token reward penalty (`apply_kl_penalty`, no gradient) or
as a loss term (`PolicyLossOptions.kl_coef` of `policy_loss`, differentiated through
`logprobs`); `KLOptions` says which, with the coefficient and the estimator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

KL_PLACEMENT = ("loss", "reward")


@dataclass(frozen=True, kw_only=True)
class KLOptions:
    """The KL-to-reference knobs (`AlgorithmConfig.kl_options`)."""

    coef: float = 0.0
    """Coefficient of the KL term; 0 disables it (and the reference model)."""
    kind: str = "k3"
    """Estimator: a key of `KL_ESTIMATORS` (k1, k2, k3, abs)."""
    placement: str = "loss"
    """`KL_PLACEMENT`: a loss term (`policy_loss`) or a per-token reward penalty
    (`apply_kl_penalty`, before GAE)."""

    @property
    def in_loss(self) -> bool:
        """Whether the KL is a term of the policy loss (coef > 0, placement loss)."""
        return self.coef > 0 and self.placement == "loss"

    @property
    def in_reward(self) -> bool:
        """Whether the KL is a per-token reward penalty (coef > 0, placement reward)."""
        return self.coef > 0 and self.placement == "reward"


_K3_LOG_RATIO_CLAMP = 20.0
_K3_VALUE_CLAMP = 10.0


def _k1(d: torch.Tensor) -> torch.Tensor:
    return -d


def _abs(d: torch.Tensor) -> torch.Tensor:
    return d.abs()


def _k2(d: torch.Tensor) -> torch.Tensor:
    return 0.5 * d.square()


def _k3(d: torch.Tensor) -> torch.Tensor:
    d = d.clamp(-_K3_LOG_RATIO_CLAMP, _K3_LOG_RATIO_CLAMP)
    return (torch.exp(d) - d - 1).clamp(-_K3_VALUE_CLAMP, _K3_VALUE_CLAMP)


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": _k1,
    "k2": _k2,
    "k3": _k3,
    "abs": _abs,
}


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate `[B, T]` from `logprobs, ref_logprobs: [B, T]` (see module)."""
    try:
        fn = KL_ESTIMATORS[kind]
    except KeyError:
        raise ValueError(f"kl kind must be one of {sorted(KL_ESTIMATORS)}; got {kind!r}") from None
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} "
            "must have the same shape"
        )
    return fn(ref_logprobs - logprobs)


def apply_kl_penalty(
    token_rewards: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    coef: float,
    kind: str = "k1",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reward shaping: `token_rewards - coef * KL_t` on valid tokens (PPO's in-reward KL).

    All inputs `[B, T]`. Returns `(shaped rewards [B, T], kl [B, T])`, no gradient (the penalty is
    part of the reward signal, not of the loss); both 0 outside `mask`.
    """
    valid = mask.bool()
    kl = torch.where(valid, kl_penalty(logprobs.detach(), ref_logprobs.detach(), kind), 0.0)
    return torch.where(valid, token_rewards - coef * kl, 0.0), kl
