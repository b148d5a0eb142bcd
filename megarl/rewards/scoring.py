"""Scoring a batch with several reward functions (TRL's reward-function protocol).

A reward function is called as

    fn(prompts=[...], completions=[...], completion_ids=[[...], ...], **dataset_columns)
        -> list[float | None]        # one entry per sample

and should accept `**kwargs` for the columns it does not use. `None` means "not applicable to
this sample" (e.g. a math reward on a code prompt): it never fails the run. Combination, as in
TRL: `total = nansum_f(w_f * r_f)`; a sample with None from every function scores 0 and a
warning is logged.

Failures: a function returning the wrong number of values is a bug in the function and always
raises ValueError. A function that raises is re-called one sample at a time to find the failing
sample(s); with `on_error="raise"` a RuntimeError names the function and the first failing
sample index, with `on_error="zero"` those samples score 0 for that function and are counted.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from functools import partial
from typing import Any, Protocol

import torch

from megarl.errors import UserError
from megarl.plugins import FORMS, PluginError, load_object, parse_spec
from megarl.rewards.builtins import BUILTINS

logger = logging.getLogger(__name__)

ON_ERROR = ("raise", "zero")
ALIASES = {
    "toy": "megarl.data.toy:toy_reward",
    "toy_exact_match": "megarl.data.toy:exact_match",
}
"""Built-in names that live outside this package (resolved as dotted paths, imported on use)."""


class RewardFunctionError(UserError, ValueError, TypeError):
    """A reward function spec that does not resolve to a callable; names the spec. (A TypeError
    too, for a spec that resolves to something not callable.)"""


class RewardFunction(Protocol):
    """`fn(prompts, completions, completion_ids=..., **dataset_columns) -> list[float | None]`."""

    def __call__(
        self, prompts: list[Any], completions: list[Any], **kwargs: Any
    ) -> list[float | None]: ...


def load_reward_function(spec: str, **kwargs: Any) -> RewardFunction:
    """A reward function from a built-in name or a plugin path, with `kwargs` bound.

    spec: one of the built-ins (`math_verify`, `format`, `length_penalty`, `toy`), or
    "package.module:function" / "package.module.function" / "path/to/file.py:function"
    (`megarl.plugins.load_object`). The returned function keeps the original `__name__` (used
    to label metrics and errors). Raises `RewardFunctionError` for a spec that does not
    resolve or resolves to something not callable.
    """
    if spec in BUILTINS:
        fn = BUILTINS[spec]
    else:
        path = ALIASES.get(spec, spec)
        if parse_spec(path) is None:
            raise RewardFunctionError(
                f"reward function {spec!r} is neither a built-in "
                f"({sorted([*BUILTINS, *ALIASES])}) nor a path {FORMS}"
            )
        try:
            fn = load_object(path, what="reward function")
        except PluginError as err:
            raise RewardFunctionError(str(err)) from err
    if not callable(fn):
        raise RewardFunctionError(
            f"reward function {spec!r} is not callable (got {type(fn).__name__})"
        )
    if kwargs:
        bound = partial(fn, **kwargs)
        bound.__name__ = function_name(fn)
        return bound
    return fn


def function_name(fn: Any) -> str:
    """A label for `fn`: its `__name__`, the wrapped function's name, or its class name."""
    name = getattr(fn, "__name__", None)
    if name is None and isinstance(fn, partial):
        return function_name(fn.func)
    return name or type(fn).__name__


