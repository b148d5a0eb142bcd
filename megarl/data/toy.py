"""The embedded default task: single-digit addition, small enough for a tiny model on a CPU.

Prompts are "{a}+{b}=" for a, b >= 0 with a + b <= 9 (55 prompts), the `answer` column is
str(a + b). The tokenizer is the character tokenizer over "0123456789+=" (15 tokens: `<pad>`,
`<bos>`, `<eos>`, then the 12 characters), so a prompt is 4 tokens and the answer is one.
A model from random init only has to learn a 55-entry lookup table from a binary reward.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from megarl.data.tokenizer import build_char_tokenizer

TOY_CHARS = "0123456789+="


def toy_rows() -> list[dict]:
    """The 55 prompts `{"prompt": "a+b=", "answer": "a+b"}` in (a, b) order."""
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10 - a)]


def toy_tokenizer(out_dir: str | os.PathLike | None = None):
    """The character tokenizer over `TOY_CHARS` (saved to `out_dir` when given)."""
    return build_char_tokenizer(TOY_CHARS, out_dir)


def toy_reward(
    prompts: Sequence[Any], completions: Sequence[Any], *, answer: Sequence[str], **kwargs: Any
) -> list[float]:
    """1.0 where the completion's first character equals `answer`, else 0.0 (TRL protocol).

    completions: decoded strings with special tokens skipped, so a completion "7<eos>" arrives
    as "7" and scores 1.0 for answer "7"; "78" also scores 1.0 (only the first character is
    graded — the tiny model need not learn when to stop), an empty completion 0.0. A
    conversational completion (a list of messages) is graded on its last message's content.
    """
    if len(answer) != len(completions):
        raise ValueError(f"toy_reward: {len(completions)} completions but {len(answer)} answers")
    out = []
    for completion, gold in zip(completions, answer, strict=True):
        if isinstance(completion, list):
            completion = completion[-1]["content"] if completion else ""
        out.append(1.0 if completion[:1] == str(gold) else 0.0)
    return out
