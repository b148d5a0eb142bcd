"""Training and held-out prompts (`eval.path` or `eval.fraction`), disjoint by construction.

`eval.path`: the held-out prompts are read from their own source with the `data.*` settings
(prompt column, chat template, system prompt, length limit); the training data is untouched and
prompts found in both are counted in the log. `eval.fraction` f: the training source's rows are
grouped by prompt (the prompt column's value, so repeated rows of one prompt stay together), a
seeded permutation (`numpy` PCG64, `eval.seed`) of the distinct prompts is drawn and its first
round(f x distinct) prompts (at least one, never all) are held out: every row holding one of
them leaves the training set (which keeps its file order), and the held-out set holds each of
them once (its first row), in the permutation's order, so its first `eval.max_prompts` are a
seeded random subset. The split depends only on the rows, `eval.fraction` and `eval.seed` (not
on the world size or the rank), so every rank computes it alike and a resumed run gets it back.
Other algorithms that hold out part of their data call
`held_out_split` on their own rows.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np

from megarl.data.dataset import DataConfig, DataError, PromptDataset, load_rows
from megarl.data.toy import toy_rows

log = logging.getLogger(__name__)


def _prompt_key(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)


def held_out_split(prompts: list[Any], fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(training row indices ascending, held-out row indices: one row per held-out prompt, in
    the seeded order) of rows whose prompt values are `prompts`; no prompt value on both
    sides (module docstring)."""
    if not 0 < fraction < 1:
        raise ValueError(f"fraction={fraction}; accepted: 0 < fraction < 1")
    keys = [_prompt_key(p) for p in prompts]
    distinct = list(dict.fromkeys(keys))
    if len(distinct) < 2:
        raise DataError(
            f"eval.fraction={fraction}: the training data has {len(distinct)} distinct prompt; "
            "holding any out would leave nothing to train on (set eval.path instead)"
        )
    count = min(max(1, round(fraction * len(distinct))), len(distinct) - 1)
    order = np.random.default_rng(seed).permutation(len(distinct))
    held = [distinct[int(i)] for i in order[:count]]
    first = {}
    for i, k in enumerate(keys):
        first.setdefault(k, i)
    held_set = set(held)
    train = [i for i, k in enumerate(keys) if k not in held_set]
    return train, [first[k] for k in held]


def prompt_sets(data: DataConfig, ev, tokenizer) -> tuple[PromptDataset, PromptDataset | None]:
    """(training prompts, held-out prompts or None when `ev` (an `EvalConfig`) names none)."""
    if ev.path is not None:
        held = PromptDataset(load_rows(ev.path), tokenizer, data, source=ev.path)
        train = PromptDataset.from_config(data, tokenizer)
        seen = {tuple(p) for p in train.prompt_ids}
        both = sum(tuple(p) in seen for p in held.prompt_ids)
        if both:
            log.warning(
                "eval.path=%s: %d of its %d prompts are also training prompts",
                ev.path,
                both,
                len(held),
            )
        else:
            log.info(
                "eval.path=%s: %d held-out prompts, none in the training data", ev.path, len(held)
            )
        return train, held
    if ev.fraction == 0:
        return PromptDataset.from_config(data, tokenizer), None
    if data.path is None:
        rows, source = toy_rows(), "<toy copy task>"
    else:
        rows, source = load_rows(data.path), data.path
    missing = next((i for i, r in enumerate(rows) if data.prompt_key not in r), None)
    if missing is not None:
        raise DataError(
            f"prompt column {data.prompt_key!r} missing from row {missing} of {source}; columns "
            f"present: {sorted(rows[missing])} (set data.prompt_key)"
        )
    train_rows, held_rows = held_out_split([r[data.prompt_key] for r in rows], ev.fraction, ev.seed)
    train = PromptDataset([rows[i] for i in train_rows], tokenizer, data, source=source)
    held = PromptDataset(
        [rows[i] for i in held_rows], tokenizer, data, source=f"{source} (held out)"
    )
    log.info(
        "eval.fraction=%g (seed %d): %d of %d distinct prompts held out for evaluation; their "
        "%d of %d rows removed from training (no prompt in both), %d rows left to train on",
        ev.fraction,
        ev.seed,
        len(held_rows),
        len({_prompt_key(r[data.prompt_key]) for r in rows}),
        len(rows) - len(train_rows),
        len(rows),
        len(train_rows),
    )
    return train, held
