"""The embedded default task: copy a short digit string, then stop.

Prompts are "copy {s}=" for strings s of 2, 3 or 4 distinct digits; the `answer` column is s:
"copy 371=" -> "371<eos>". The set is fixed: `TOY_ROWS_PER_LENGTH` rows per length (all 90
two-digit strings, repeated to fill their share, and seeded samples of the three- and four-digit
ones), so the three lengths are equally frequent. The tokenizer is the character tokenizer over
`TOY_CHARS` (20 tokens: `<pad>`, `<bos>`, `<eos>`, then 17 characters), so a prompt is 8-10
tokens and a perfect response 3-5 (the answer, then `<eos>`). A tiny model from random init
must learn both the content (attend to the right prompt position) and when to stop (the
response is as long as the answer): the run exercises sampling over several tokens, EOS
handling and, with the default `kl_coef`, the reference model.

Reward shaping (`toy_reward`): exact match on 2-4 digits plus EOS is almost never 1 by chance
from random init (about 17**-4), so the reward gives credit per correct position and one more
unit for stopping right after the answer, divided by the longer of the two lengths plus one.
1.0 means exactly "answer<eos>"; a runaway response is diluted by its own length, so stopping
pays from the first steps. `exact_match` is the 0/1 metric beside it (the default gives it
weight 0 in `reward.weights`: logged as `reward/exact_match`, not trained on).
"""

from __future__ import annotations

import itertools
import os
import random
from collections.abc import Sequence
from typing import Any

from megarl.data.tokenizer import SPECIAL_TOKENS, build_char_tokenizer

TOY_CHARS = "0123456789+= copy"
"""The characters of the toy tokenizer (ids 3.. in this order; "+" is unused by the task)."""
TOY_PREFIX = "copy "
TOY_ROWS_PER_LENGTH = 360
"""Rows of each answer length 2, 3 and 4."""

_EOS_ID = SPECIAL_TOKENS.index("<eos>")
_ID_TO_CHAR = {len(SPECIAL_TOKENS) + i: c for i, c in enumerate(TOY_CHARS)}
# stands for a special token other than a final <eos> inside a response: never a digit
_OTHER = "\x00"


