"""Pairwise preference losses (DPO and its variants) as pure tensor functions, in a registry.

A pair is a prompt with a chosen response y_w and a rejected one y_l. Its inputs are sequence
log-probabilities `[P]`: the policy's `log pi(y|x)` (sum of the response tokens' logprobs, or
their mean with length normalisation) and, for the reference-based losses, the same under the
frozen reference. With `h = (log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l))`
(reference-free: `h = log pi(y_w) - log pi(y_l)`), `beta` and label smoothing `eps`:

- `sigmoid` (DPO; cDPO with eps > 0): `-(1 - eps) log s(beta h) - eps log s(-beta h)`
- `ipo`:    `(h - 1 / (2 beta))^2`
- `hinge`:  `max(0, 1 - beta h)`  (SLiC)
- `simpo`:  reference-free, length-normalised: `-(1 - eps) log s(beta h - gamma) - eps log
  s(-(beta h - gamma))`

As everywhere in megarl's losses, `preference_loss` returns one micro-batch's *share*: the sum
of its pairs' losses over the pairs of the whole step (`global_pairs`, all micro-batches and DP
ranks), so the shares add up to the step's mean and the gradient is split-invariant. Its metrics
are shares in the same sense (pair means), named as TRL logs them: `rewards/chosen` =
`beta (log pi(y_w) - log ref(y_w))` (reference-free: `beta log pi(y_w)`), `rewards/rejected`,
`rewards/margins`, `rewards/accuracies` (chosen reward > rejected), `logps/chosen`,
`logps/rejected`; and `preference_accuracy`, the fraction of pairs where the policy itself
gives y_w the higher (normalised as in the loss) log-probability.

A reward model r (`bradley_terry_loss`) is trained on the same pairs with the Bradley-Terry loss
`-log s(r(x, y_w) - r(x, y_l) - m)`, m a pair's margin (Llama 2's margin term; 0 without one),
with shares `rm/accuracy` (r(x, y_w) > r(x, y_l)), `rm/margin` (their difference),
`rm/chosen`, `rm/rejected`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

Number = float | int | torch.Tensor


@dataclass(frozen=True)
class PreferenceLoss:
    fn: Callable[..., torch.Tensor]
    """`fn(h [P], *, beta, label_smoothing, gamma) -> per-pair loss [P]`."""
    reference: bool
    """Whether `h` compares log-ratios to the reference (else the policy's logprobs alone)."""
    length_normalized: bool
    """Always uses mean token logprobs (whatever the caller's `length_norm`)."""
    label_smoothing: bool
    """Accepts label smoothing > 0."""


_LOSSES: dict[str, PreferenceLoss] = {}


def register_preference_loss(
    name: str, *, reference: bool = True, length_normalized: bool = False, smoothing: bool = False
) -> Callable:
    """Register `fn(h, *, beta, label_smoothing, gamma) -> [P]` under `name` (duplicates raise)."""

    def wrap(fn):
        if name in _LOSSES:
            raise ValueError(f"preference loss {name!r} is registered twice")
        _LOSSES[name] = PreferenceLoss(fn, reference, length_normalized, smoothing)
        return fn

    return wrap


def get_preference_loss(name: str) -> PreferenceLoss:
    try:
        return _LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown preference loss {name!r}; known: {sorted(_LOSSES)}") from None


def available_preference_losses() -> tuple[str, ...]:
    return tuple(sorted(_LOSSES))


def _smoothed_logsigmoid(z: torch.Tensor, eps: float) -> torch.Tensor:
    return -(1.0 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)


@register_preference_loss("sigmoid", smoothing=True)
def sigmoid_loss(h, *, beta, label_smoothing=0.0, gamma=0.0):
    return _smoothed_logsigmoid(beta * h, label_smoothing)


@register_preference_loss("ipo")
def ipo_loss(h, *, beta, label_smoothing=0.0, gamma=0.0):
    return (h - 1.0 / (2.0 * beta)).square()


@register_preference_loss("hinge")
def hinge_loss(h, *, beta, label_smoothing=0.0, gamma=0.0):
    return torch.relu(1.0 - beta * h)


@register_preference_loss("simpo", reference=False, length_normalized=True, smoothing=True)
def simpo_loss(h, *, beta, label_smoothing=0.0, gamma=0.0):
    return _smoothed_logsigmoid(beta * h - gamma, label_smoothing)


@dataclass(frozen=True, kw_only=True)
class PreferenceOptions:
    """The knobs of `preference_loss` (`AlgorithmConfig.preference_options`)."""

    kind: str = "sigmoid"
    """A registered preference loss (`available_preference_losses`)."""
    beta: float = 0.1
    """Strength of the implicit KL to the reference (SimPO: the reward scale)."""
    label_smoothing: float = 0.0
    """cDPO's assumed fraction of flipped labels (losses registered with smoothing only)."""
    gamma: float = 0.0
    """SimPO's target reward margin (ignored by the other losses)."""
    length_norm: bool = False
    """Compare mean token logprobs instead of sums (always on for a length-normalised loss)."""

    @property
    def mean(self) -> bool:
        """Whether the sequence logprobs are means (`sequence_logps(mean=...)`)."""
        return self.length_norm or get_preference_loss(self.kind).length_normalized

    @property
    def reference(self) -> bool:
        """Whether the loss compares log-ratios to the reference model."""
        return get_preference_loss(self.kind).reference


def sequence_logps(logprobs: torch.Tensor, mask: torch.Tensor, *, mean: bool) -> torch.Tensor:
    """Per-sequence sum (or mean) of the trained tokens' logprobs: [B, T], [B, T] -> [B]."""
    valid = mask.bool()
    total = torch.where(valid, logprobs, 0.0).sum(-1)
    if not mean:
        return total
    return total / valid.sum(-1).clamp(min=1).to(total.dtype)


def preference_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor | None,
    ref_rejected: torch.Tensor | None,
    opts: PreferenceOptions,
    *,
    global_pairs: Number,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This micro-batch's share of the step's mean preference loss `opts.kind` (module
    docstring), with `opts.beta`, `opts.label_smoothing` and `opts.gamma`.

    chosen, rejected: `[P]` sequence log-probabilities of the policy (differentiated), already
    length-normalised where asked (`sequence_logps(mean=opts.mean)`); ref_chosen, ref_rejected:
    `[P]` the same under the reference (None for a reference-free loss). Returns
    `(loss, metrics)`, both shares over `global_pairs` (> 0)."""
    kind, beta, label_smoothing = opts.kind, opts.beta, opts.label_smoothing
    spec = get_preference_loss(kind)
    if not isinstance(global_pairs, torch.Tensor) and global_pairs <= 0:
        raise ValueError(f"preference_loss: global_pairs must be > 0; got {global_pairs!r}")
    if spec.reference and (ref_chosen is None or ref_rejected is None):
        raise ValueError(f"preference loss {kind!r} needs the reference's logprobs")
    if label_smoothing and not spec.label_smoothing:
        raise ValueError(f"preference loss {kind!r} takes no label smoothing")
    if spec.reference:
        chosen_ratio = chosen - ref_chosen.detach()
        rejected_ratio = rejected - ref_rejected.detach()
    else:
        chosen_ratio, rejected_ratio = chosen, rejected
    h = chosen_ratio - rejected_ratio
    losses = spec.fn(h, beta=beta, label_smoothing=label_smoothing, gamma=opts.gamma)
    loss = losses.sum() / global_pairs

    def share(x: torch.Tensor) -> torch.Tensor:
        return x.detach().to(losses.dtype).sum() / global_pairs

    r_chosen, r_rejected = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    metrics = {
        "rewards/chosen": share(r_chosen),
        "rewards/rejected": share(r_rejected),
        "rewards/margins": share(r_chosen - r_rejected),
        "rewards/accuracies": share(r_chosen > r_rejected),
        "logps/chosen": share(chosen),
        "logps/rejected": share(rejected),
        "preference_accuracy": share(chosen.detach() > rejected.detach()),
    }
    return loss, metrics


def bradley_terry_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    *,
    global_pairs: Number,
    margin: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This micro-batch's share of the step's mean Bradley-Terry loss of a reward model.

    chosen, rejected: `[P]` scores r(x, y_w), r(x, y_l) (differentiated); margin: `[P]` or None.
    Per pair `-log sigmoid(chosen - rejected - margin)`. Returns `(loss, metrics)`, both shares
    over `global_pairs` (> 0): `rm/accuracy`, `rm/margin`, `rm/chosen`, `rm/rejected`."""
    if not isinstance(global_pairs, torch.Tensor) and global_pairs <= 0:
        raise ValueError(f"bradley_terry_loss: global_pairs must be > 0; got {global_pairs!r}")
    diff = chosen - rejected
    target = diff if margin is None else diff - margin.to(diff.dtype)
    loss = -F.logsigmoid(target).sum() / global_pairs

    def share(x: torch.Tensor) -> torch.Tensor:
        return x.detach().to(diff.dtype).sum() / global_pairs

    metrics = {
        "rm/accuracy": share(diff > 0),
        "rm/margin": share(diff),
        "rm/chosen": share(chosen),
        "rm/rejected": share(rejected),
    }
    return loss, metrics
