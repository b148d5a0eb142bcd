"""Writes the data of examples/sft_smollm2_tools_cpu.yaml and grpo_smollm2_tools_cpu.yaml beside
this script:

    python examples/data/make_smollm2_tools.py

Three-digit additions ({"prompt": "What is 347 + 589?", "answer": "936"}), in the phrasings of
make_smollm2_arith.py, and a calculator tool (the `tools` environment's `calculator`):
- `smollm2_tools_train.jsonl`: the RL prompts;
- `smollm2_tools_eval.jsonl`: 120 held-out questions (no operand pair of them is in another file);
- `smollm2_tools_sft.jsonl`: a few tool-use demonstrations as conversations: the tools system
  message exactly as the RL run renders it for SmolLM2's template
  (`megarl.envs.tool_calls.with_tools`), the question, a Hermes tool call, the tool's result and
  the answer. Only some demonstrations call the tool; the rest answer in one step (correctly),
  so that the SFT start calls the tool only sometimes.
The output depends only on the constants below.
"""

from __future__ import annotations

import json
import os
import random

from megarl.envs.tool_calls import tool_schema, with_tools
from megarl.envs.tools import calculator

SEED = 0
EVAL_ROWS = 120
TRAIN_ROWS = 1000
SFT_ROWS = 24
SFT_TOOL_SHARE = 0.5
"""The share of demonstrations that call the calculator (the others answer directly)."""
PHRASINGS = (
    "What is {a} + {b}?",
    "Calculate {a} + {b}.",
    "What is the sum of {a} and {b}?",
    "{a} + {b} = ?",
    "How much is {a} plus {b}?",
    "Add {a} and {b}.",
)


def question(rng: random.Random, seen: set) -> dict:
    while True:
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        if (min(a, b), max(a, b)) not in seen:
            seen.add((min(a, b), max(a, b)))
            text = rng.choice(PHRASINGS).format(a=a, b=b)
            return {"prompt": text, "answer": str(a + b), "a": a, "b": b}


def demonstration(q: dict, use_tool: bool) -> dict:
    expression = f"{q['a']} + {q['b']}"
    user = [{"role": "user", "content": q["prompt"]}]
    messages = with_tools(user, [tool_schema(calculator)])
    if use_tool:
        call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
        messages += [
            {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
            {"role": "tool", "content": calculator(expression)},
            {"role": "assistant", "content": f"{expression} = {q['answer']}"},
        ]
    else:  # the answer in one step, which the model cannot learn from a dozen examples
        messages.append({"role": "assistant", "content": f"{expression} = {q['answer']}"})
    return {"messages": messages}


def main() -> None:
    rng, seen = random.Random(SEED), set()
    held_out = [question(rng, seen) for _ in range(EVAL_ROWS)]
    train = [question(rng, seen) for _ in range(TRAIN_ROWS)]
    demos = [question(rng, seen) for _ in range(SFT_ROWS)]
    n_tool = round(SFT_TOOL_SHARE * SFT_ROWS)
    sft = [demonstration(q, i < n_tool) for i, q in enumerate(demos)]
    rng.shuffle(sft)
    here = os.path.dirname(os.path.abspath(__file__))

    def strip(rows):
        return [{"prompt": r["prompt"], "answer": r["answer"]} for r in rows]

    for name, part in (("eval", strip(held_out)), ("train", strip(train)), ("sft", sft)):
        path = os.path.join(here, f"smollm2_tools_{name}.jsonl")
        with open(path + ".tmp", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
        os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