def score(
    functions: Sequence[RewardFunction],
    weights: Sequence[float] | None,
    prompts: list[Any],
    completions: list[Any],
    completion_ids: list[list[int]] | None,
    columns: dict[str, Sequence[Any]],
    *,
    on_error: str = "raise",
) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """Score a batch of B samples with every function and combine with `weights`.

    Returns `(total [B] float32, per_function {name: [B] float32, NaN where None}, errors)`
    where `errors` counts (function, sample) pairs that raised under `on_error="zero"`.
    Duplicate function names get a `_<index>` suffix in `per_function`.
    """
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {list(ON_ERROR)}; got {on_error!r}")
    weights = [1.0] * len(functions) if weights is None else list(weights)
    if len(weights) != len(functions):
        raise ValueError(
            f"reward_weights has {len(weights)} entries but there are {len(functions)} reward "
            "functions"
        )
    batch = len(completions)
    if len(prompts) != batch:
        raise ValueError(f"{len(prompts)} prompts but {batch} completions")
    for key, col in columns.items():
        if len(col) != batch:
            raise ValueError(f"dataset column {key!r} has {len(col)} values, batch has {batch}")

    per_function: dict[str, torch.Tensor] = {}
    errors = 0
    for i, fn in enumerate(functions):
        name = function_name(fn)
        key = name if name not in per_function else f"{name}_{i}"
        values, n_err = _score_one(
            fn, name, prompts, completions, completion_ids, columns, on_error
        )
        per_function[key] = values
        errors += n_err

    if functions:
        stacked = torch.stack(list(per_function.values()), dim=1)  # [B, F]
        w = torch.tensor(weights, dtype=torch.float32)
        total = (stacked * w).nansum(dim=1)
        none_everywhere = stacked.isnan().all(dim=1)
    else:
        total = torch.zeros(batch, dtype=torch.float32)
        none_everywhere = torch.ones(batch, dtype=torch.bool)
    if functions and none_everywhere.any():  # no function at all: nothing to warn about
        idx = none_everywhere.nonzero().flatten().tolist()
        logger.warning(
            "all reward functions returned None for %d sample(s) (indices %s); they score 0",
            len(idx),
            idx[:16],
        )
    return total, per_function, errors


def _call(fn, prompts, completions, completion_ids, columns) -> list:
    return list(
        fn(
            prompts=prompts,
            completions=completions,
            completion_ids=completion_ids,
            **columns,
        )
    )


def _to_float(value: Any, name: str, index: int) -> float:
    if value is None:
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"reward function {name!r} returned {value!r} ({type(value).__name__}) for sample "
            f"{index}; expected a float, an int, a bool or None"
        ) from None


def _score_one(
    fn, name, prompts, completions, completion_ids, columns, on_error
) -> tuple[torch.Tensor, int]:
    """One function over the batch -> (`[B]` float32 with NaN for None, number of errors)."""
    batch = len(completions)
    try:
        raw = _call(fn, prompts, completions, completion_ids, columns)
    except Exception as batch_err:  # noqa: BLE001 - located per sample below
        raw, n_err = _score_per_sample(
            fn, name, prompts, completions, completion_ids, columns, on_error, batch_err
        )
    else:
        n_err = 0
        if len(raw) != batch:
            raise ValueError(
                f"reward function {name!r} returned {len(raw)} values for {batch} completions"
            )
    values = [_to_float(v, name, j) for j, v in enumerate(raw)]
    return torch.tensor(values, dtype=torch.float32), n_err


def _score_per_sample(
    fn, name, prompts, completions, completion_ids, columns, on_error, batch_err
) -> tuple[list, int]:
    """Re-call `fn` on each sample alone; failing samples raise or score 0 (`on_error`)."""
    raw: list = []
    n_err = 0
    for j in range(len(completions)):
        one_cols = {k: v[j : j + 1] for k, v in columns.items()}
        one_ids = None if completion_ids is None else completion_ids[j : j + 1]
        try:
            out = _call(fn, prompts[j : j + 1], completions[j : j + 1], one_ids, one_cols)
        except Exception as err:
            if on_error == "raise":
                raise RuntimeError(
                    f"reward function {name!r} raised on sample {j}: {type(err).__name__}: {err}"
                ) from err
            logger.warning(
                "reward function %r raised on sample %d (scored 0): %s: %s",
                name,
                j,
                type(err).__name__,
                err,
            )
            raw.append(0.0)
            n_err += 1
            continue
        if len(out) != 1:
            raise ValueError(
                f"reward function {name!r} returned {len(out)} values for 1 completion"
            )
        raw.append(out[0])
    if n_err == 0:
        # Only the batched call failed: no sample to blame, so the policy decides for the batch.
        if on_error == "raise":
            raise RuntimeError(
                f"reward function {name!r} raised on the batch of {len(completions)} samples "
                f"(each sample alone succeeded): {type(batch_err).__name__}: {batch_err}"
            ) from batch_err
        logger.warning(
            "reward function %r raised on the batch but not per sample; using per-sample scores",
            name,
        )
    return raw, n_err