def toy_rows(seed: int = 0) -> list[dict]:
    """The prompts `{"prompt": "copy 371=", "answer": "371"}`, `TOY_ROWS_PER_LENGTH` per answer
    length 2, 3, 4 in length order (1,080 rows). Length 2: all 90 strings of distinct digits,
    repeated to fill the share; lengths 3 and 4: distinct strings drawn with Random(seed)."""
    rng = random.Random(seed)
    strings: list[str] = []
    for length in (2, 3, 4):
        pool = ["".join(p) for p in itertools.permutations("0123456789", length)]
        if len(pool) < TOY_ROWS_PER_LENGTH:
            strings += (pool * -(-TOY_ROWS_PER_LENGTH // len(pool)))[:TOY_ROWS_PER_LENGTH]
        else:
            strings += rng.sample(pool, TOY_ROWS_PER_LENGTH)
    return [{"prompt": f"{TOY_PREFIX}{s}=", "answer": s} for s in strings]


def toy_sft_rows(seed: int = 0) -> list[dict]:
    """SFT rows of the copy task: `{"prompt": "copy 371=", "response": "371"}` for every row of
    `toy_rows(seed)` (the SFT reader appends the EOS)."""
    return [{"prompt": r["prompt"], "response": r["answer"]} for r in toy_rows(seed)]


def corrupt(answer: str, rng: random.Random) -> str:
    """A wrong answer near `answer`: one digit changed, the last digit dropped, a digit
    appended, or two neighbours swapped (never `answer` itself)."""
    while True:
        kind = rng.randrange(4)
        i = rng.randrange(len(answer))
        d = rng.choice("0123456789")
        if kind == 0:
            out = answer[:i] + d + answer[i + 1 :]
        elif kind == 1:
            out = answer[:-1]
        elif kind == 2:
            out = answer + d
        else:
            j = min(i + 1, len(answer) - 1)
            chars = list(answer)
            chars[i], chars[j] = chars[j], chars[i]
            out = "".join(chars)
        if out and out != answer:
            return out


def toy_preference_rows(seed: int = 0) -> list[dict]:
    """Preference pairs of the copy task, one per row of `toy_rows(seed)`:
    `{"prompt": "copy 371=", "chosen": "371", "rejected": <corrupt("371")>, "answer": "371"}`,
    the corruptions drawn with Random(seed + 1)."""
    rng = random.Random(seed + 1)
    return [
        {
            "prompt": r["prompt"],
            "chosen": r["answer"],
            "rejected": corrupt(r["answer"], rng),
            "answer": r["answer"],
        }
        for r in toy_rows(seed)
    ]


def noisy(answer: str, rng: random.Random) -> str:
    """A candidate answer for `answer` of graded quality: `answer` itself (a quarter of the
    time), 1-3 `corrupt` edits of it, or (a quarter of the time) a random string of 1-7
    characters of the task's alphabet (`TOY_CHARS`, digits twice as likely), repeats allowed."""
    u = rng.random()
    if u < 0.25:
        return answer
    if u < 0.5:
        chars = "0123456789" * 2 + TOY_CHARS
        return "".join(rng.choice(chars) for _ in range(rng.randint(1, 7)))
    out = answer
    for _ in range(rng.choice((1, 1, 2, 3))):
        out = corrupt(out, rng)
    return out


def toy_score(text: str, answer: str, stopped: bool = True) -> float:
    """`toy_reward` of one response `text` (`stopped`: it ended with `<eos>`; the formula
    there)."""
    hits = sum(a == b for a, b in zip(text, answer, strict=False))
    stop = 1 if stopped and len(text) == len(answer) else 0
    return (hits + stop) / (max(len(text), len(answer)) + 1)


def candidate(answer: str, rng: random.Random) -> str:
    """A response a policy might give for `answer`: `noisy(answer)` (60%), one digit repeated
    1-6 times (20%; a digit of the answer half of those times), or the answer's digits in
    another order (20%)."""
    u = rng.random()
    if u < 0.6:
        return noisy(answer, rng)
    if u < 0.8:
        digit = rng.choice(answer) if rng.random() < 0.5 else rng.choice("0123456789")
        return digit * rng.randint(1, 6)
    chars = list(answer)
    rng.shuffle(chars)
    return "".join(chars)


def toy_reward_model_rows(seed: int = 0, per_prompt: int = 3, gap: float = 0.15) -> list[dict]:
    """Preference pairs for a reward model of the copy task: for each row of `toy_rows(seed)`,
    `per_prompt` pairs of two responses whose shaped scores (`toy_score`) differ by at least
    `gap`, the better one chosen. Two thirds of the pairs put the correct answer against a
    `candidate`, a third two candidates (near misses, wrong lengths, repeated digits, shuffles,
    garbage; a candidate is the answer a quarter of the time), drawn with Random(seed + 2): in
    ~18% of the pairs both responses are wrong. Ranking two wrong answers too (not only the answer
    above everything else) is what lets a policy climb the reward model's score towards the
    answer: an RM taught only "correct > wrong" scores wrong answers it never saw ranked (e.g.
    "2222") at random, and PPO finds them (docs/reward-models.md)."""
    rng = random.Random(seed + 2)
    out = []
    for r in toy_rows(seed):
        gold = r["answer"]
        for _ in range(per_prompt):
            first = gold if rng.random() < 2 / 3 else candidate(gold, rng)
            while not first.strip():  # a blank answer is no answer
                first = candidate(gold, rng)
            while True:
                second = candidate(gold, rng)
                if second.strip() and abs(toy_score(first, gold) - toy_score(second, gold)) >= gap:
                    break
            if toy_score(first, gold) < toy_score(second, gold):
                first, second = second, first
            out.append({"prompt": r["prompt"], "chosen": first, "rejected": second, "answer": gold})
    return out


def toy_tokenizer(out_dir: str | os.PathLike | None = None):
    """The character tokenizer over `TOY_CHARS` (saved to `out_dir` when given)."""
    return build_char_tokenizer(TOY_CHARS, out_dir)


def _responses(
    completions: Sequence[Any], completion_ids: Sequence[Sequence[int]] | None
) -> list[tuple[str, bool]]:
    """(text, stopped) per sample. From `completion_ids` when given: every token but a final
    `<eos>` is one character (a special token becomes `_OTHER`), stopped = it ends in `<eos>`.
    Without ids (plain TRL strings, specials already skipped): the text, stopped = True."""
    if completion_ids is not None:
        out = []
        for ids in completion_ids:
            ids = list(ids)
            stopped = bool(ids) and ids[-1] == _EOS_ID
            body = ids[:-1] if stopped else ids
            out.append(("".join(_ID_TO_CHAR.get(t, _OTHER) for t in body), stopped))
        return out
    texts = []
    for completion in completions:
        if isinstance(completion, list):  # conversational: grade the last message
            completion = completion[-1]["content"] if completion else ""
        texts.append((str(completion), True))
    return texts


def _check(name: str, completions: Sequence[Any], answer: Sequence[str], ids) -> None:
    if len(answer) != len(completions):
        raise ValueError(f"{name}: {len(completions)} completions but {len(answer)} answers")
    if ids is not None and len(ids) != len(completions):
        raise ValueError(f"{name}: {len(completions)} completions but {len(ids)} completion_ids")


def toy_reward(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    *,
    answer: Sequence[str],
    completion_ids: Sequence[Sequence[int]] | None = None,
    **kwargs: Any,
) -> list[float]:
    """Shaped copy reward in [0, 1] (TRL protocol); 1.0 exactly for "answer<eos>".

    For a response of n characters (`<eos>` excluded) and an answer of L digits:
    `(#{i < min(n, L): response[i] == answer[i]} + stop) / (max(n, L) + 1)`, where stop = 1 if
    the response ended with `<eos>` right after n == L characters. Example, answer "371":
    "371<eos>" 1.0, "371" cut at max_tokens 0.75, "3712<eos>" 0.6, "37<eos>" 0.5, "9<eos>" 0.0.
    completion_ids: the response token ids (megarl passes them), which show the `<eos>` that
    the decoded `completions` skip; without them every completion counts as stopped.
    """
    _check("toy_reward", completions, answer, completion_ids)
    responses = _responses(completions, completion_ids)
    return [
        toy_score(text, str(gold), stopped)
        for (text, stopped), gold in zip(responses, answer, strict=True)
    ]


def exact_match(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    *,
    answer: Sequence[str],
    completion_ids: Sequence[Sequence[int]] | None = None,
    **kwargs: Any,
) -> list[float]:
    """1.0 where the response is exactly the answer followed by `<eos>`, else 0.0 (see
    `toy_reward` for how `completion_ids` are read)."""
    _check("exact_match", completions, answer, completion_ids)
    responses = _responses(completions, completion_ids)
    return [
        1.0 if stopped and text == str(gold) else 0.0
        for (text, stopped), gold in zip(responses, answer, strict=True)
    ]
