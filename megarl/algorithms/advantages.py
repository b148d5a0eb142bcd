"""Advantage estimators: outcome-reward baselines (GRPO, Dr.GRPO, RLOO, REINFORCE++) and GAE.

Outcome estimators turn one scalar reward per sample into one advantage per sample. The batch is
laid out group-contiguously: samples `[g*G, (g+1)*G)` are the `G = num_generations` completions
of prompt `g`. The call form and semantics follow the Advantage API of the Twinkle library and
TRL's GRPO trainer:

    adv = GRPOAdvantage()(rewards, num_generations=G, scale="group" | "batch" | "none", eps=1e-8)

Conventions shared by every estimator (the tests pin them against plain-loop references):
- `rewards` is a list or a tensor `[B]`; a `[B, K]` tensor (K reward components) is summed over
  K. Integer/bool rewards become float32; floating tensors keep their dtype.
- Every standard deviation is the unbiased one (Bessel's correction, like `torch.std`, TRL and
  Twinkle). A std over fewer than two values is defined as 0 instead of NaN, so a batch of one
  sample gives `(r - r) / (0 + eps) = 0` rather than NaN.
- `eps` is added to the std, never to the variance: `(x - mean) / (std + eps)`. Means are
  taken relative to the first member, so a constant group gets advantage exactly 0 in any dtype.

The estimators are stateless; the distributed stage (`distributed_advantage.py`) gathers the
global batch and calls the same objects, which is what makes it bitwise equal to this module.
GAE (`compute_gae`) works on per-token rewards and critic values of right-padded sequences;
its knobs travel as `GAEOptions`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

SCALES = ("group", "batch", "none")

_ADVANTAGES: dict[str, Advantage] = {}


def register_advantage(name: str) -> Callable[[type[Advantage]], type[Advantage]]:
    """Class decorator: register an `Advantage` subclass under `name` (duplicates raise)."""

    def wrap(cls: type[Advantage]) -> type[Advantage]:
        if name in _ADVANTAGES:
            raise ValueError(
                f"advantage estimator {name!r} is registered twice "
                f"({type(_ADVANTAGES[name]).__name__} and {cls.__name__})"
            )
        cls.name = name
        _ADVANTAGES[name] = cls()
        return cls

    return wrap


def get_advantage(name: str) -> Advantage:
    """The (stateless, callable) estimator instance registered as `name`."""
    try:
        return _ADVANTAGES[name]
    except KeyError:
        raise ValueError(
            f"unknown advantage estimator {name!r}; known: {sorted(_ADVANTAGES)}"
        ) from None


def available_advantages() -> list[str]:
    return sorted(_ADVANTAGES)


def as_reward_tensor(rewards: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """`rewards` (list, `[B]` or `[B, K]` tensor) -> floating tensor `[B]`."""
    r = rewards if isinstance(rewards, torch.Tensor) else torch.as_tensor(rewards)
    if not r.is_floating_point():
        r = r.to(torch.float32)
    if r.dim() == 2:
        r = r.sum(dim=-1)
    if r.dim() != 1:
        raise ValueError(f"rewards must have shape [B] or [B, K]; got shape {tuple(r.shape)}")
    return r


# Chunk length of `_sum`: rows this short are reduced by one thread, whatever the thread count.
_SUM_CHUNK = 1024


def _sum(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum over the last dim (`dim=-1`, keepdim) or over everything (`dim=None`, a scalar).

    torch's CPU reduction of one long vector splits it across intra-op threads, so its
    rounding depends on the thread count; DP ranks (and the tests' reference process) may run
    with different counts. Summing fixed 1024-element chunks, then the chunk sums, gives the
    same bits everywhere (row-wise reductions are split across rows, never inside a row).
    """
    v = x.reshape(-1) if dim is None else x
    while v.shape[-1] > _SUM_CHUNK:
        pad = -v.shape[-1] % _SUM_CHUNK
        if pad:
            v = torch.nn.functional.pad(v, (0, pad))  # + 0.0 leaves a sum unchanged
        v = v.reshape(*v.shape[:-1], -1, _SUM_CHUNK).sum(dim=-1)
    return v.sum() if dim is None else v.sum(dim=-1, keepdim=True)


