"""Policy and value losses as pure tensor functions, with explicit global denominators.

Every loss here is computed on one micro-batch `[B, T]` of one DP rank and returns that
micro-batch's *share* of the global loss: summing the returned values over all micro-batches of
all DP ranks gives the loss of the whole global batch. That is what makes the gradients
invariant to how the global batch is split (tests/test_losses_invariance.py). The caller
therefore
- counts the denominators once per step over the global batch (`global_denominators`), and
- sums (not averages) the shares: backward each share as is, and all-reduce gradients with SUM
  over DP (Megatron's DDP averages over DP, so multiply the share by the DP size there).

Aggregation modes (`aggregate`), with `l[b, t]` the per-token loss and `M` the mask:
- `token-mean`:               sum_{b,t} M l / global_tokens
- `seq-mean-token-sum`:       sum_b (sum_t M l) / global_seqs
- `seq-mean-token-mean`:      sum_b (sum_t M l / sum_t M) / global_seqs
- `seq-mean-token-sum-norm`:  sum_b (sum_t M l / max_len) / global_seqs   (Dr.GRPO; max_len is
                              a constant such as the generation budget, not a data length)
`global_seqs` counts sequences with at least one valid token (empty rows contribute 0).

Metrics are plain local token means over the micro-batch (detached scalars); the trainer
averages them over micro-batches and ranks. They are diagnostics, not shares.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from megarl.algorithms.advantages import masked_mean
from megarl.algorithms.kl import kl_penalty
from megarl.algorithms.off_policy import OffPolicyOptions, importance_weights

AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)

# log-ratios are clamped before exp so that one stale token cannot produce inf (verl does the same)
_LOG_RATIO_CLAMP = 20.0

Number = float | int | torch.Tensor


def _check_denominator(name: str, value: Number | None, mode: str) -> None:
    if value is None:
        raise ValueError(
            f"agg_mode={mode!r} needs {name} (its global denominator); got None. Count it over "
            "the whole global batch, e.g. with megarl.algorithms.losses.global_denominators"
        )
    if not isinstance(value, torch.Tensor) and value <= 0:
        raise ValueError(f"agg_mode={mode!r}: {name} must be > 0; got {value!r}")


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    global_tokens: Number | None = None,
    global_seqs: Number | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """This micro-batch's share of the global aggregate of `values: [B, T]` (see module).

    mask: `[B, T]` (bool or 0/1). Returns a scalar. Raises ValueError for an unknown mode or a
    missing denominator (`global_tokens` for token-mean, `global_seqs` for the seq-mean modes,
    and `max_len` for seq-mean-token-sum-norm).
    """
    if mode not in AGG_MODES:
        raise ValueError(f"agg_mode must be one of {list(AGG_MODES)}; got {mode!r}")
    valid = mask.bool()
    # where, not values * mask: padding may hold inf/NaN and NaN * 0 = NaN
    masked = torch.where(valid, values, 0.0)
    if mode == "token-mean":
        _check_denominator("global_tokens", global_tokens, mode)
        return masked.sum() / global_tokens
    _check_denominator("global_seqs", global_seqs, mode)
    seq_sums = masked.sum(dim=-1)
    if mode == "seq-mean-token-sum":
        per_seq = seq_sums
    elif mode == "seq-mean-token-mean":
        per_seq = seq_sums / valid.sum(dim=-1).clamp(min=1).to(values.dtype)
    else:
        _check_denominator("max_len", max_len, mode)
        per_seq = seq_sums / max_len
    return per_seq.sum() / global_seqs


def global_denominators(
    masks: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None
) -> tuple[float, float]:
    """(valid tokens, sequences with >= 1 valid token) over this rank's micro-batch masks `[B, T]`,
    summed over the ranks of `group` (None: the default group when torch.distributed is
    initialised, otherwise no reduction — a single process)."""
    stats = None
    for mask in masks:
        valid = mask.detach().bool()
        counts = torch.stack([valid.sum(), valid.any(dim=-1).sum()]).to(torch.float64)
        stats = counts if stats is None else stats + counts
    if stats is None:
        stats = torch.zeros(2, dtype=torch.float64)
    # stats live on the masks' device, as NCCL requires
    if group is not None or (dist.is_available() and dist.is_initialized()):
        dist.all_reduce(stats, group=group)
    tokens, seqs = stats.tolist()
    return tokens, seqs


def _masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    valid = mask.bool()
    if not valid.any():
        return x.new_zeros(())
    return x[valid].max()


@dataclass(frozen=True, kw_only=True)
class PolicyLossOptions:
    """The knobs of `policy_loss` (`AlgorithmConfig.policy_loss_options`); the data tensors and
    the global denominators are `policy_loss`'s arguments."""

    ratio_level: str = "token"
    """'token' (PPO: one ratio per token) or 'sequence' (GSPO) for `policy_loss`; the
    registered losses 'ppo' and 'gspo' (`get_policy_loss`) set it themselves, 'cispo' is
    token-level and does not read it."""
    clip_low: float = 0.2
    """Clip range below 1: the ratio is clipped at `1 - clip_low` (ppo, gspo)."""
    clip_high: float = 0.2
    """Clip range above 1: `1 + clip_high`; > clip_low is DAPO's clip-higher (ppo, gspo)."""
    dual_clip: float | None = None
    """Dual-clip constant c (> 1): for A < 0 the loss is capped at `-A c`; None = off (ppo,
    gspo; `cispo_loss` refuses it)."""
    cispo_clip_low: float = 1.0
    """CISPO's importance weight is clipped below at `1 - cispo_clip_low` (0 <= it <= 1);
    1 = no lower bound, as in MiniMax-M1."""
    cispo_clip_high: float = 4.0
    """CISPO's importance weight is clipped above at `1 + cispo_clip_high` (> 0)."""
    agg_mode: str = "token-mean"
    """One of `AGG_MODES` (module docstring)."""
    off_policy: OffPolicyOptions = OffPolicyOptions()
    """The importance weights against the sampler's logprobs (`megarl.algorithms.off_policy`);
    the default, `none`, weighs nothing."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (needs the per-token entropy)."""
    kl_coef: float = 0.0
    """Coefficient of the KL-to-reference loss term (needs `ref_logprobs`); 0 = no term."""
    kl_kind: str = "k3"
    """KL estimator of that term (`megarl.algorithms.kl`)."""


