"""Built-in reward functions (TRL protocol: `fn(prompts, completions, **kw) -> list[float|None]`).

- `math_verify_reward`: 1.0 if the completion's answer is mathematically equal to the dataset's
  `answer` column, else 0.0; None when the ground truth itself cannot be parsed (the sample is
  "not applicable", as in TRL's `accuracy_reward`).
- `last_number_reward` (`last_number`): 1.0 if the last number of the completion equals the
  `answer` column's exactly, else 0.0 (no expressions, no LaTeX); None when the answer has no
  number.
- `format_reward`: 1.0 if the completion matches a regex (default: `<think>...</think>` then a
  non-empty answer), else 0.0.
- `length_penalty`: DAPO's soft overlong punishment on the completion's token count.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

_MATH_PARSE_TIMEOUT_S = 5


def _math_extraction_configs():
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    # \boxed{...} first (priority 0), then any LaTeX, then a plain final expression such as
    # "The answer is 42" (ExprExtractionConfig); the last match in the text wins for free text.
    return [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]


_NUMBER = re.compile(r"(?:(?<![\w)])-)?\d+(?:,\d{3})*(?:\.\d+|/\d+)?")
# a minus after a word character or ")" is subtraction ("5-3"), not a sign


def last_number(text: str) -> Fraction | None:
    """The last number written in `text` ("42", "-3", "1,000", "2.5", "3/4"), exactly; None
    when there is none (or it is a fraction over 0)."""
    found = _NUMBER.findall(str(text))
    if not found:
        return None
    try:
        return Fraction(found[-1].replace(",", ""))
    except ZeroDivisionError:
        return None


def last_number_reward(
    prompts: Sequence[Any],
    completions: Sequence[str],
    *,
    answer: Sequence[str],
    **kwargs: Any,
) -> list[float | None]:
    """1.0 where the last number of the completion equals the last number of `answer` exactly
    (`last_number`), else 0.0; None where the answer holds no number. Stricter than
    `math_verify`, which also accepts an unevaluated expression ("588 + 466" for 1054)."""
    if len(answer) != len(completions):
        raise ValueError(
            f"last_number_reward: {len(completions)} completions but {len(answer)} answers"
        )
    out: list[float | None] = []
    for completion, gold_text in zip(completions, answer, strict=True):
        gold = last_number(str(gold_text))
        out.append(None if gold is None else float(last_number(_text(completion)) == gold))
    return out


def math_verify_reward(
    prompts: Sequence[Any],
    completions: Sequence[str],
    *,
    answer: Sequence[str],
    **kwargs: Any,
) -> list[float | None]:
    """Answer verification with the `math-verify` package (parse + verify).

    answer: the ground-truth column (e.g. "42", "\\frac{1}{2}", "$x^2$"). The completion's
    answer is extracted from `\\boxed{}` if present, otherwise from the final LaTeX/plain
    expression. Returns 1.0 / 0.0 per sample, None where the ground truth does not parse.
    math-verify's timeouts use SIGALRM, which only works on the main thread; elsewhere they
    are disabled (the caller must bound the time).
    """
    from math_verify import parse, verify

    if len(answer) != len(completions):
        raise ValueError(
            f"math_verify_reward: {len(completions)} completions but {len(answer)} answers"
        )
    main = threading.current_thread() is threading.main_thread()
    timeout = _MATH_PARSE_TIMEOUT_S if main else None
    configs = _math_extraction_configs()
    out: list[float | None] = []
    for completion, gold_text in zip(completions, answer, strict=False):
        gold = parse(str(gold_text), parsing_timeout=timeout)
        if not gold:
            out.append(None)
            continue
        pred = parse(_text(completion), extraction_config=configs, parsing_timeout=timeout)
        out.append(float(verify(gold, pred, timeout_seconds=timeout)))
    return out


DEFAULT_FORMAT_PATTERN = r"^\s*<think>.*?</think>\s*\S.*$"


def format_reward(
    prompts: Sequence[Any],
    completions: Sequence[str],
    *,
    pattern: str = DEFAULT_FORMAT_PATTERN,
    **kwargs: Any,
) -> list[float]:
    """1.0 where the whole completion matches `pattern` (re.DOTALL), else 0.0.

    The default asks for a `<think>...</think>` block followed by a non-empty answer. Configure
    it with `load_reward_function("format", pattern=r"...")`.
    """
    regex = re.compile(pattern, re.DOTALL)
    return [1.0 if regex.fullmatch(_text(c)) else 0.0 for c in completions]


def length_penalty(
    prompts: Sequence[Any],
    completions: Sequence[str],
    *,
    completion_ids: Sequence[Sequence[int]] | None = None,
    max_length: int = 4096,
    cache_length: int = 512,
    **kwargs: Any,
) -> list[float]:
    """DAPO's soft overlong punishment on the completion length L (tokens), in [-1, 0]:

        0                                     if L <= max_length - cache_length
        (max_length - cache_length - L) / cache_length   if in the last `cache_length` tokens
        -1                                    if L > max_length

    max_length should be the generation budget; combine with a correctness reward through
    `reward_weights`. Needs `completion_ids` (raises ValueError without them).
    """
    if completion_ids is None:
        raise ValueError("length_penalty needs completion_ids (token ids of each completion)")
    if not 0 < cache_length <= max_length:
        raise ValueError(
            f"length_penalty: need 0 < cache_length <= max_length; got cache_length="
            f"{cache_length}, max_length={max_length}"
        )
    start = max_length - cache_length
    out = []
    for ids in completion_ids:
        n = len(ids)
        if n <= start:
            out.append(0.0)
        elif n <= max_length:
            out.append((start - n) / cache_length)
        else:
            out.append(-1.0)
    return out


def _text(completion: Any) -> str:
    """Completion text; conversational completions (`[{"role", "content"}]`) use the last turn."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, (list, tuple)) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


BUILTINS = {
    "math_verify": math_verify_reward,
    "last_number": last_number_reward,
    "format": format_reward,
    "length_penalty": length_penalty,
}