def _centred(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """`x - mean(x)` over the last dim (`dim=-1`) or over all elements (`dim=None`).

    Computed on `x - x_first` so that a constant set gives exactly 0: a float mean of identical
    values is not always bit-identical to them (e.g. 8 x 0.7 in float32 is off by one ulp),
    and that ulp divided by `std + eps = 1e-8` would turn a constant group into advantages ~10.
    """
    shift = x.reshape(-1)[0] if dim is None else x[..., :1]
    d = x - shift
    n = d.numel() if dim is None else d.shape[-1]
    return d - _sum(d, dim) / n


def _std(centred: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Unbiased std from already centred values (two-pass; torch.std's per-row Welford is ~20x
    slower for short rows); 0 where there are fewer than two values."""
    n = centred.numel() if dim is None else centred.shape[-1]
    sq = _sum(centred * centred, dim)
    return (sq / (n - 1)).sqrt() if n > 1 else torch.zeros_like(sq)


class Advantage:
    """Base class: validates the call, reshapes to `[B/G, G]`, dispatches to `_compute`.

    Subclasses implement `_compute(r: [N, G], scale, eps) -> [N, G]`.
    """

    name = "base"
    #: Smallest `num_generations` the estimator is defined for.
    min_generations = 1

    def __call__(
        self,
        rewards: Sequence[float] | torch.Tensor,
        num_generations: int = 1,
        scale: str = "group",
        *,
        eps: float = 1e-8,
    ) -> torch.Tensor:
        """rewards `[B]` or `[B, K]` -> advantages `[B]` (group-contiguous layout, see module)."""
        r = as_reward_tensor(rewards)
        if scale not in SCALES:
            raise ValueError(f"scale must be one of {list(SCALES)}; got {scale!r}")
        if not isinstance(num_generations, int) or num_generations < self.min_generations:
            raise ValueError(
                f"{self.name}: num_generations must be an int >= {self.min_generations}; "
                f"got {num_generations!r}"
            )
        if r.shape[0] % num_generations != 0:
            raise ValueError(
                f"{self.name}: the batch size B={r.shape[0]} is not a multiple of "
                f"num_generations G={num_generations} (B % G = {r.shape[0] % num_generations})"
            )
        if r.numel() == 0:
            return r.clone()
        grouped = r.reshape(-1, num_generations)
        return self._compute(grouped, scale, eps).reshape(-1)

    def _compute(self, r: torch.Tensor, scale: str, eps: float) -> torch.Tensor:
        raise NotImplementedError


@register_advantage("grpo")
class GRPOAdvantage(Advantage):
    """GRPO: `A_i = (r_i - mean_group) / (std + eps)`.

    scale='group': std of the prompt's group; 'batch': std of all rewards in the batch (TRL's
    `scale_rewards="batch"`); 'none': only centre (Dr.GRPO).
    With G == 1 there is no group to compare against: 'batch' whitens over the batch
    (`(r - mean_batch) / (std_batch + eps)`), 'none' subtracts the batch mean, and 'group'
    returns the rewards unchanged (Twinkle's behaviour; a group of one has no baseline).
    """

    def _compute(self, r: torch.Tensor, scale: str, eps: float) -> torch.Tensor:
        if r.shape[1] == 1:
            if scale == "group":
                return r.clone()
            centred = _centred(r)
            return centred / (_std(centred) + eps) if scale == "batch" else centred
        centred = _centred(r, dim=-1)
        if scale == "group":
            return centred / (_std(centred, dim=-1) + eps)
        if scale == "batch":
            return centred / (_std(_centred(r)) + eps)
        return centred


@register_advantage("dr_grpo")
class DrGRPOAdvantage(GRPOAdvantage):
    """Dr.GRPO (Liu et al., 2025): GRPO without the std division.

    `scale` is validated but always treated as 'none' (that is the algorithm); the matching loss
    aggregation is `seq-mean-token-sum-norm`.
    """

    def _compute(self, r: torch.Tensor, scale: str, eps: float) -> torch.Tensor:
        return super()._compute(r, "none", eps)


@register_advantage("rloo")
class RLOOAdvantage(Advantage):
    """RLOO: `A_i = r_i - (sum_group - r_i) / (G - 1)` (leave-one-out baseline), G >= 2.

    scale='group' / 'batch' divide by the std of the *raw rewards* of the group / batch + eps.
    """

    min_generations = 2

    def _compute(self, r: torch.Tensor, scale: str, eps: float) -> torch.Tensor:
        g = r.shape[1]
        # r_i - (sum - r_i) / (G - 1) == G / (G - 1) * (r_i - mean): one centring serves the
        # baseline and the group std, and a constant group gives exactly 0 (see _centred)
        centred = _centred(r, dim=-1)
        adv = centred * (g / (g - 1))
        if scale == "group":
            return adv / (_std(centred, dim=-1) + eps)
        if scale == "batch":
            return adv / (_std(_centred(r)) + eps)
        return adv


@register_advantage("reinforce++")
class ReinforcePlusPlusAdvantage(Advantage):
    """REINFORCE++ with group baseline (verl's `reinforce_plus_plus_baseline`, per sample).

    `a_i = r_i - mean_group` (with G == 1 no group baseline: `a_i = r_i`, plain REINFORCE++), then
    whitening over the whole (global) batch: `(a - mean(a)) / (std(a) + eps)`. The batch
    normalisation *is* the algorithm, so 'group' and 'batch' both mean this; 'none' keeps the
    batch-mean subtraction and skips the division.
    """

    def _compute(self, r: torch.Tensor, scale: str, eps: float) -> torch.Tensor:
        a = _centred(r, dim=-1) if r.shape[1] > 1 else r
        centred = _centred(a)
        return centred if scale == "none" else centred / (_std(centred) + eps)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` where `mask` (same shape) is set; 0 where nothing is set."""
    valid = mask.bool()
    # where, not x * mask: padding may hold inf/NaN (e.g. -inf logprobs) and NaN * 0 = NaN
    masked = torch.where(valid, x, 0.0)
    count = valid.to(x.dtype)
    total = masked.sum() if dim is None else masked.sum(dim)
    count = count.sum() if dim is None else count.sum(dim)
    return total / count.clamp(min=1)


def whiten(
    x: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Whiten `x: [B, T]` over the tokens where `mask: [B, T]` is set; 0 outside the mask.

    `(x - mean) * rsqrt(var + eps)` with the unbiased masked variance (verl's `masked_whiten`;
    here eps goes under the root because token counts are large and var is rarely ~0).
    `shift_mean=False` adds the mean back (scale only), as PPO implementations offer.
    """
    valid = mask.bool()
    n = valid.sum().to(x.dtype)
    mean = torch.where(valid, x, 0.0).sum() / n.clamp(min=1)
    var = torch.where(valid, x - mean, 0.0).square().sum() / (n - 1).clamp(min=1)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(valid, out, 0.0)


@dataclass(frozen=True, kw_only=True)
class GAEOptions:
    """The knobs of GAE (`AlgorithmConfig.gae_options`)."""

    gamma: float = 1.0
    """Discount per token."""
    lam: float = 0.95
    """GAE's lambda: 0 = one-step TD, 1 = Monte Carlo returns."""


def compute_gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over right-padded sequences.

    token_rewards, values, mask: `[B, T]`. The recursion runs over each row's valid (mask 1)
    tokens only, skipping the others: t + 1 below is the next valid token, so the tokens an
    environment appended between two turns of a multi-turn trajectory are not steps of the
    episode (for a contiguous mask this is plain GAE). The value after the last valid token is 0
    (the episode ends with the completion):
        delta_t = r_t + gamma * V_{t+1} - V_t,    A_t = delta_t + gamma * lam * A_{t+1}.
    Returns `(advantages [B, T], returns [B, T])` with `returns = advantages + values`, both 0
    outside the mask. Not whitened: call `whiten` (or the distributed whitening) afterwards.
    """
    if not (token_rewards.shape == values.shape == mask.shape) or token_rewards.dim() != 2:
        raise ValueError(
            "compute_gae expects token_rewards, values and mask of the same shape [B, T]; got "
            f"{tuple(token_rewards.shape)}, {tuple(values.shape)}, {tuple(mask.shape)}"
        )
    valid = mask.bool()
    m = valid.to(values.dtype)
    # Zeroing values/rewards outside the mask makes V_{len} = 0 and keeps padding inert.
    v = torch.where(valid, values.detach(), 0.0)
    r = torch.where(valid, token_rewards.detach(), 0.0)
    adv = torch.zeros_like(r)
    last = torch.zeros_like(r[:, 0])  # A at the next valid token
    next_v = torch.zeros_like(last)  # V at the next valid token
    for t in reversed(range(r.shape[1])):
        delta = r[:, t] + gamma * next_v - v[:, t]
        a_t = (delta + gamma * lam * last) * m[:, t]
        adv[:, t] = a_t
        last = torch.where(valid[:, t], a_t, last)
        next_v = torch.where(valid[:, t], v[:, t], next_v)
    returns = (adv + v) * m
    return adv, returns