@dataclass(frozen=True, kw_only=True)
class ValueLossOptions:
    """The knobs of `value_loss` (`AlgorithmConfig.value_loss_options`)."""

    clip: float | None = 0.2
    """Value clip range around the rollout's values; None drops the clipped term."""
    agg_mode: str = "token-mean"
    """One of `AGG_MODES` (module docstring)."""


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    opts: PolicyLossOptions,
    *,
    global_tokens: Number | None = None,
    global_seqs: Number | None = None,
    max_len: int | None = None,
    sampler_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (token ratio) or GSPO (sequence ratio), as a share (see module).

    logprobs: `[B, T]` current policy (differentiated); old_logprobs: `[B, T]` of the policy
    that the advantages refer to (recomputed by the trainer); advantages: `[B, T]` (GAE, or
    outcome advantages broadcast over tokens) or `[B]` (broadcast here); mask: `[B, T]`.
    The knobs come from `opts` (`PolicyLossOptions`):

    - ratio_level='token': `r_t = exp(lp_t - old_t)`. 'sequence' (GSPO): every token of row b
      carries `s_b = exp(mean_t(lp - old))` with the gradient of the token's own logprob
      (GSPO-token form `sg[s_b] * exp(lp_t - sg[lp_t])`); use `seq-mean-token-mean` for GSPO.
    - Clip: `max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))`; clip_high > clip_low is
      DAPO's clip-higher. dual_clip=c (> 1): for A < 0 the loss is capped at `-A c`.
    - Off-policy corrections (train/inference mismatch, stale samples): with
      `opts.off_policy` active, the per-token loss is multiplied by the detached weights of
      `megarl.algorithms.off_policy.importance_weights(old, sampler_logprobs)` (tis, icepop,
      mis, decoupled). `sampler_logprobs` alone only adds the `mismatch_kl` metric.
    - `entropy: [B, T]` with entropy_coef: `loss -= coef * agg(entropy)`.
    - `ref_logprobs: [B, T]` with kl_coef: `loss += coef * agg(kl_penalty(lp, ref, kl_kind))`.
      Use this *or* the in-reward penalty (`kl.apply_kl_penalty`), not both.
    Returns `(loss scalar, metrics)`; metrics are local token means (module docstring):
    pg_loss, clip_frac, approx_kl (0.5 * mean (lp - old)^2), ratio_mean, ratio_max, and as
    applicable dual_clip_frac, mismatch_kl, the is_* weight metrics, entropy, kl.
    """
    if opts.ratio_level not in ("token", "sequence"):
        raise ValueError(f"ratio_level must be 'token' or 'sequence'; got {opts.ratio_level!r}")
    if opts.dual_clip is not None and opts.dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (e.g. 3.0) or None; got {opts.dual_clip!r}")
    _check_terms(opts, sampler_logprobs, entropy, ref_logprobs)
    denominators = dict(global_tokens=global_tokens, global_seqs=global_seqs, max_len=max_len)
    old, adv = _detached(logprobs, old_logprobs, advantages)
    log_ratio = (logprobs - old).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    if opts.ratio_level == "sequence":
        seq_log_ratio = masked_mean(log_ratio.detach(), mask, dim=-1).unsqueeze(-1)
        log_ratio = (logprobs - logprobs.detach() + seq_log_ratio).clamp(max=_LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)

    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - opts.clip_low, 1.0 + opts.clip_high)
    pg = torch.maximum(unclipped, clipped)
    metrics = {"clip_frac": masked_mean((clipped > unclipped).to(pg.dtype), mask)}
    if opts.dual_clip is not None:
        cap = -adv * opts.dual_clip
        dual_active = (adv < 0) & (pg > cap)
        pg = torch.where(adv < 0, torch.minimum(pg, cap), pg)
        metrics["dual_clip_frac"] = masked_mean(dual_active.to(pg.dtype), mask)
    agg = partial(aggregate, mask=mask, mode=opts.agg_mode, **denominators)
    terms = (sampler_logprobs, entropy, ref_logprobs)
    return _with_terms(pg, metrics, logprobs, old, ratio, mask, opts, agg, *terms)


def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    opts: PolicyLossOptions,
    *,
    global_tokens: Number | None = None,
    global_seqs: Number | None = None,
    max_len: int | None = None,
    sampler_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): clip the importance weight, not the update, as a
    share (see module).

    Shapes and optional terms as in `policy_loss`. Per token, with `r_t = exp(lp_t - old_t)`:

        w_t = sg[clip(r_t, 1 - cispo_clip_low, 1 + cispo_clip_high)]
        l_t = -w_t * A_t * lp_t,     so  d l_t / d lp_t = -w_t * A_t

    Every token keeps a gradient; the clip only bounds its size, where PPO's clip zeroes the
    gradient of a clipped token. With no weight clipped the gradient is PPO's (`-A r d lp`);
    the value is not (it holds `lp`), so compare `pg_loss` across runs of one loss only.
    Off-policy weights, entropy and KL terms compose as in `policy_loss`; dual_clip and
    ratio_level do not apply (dual_clip raises). Metrics: those of `policy_loss` but
    dual_clip_frac, with clip_frac the share of tokens whose weight was clipped.
    """
    if opts.dual_clip is not None:
        raise ValueError(
            f"dual_clip={opts.dual_clip!r} is PPO's cap on the clipped surrogate; CISPO has no "
            "such term: set it to None"
        )
    if not 0.0 <= opts.cispo_clip_low <= 1.0 or opts.cispo_clip_high <= 0.0:
        raise ValueError(
            f"cispo_clip_low={opts.cispo_clip_low!r}, cispo_clip_high={opts.cispo_clip_high!r}; "
            "accepted: 0 <= cispo_clip_low <= 1 and cispo_clip_high > 0"
        )
    _check_terms(opts, sampler_logprobs, entropy, ref_logprobs)
    denominators = dict(global_tokens=global_tokens, global_seqs=global_seqs, max_len=max_len)
    old, adv = _detached(logprobs, old_logprobs, advantages)
    valid = mask.bool()
    ratio = torch.exp((logprobs.detach() - old).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    low, high = 1.0 - opts.cispo_clip_low, 1.0 + opts.cispo_clip_high
    # where, not * mask: a NaN weight or -inf logprob in the padding would give 0 * NaN in the
    # backward pass of the product
    weight = torch.where(valid, ratio.clamp(low, high), 0.0)
    pg = -weight * adv * torch.where(valid, logprobs, 0.0)
    clipped = (ratio < low) | (ratio > high)
    metrics = {"clip_frac": masked_mean(clipped.to(pg.dtype), mask)}
    agg = partial(aggregate, mask=mask, mode=opts.agg_mode, **denominators)
    terms = (sampler_logprobs, entropy, ref_logprobs)
    return _with_terms(pg, metrics, logprobs, old, ratio, mask, opts, agg, *terms)


def _check_terms(opts: PolicyLossOptions, sampler_logprobs, entropy, ref_logprobs) -> None:
    """The optional tensors that `opts` turns on must be given."""
    if opts.off_policy.active and sampler_logprobs is None:
        raise ValueError(
            f"off-policy correction {opts.off_policy.kind!r} needs sampler_logprobs (the "
            "behaviour policy's); got None"
        )
    if opts.entropy_coef and entropy is None:
        raise ValueError(f"entropy_coef={opts.entropy_coef} needs the per-token entropy tensor")
    if opts.kl_coef and ref_logprobs is None:
        raise ValueError(f"kl_coef={opts.kl_coef} needs ref_logprobs")


def _detached(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(old logprobs, advantages `[B, T]`), detached; outcome advantages `[B]` apply to every
    token of their sequence."""
    adv = advantages.detach()
    if adv.dim() == 1:
        adv = adv[:, None].expand_as(logprobs)
    return old_logprobs.detach(), adv


def _with_terms(
    pg: torch.Tensor,
    metrics: dict[str, torch.Tensor],
    logprobs: torch.Tensor,
    old: torch.Tensor,
    ratio: torch.Tensor,
    mask: torch.Tensor,
    opts: PolicyLossOptions,
    agg: Callable[[torch.Tensor], torch.Tensor],
    sampler_logprobs: torch.Tensor | None,
    entropy: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """What every policy loss adds to its per-token loss `pg: [B, T]`: the off-policy weights,
    the aggregation `agg`, the entropy and KL terms, and the metrics of `ratio: [B, T]`."""
    if sampler_logprobs is not None:
        d = (sampler_logprobs.detach() - old).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        metrics["mismatch_kl"] = masked_mean(torch.exp(d) - d - 1, mask)
        if opts.off_policy.active:
            weight, is_metrics = importance_weights(old, sampler_logprobs, mask, opts.off_policy)
            pg = pg * weight
            metrics.update(is_metrics)

    loss = agg(pg)
    metrics["pg_loss"] = masked_mean(pg.detach(), mask)
    if entropy is not None:
        metrics["entropy"] = masked_mean(entropy.detach(), mask)
        if opts.entropy_coef:
            loss = loss - opts.entropy_coef * agg(entropy)
    if ref_logprobs is not None:
        kl = kl_penalty(logprobs, ref_logprobs.detach(), opts.kl_kind)
        metrics["kl"] = masked_mean(kl.detach(), mask)
        if opts.kl_coef:
            loss = loss + opts.kl_coef * agg(kl)
    lr = (logprobs - old).detach()
    metrics["approx_kl"] = masked_mean(0.5 * lr.square(), mask)
    metrics["ratio_mean"] = masked_mean(ratio.detach(), mask)
    metrics["ratio_max"] = _masked_max(ratio.detach(), mask)
    return loss, metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    opts: ValueLossOptions,
    *,
    global_tokens: Number | None = None,
    global_seqs: Number | None = None,
    max_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped critic loss `0.5 * agg(max((V - R)^2, (V_clip - R)^2))`, as a share.

    values: `[B, T]` current critic (differentiated); old_values: `[B, T]` critic at rollout;
    returns: `[B, T]` targets (GAE returns). `V_clip = old + clip(V - old, -clip, clip)` with
    `opts.clip`; None drops the clipped term. Metrics (local means): vf_clip_frac, value_mean,
    value_error (mean squared error).
    """
    target = returns.detach()
    err = (values - target).square()
    metrics = {}
    if opts.clip is not None:
        old = old_values.detach()
        clipped_values = old + (values - old).clamp(-opts.clip, opts.clip)
        err_clipped = (clipped_values - target).square()
        metrics["vf_clip_frac"] = masked_mean((err_clipped > err).to(err.dtype), mask)
        per_token = torch.maximum(err, err_clipped)
    else:
        per_token = err
    loss = 0.5 * aggregate(
        per_token,
        mask,
        opts.agg_mode,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        max_len=max_len,
    )
    metrics["value_mean"] = masked_mean(values.detach(), mask)
    metrics["value_error"] = masked_mean(err.detach(), mask)
    return loss, metrics


PolicyLoss = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
_POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Register a policy loss with `policy_loss`'s signature (data tensors, `PolicyLossOptions`,
    keyword denominators and optional tensors) under `name` (duplicates raise)."""

    def wrap(fn: PolicyLoss) -> PolicyLoss:
        if name in _POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is registered twice")
        _POLICY_LOSSES[name] = fn
        return fn

    return wrap


def available_policy_losses() -> list[str]:
    """Names accepted by `get_policy_loss` (and by `algorithm.policy_loss`)."""
    return sorted(_POLICY_LOSSES)


def get_policy_loss(name: str) -> PolicyLoss:
    """The policy loss registered as `name`: 'ppo' (token ratio), 'gspo' (sequence ratio) or
    'cispo' (`cispo_loss`: the clipped importance weight, detached)."""
    try:
        return _POLICY_LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown policy loss {name!r}; known: {sorted(_POLICY_LOSSES)}") from None


def _at_ratio_level(level: str) -> PolicyLoss:
    """`policy_loss` with `opts.ratio_level` set to `level`."""

    def loss(logprobs, old_logprobs, advantages, mask, opts: PolicyLossOptions, **kwargs):
        opts = dataclasses.replace(opts, ratio_level=level)
        return policy_loss(logprobs, old_logprobs, advantages, mask, opts, **kwargs)

    return loss


register_policy_loss("ppo")(_at_ratio_level("token"))
register_policy_loss("gspo")(_at_ratio_level("sequence"))
register_policy_loss("cispo")(cispo_loss)
