"""Writes the prompts of examples/grpo_smollm2_arith_cpu.yaml beside this script:

    python examples/data/make_smollm2_arith.py

`smollm2_arith_train.jsonl` and `smollm2_arith_eval.jsonl`: additions of two one-digit numbers
(1 to 9), each asked in six phrasings ({"prompt": "What is 3 + 5?", "answer": "8"}). A seeded
quarter of the operand pairs is held out for evaluation; a pair is unordered ({3, 5} covers
"3 + 5" and "5 + 3"), so no evaluation question, in any phrasing or order, is ever trained on.
The evaluation rows are in a seeded random order (a prefix is a fair sample). The output depends
only on the constants below.
"""

from __future__ import annotations

import json
import os
import random

SEED = 0
HELD_OUT = 0.25
PHRASINGS = (
    "What is {a} + {b}?",
    "Calculate {a} + {b}.",
    "What is the sum of {a} and {b}?",
    "{a} + {b} = ?",
    "How much is {a} plus {b}?",
    "Add {a} and {b}.",
)
PAIRS = [(a, b) for a in range(1, 10) for b in range(a, 10)]  # unordered: a <= b


def rows(pairs: list[tuple[int, int]]) -> list[dict]:
    """Every phrasing of every pair, in both operand orders (once when a == b)."""
    out = []
    for a, b in pairs:
        for x, y in sorted({(a, b), (b, a)}):
            out += [{"prompt": p.format(a=x, b=y), "answer": str(x + y)} for p in PHRASINGS]
    return out


def main() -> None:
    pairs = list(PAIRS)
    random.Random(SEED).shuffle(pairs)
    cut = round(HELD_OUT * len(pairs))
    here = os.path.dirname(os.path.abspath(__file__))
    held_out = rows(sorted(pairs[:cut]))
    random.Random(SEED + 1).shuffle(held_out)
    for name, part in (("eval", held_out), ("train", rows(sorted(pairs[cut:])))):
        path = os.path.join(here, f"smollm2_arith_{name}.jsonl")
        with open(path + ".tmp", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
        os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
