"""Start-up invariants of the run's models, checked once after every role is built, loaded and
resumed and before the first step (`check_models`; `megarl.trainer.recipe.build_run` calls it
in every run):

- each trained role's optimizer (actor, critic, a trained reward model) holds fp32 masters equal
  to the model's weights: a 16-bit parameter is its master rounded, an FP8 one its master
  quantized (within FP8's rounding). A master taken from anything else (the random init that
  Transformer-Engine preserves on FP8 parameters, a load that bypassed the optimizer) would be
  written into the weights by the first optimizer step;
- no parameter keeps Transformer-Engine's host copy of its initial value once the masters are set,
  and a frozen parameter (the reference, a frozen reward model, a distillation teacher, a LoRA
  model's base) holds nothing only training uses: no gradient, no DDP grad buffer
  (`main_grad`), no master (`main_param`).

Each failure is a one-line `InvariantError` naming the role and the tensor. The comparison is
elementwise on each rank's own shards (one pass over the masters, on their device). Every rank
of the default group raises when any rank fails (`megarl.distributed.consensus`): the next step
is collective.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megarl.distributed.consensus import failed_ranks
from megarl.models.builder import unwrap
from megarl.models.optim import master_pairs

if TYPE_CHECKING:
    from megarl.trainer.models import Models

FP8_TOLERANCE = 0.25
"""Largest relative L2 distance, per tensor, between an FP8 weight (dequantized) and its fp32
master. E4M3 keeps 3 mantissa bits, so rounding moves a normal element by at most 1/16 of its
magnitude (the tensor's relative distance is then below 0.07); the margin is for subnormals. A
master taken from another tensor of the same scale (a random init) is about 1 away."""

TRAINING_ONLY = ("main_grad", "main_param")
"""Attributes megatron's DDP and DistributedOptimizer put on the parameters they train."""


class InvariantError(RuntimeError):
    """A start-up invariant of the models does not hold: a defect in megarl or in how a library
    was used, found before it could spoil a step."""


def check_models(models: Models, group=None) -> None:
    """Raise `InvariantError` (the first problem this rank found, or which ranks failed) unless
    every invariant of the module docstring holds on every rank of `group` (default: the
    default group). Collective."""
    problems = model_problems(models)
    bad = failed_ranks(bool(problems), group)
    if problems:
        more = f" (and {len(problems) - 1} more on this rank)" if len(problems) > 1 else ""
        raise InvariantError(f"start-up check: {problems[0]}{more}")
    if bad:
        raise InvariantError(
            f"start-up check failed on rank(s) {bad} (their error names the role and the "
            "tensor); this rank stops with them"
        )


def model_problems(models: Models) -> list[str]:
    """One line per broken invariant on this rank, naming the role and the tensor."""
    out = []
    for role, trained in models.trained().items():
        out += master_problems(role, trained.chunks, trained.opt)
    frozen = {"reference": models.reference, "teacher": models.teacher}
    if isinstance(models.reward, list):
        frozen["reward"] = models.reward
    for role, model in {**{r: m.chunks for r, m in models.trained().items()}, **frozen}.items():
        if model is not None:
            out += copy_problems(role, model)
    return out


def master_problems(role: str, chunks: list, optimizer) -> list[str]:
    """The parameters of `role` whose optimizer master is not the parameter's value."""
    names = _names(chunks)
    out = []
    with torch.no_grad():
        for p, master, start, end in master_pairs(optimizer):
            why = _master_mismatch(p, master, start, end)
            if why is not None:
                out.append(
                    f"the {role}'s fp32 master of {names.get(id(p), '?')} (elements "
                    f"{start}:{end} on this rank) is not the loaded weight: {why}"
                )
    return out


def copy_problems(role: str, chunks: list) -> list[str]:
    """The parameters of `role` that keep Transformer-Engine's preserved init value, and its
    frozen parameters that hold a gradient, a grad buffer or a master."""
    out = []
    for i, chunk in enumerate(chunks):
        for name, p in _named(chunk, i, len(chunks)):
            if getattr(p, "_high_precision_init_val", None) is not None:
                out.append(
                    f"the {role}'s {name} keeps Transformer-Engine's host copy of its initial "
                    "value (`preserve_high_precision_init_val`), which nothing reads once the "
                    "masters are set"
                )
            if p.requires_grad:
                continue
            held = [a for a in TRAINING_ONLY if getattr(p, a, None) is not None]
            held += ["a gradient"] if p.grad is not None else []
            if held:
                out.append(f"the {role}'s frozen {name} holds {', '.join(held)}")
    return out


def _master_mismatch(p, master: torch.Tensor, start: int, end: int) -> str | None:
    from megatron.core.fp8_utils import dequantize_fp8_tensor, is_float8tensor

    if is_float8tensor(p):  # the master quantized is the weight, within FP8's rounding
        have = dequantize_fp8_tensor(p).reshape(-1)[start:end].float()
        want = master.reshape(-1).float()
        scale = float(want.norm()) or 1.0
        dist = float((have - want).norm()) / scale
        if dist <= FP8_TOLERANCE:
            return None
        return f"relative distance {dist:.3g} (FP8 rounding allows {FP8_TOLERANCE})"
    have = p.detach().reshape(-1)[start:end]
    rounded = master.reshape(-1).to(have.dtype)
    if torch.equal(rounded, have):
        return None
    differ = int((rounded != have).sum())
    gap = float((rounded.float() - have.float()).abs().max())
    return f"{differ} of {have.numel()} elements differ (max |difference| {gap:.3g})"


def _names(chunks: list) -> dict[int, str]:
    return {id(p): n for i, c in enumerate(chunks) for n, p in _named(c, i, len(chunks))}


def _named(chunk, index: int, num_chunks: int):
    """(name, parameter) of chunk `index`, named as in the GPTModel (without the DDP /
    Float16Module prefixes); virtual pipeline chunks share local names, so they carry the index."""
    prefix = f"chunk {index} " if num_chunks > 1 else ""
    return [(f"{prefix}{n}", p) for n, p in unwrap(chunk).named_parameters()]
