"""`megarl prepare-data FORMAT --in PATH --out FILE.jsonl`: public layouts -> megarl columns.

Nothing is downloaded: PATH is a local `.jsonl` / `.json` / `.parquet` file, a directory of them,
or a directory written by `datasets.save_to_disk` (its `.arrow` files). FORMAT:

- `gsm8k`: `question`, `answer` ending in `#### 42` -> `prompt`, `answer` ("42", thousands
  separators removed), `solution` (the worked answer before `####`): what `math_verify` scores.
- `math`: `problem` with `answer`, or with a `solution` holding `\\boxed{...}` (Hendrycks MATH,
  MATH-500) -> `prompt`, `answer` (the last boxed expression), `solution`.
- `preference`: `prompt` + `chosen` + `rejected` (strings or chat messages), TRL's implicit-prompt
  form (`chosen` / `rejected` whole conversations sharing their first turns), or Anthropic HH's
  text form ("\\n\\nHuman: ... \\n\\nAssistant: ...") -> `prompt` (messages), `chosen`, `rejected`
  (the final assistant message's text), `margin` when the row has `score_chosen` /
  `score_rejected` (UltraFeedback) or `margin`.
- `sft`: `messages` (or ShareGPT's `conversations` with `from` / `value`), TRL's `prompt` +
  `completion`, `prompt` + `response`, or Alpaca's `instruction` (+ `input`) + `output` ->
  `messages` (role / content), which the SFT reader trains on (assistant turns only).

A file of another shape fails with one line naming the file, the row and the columns it has
against the columns each accepted layout needs. The output is written to a temporary file and
renamed, so a failed run leaves none.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

from megarl import console
from megarl.data.dataset import DataError, load_rows

_HH_TURN = re.compile(r"\n\n(Human|Assistant): ")
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "bot": "assistant",
    "model": "assistant",
}


class _Shape(DataError):
    """A row that matches none of a format's accepted layouts."""


def _missing(row: dict, where: str, fmt: str, layouts: list[str]) -> _Shape:
    return _Shape(
        f"{where}: not a {fmt} row: it has columns {sorted(row)}; accepted: " + " | ".join(layouts)
    )


# ---------------------------------------------------------------------------------- math
def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, braces balanced."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, j = 1, i
    while j < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
    return text[i : j - 1].strip() if depth == 0 else None


def gsm8k_row(row: dict, where: str) -> dict:
    if not isinstance(row.get("question"), str) or not isinstance(row.get("answer"), str):
        raise _missing(row, where, "gsm8k", ["question + answer ('... #### 42')"])
    solution, sep, final = row["answer"].rpartition("####")
    if not sep or not final.strip():
        raise DataError(f"{where}: answer has no '#### <number>' line: {row['answer'][-80:]!r}")
    return {
        "prompt": row["question"].strip(),
        "answer": final.strip().replace(",", ""),
        "solution": solution.strip(),
    }


def math_row(row: dict, where: str) -> dict:
    problem = row.get("problem")
    if not isinstance(problem, str):
        raise _missing(row, where, "math", ["problem + answer", "problem + solution (\\boxed{})"])
    answer = row.get("answer")
    solution = row.get("solution") or ""
    if not isinstance(answer, str) or not answer.strip():
        answer = last_boxed(solution) if isinstance(solution, str) else None
        if not answer:
            raise DataError(f"{where}: no answer column and no \\boxed{{}} in its solution")
    return {"prompt": problem.strip(), "answer": answer.strip(), "solution": solution}


# ------------------------------------------------------------------------------ messages
def _is_messages(value) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    )


def hh_messages(text: str) -> list[dict]:
    """Anthropic HH's "\\n\\nHuman: ...\\n\\nAssistant: ..." text as chat messages."""
    # split gives [text before the first turn, role, content, role, content, ...]
    parts = _HH_TURN.split("\n\n" + text.lstrip("\n"))
    roles = {"Human": "user", "Assistant": "assistant"}
    return [
        {"role": roles[parts[i]], "content": parts[i + 1].strip()}
        for i in range(1, len(parts) - 1, 2)
    ]


def sharegpt_messages(turns: list, where: str) -> list[dict]:
    out = []
    for k, t in enumerate(turns):
        role = _SHAREGPT_ROLES.get(str(t.get("from", "")).lower()) if isinstance(t, dict) else None
        if role is None or not isinstance(t.get("value"), str):
            raise DataError(
                f"{where}: conversations[{k}] is not a ShareGPT turn ({{'from': human|gpt|system, "
                f"'value': text}}): {str(t)[:80]}"
            )
        out.append({"role": role, "content": t["value"]})
    return out


def _final_reply(messages: list[dict], where: str, column: str) -> str:
    if messages[-1].get("role") != "assistant":
        raise DataError(f"{where}: {column} does not end with an assistant message")
    return messages[-1]["content"]


# ---------------------------------------------------------------------------- preference
def preference_row(row: dict, where: str) -> dict:
    chosen, rejected = row.get("chosen"), row.get("rejected")
    layouts = [
        "prompt + chosen + rejected",
        "chosen + rejected (conversations sharing a prefix)",
        "chosen + rejected (HH text '\\n\\nHuman: ... \\n\\nAssistant: ...')",
    ]
    if chosen is None or rejected is None:
        raise _missing(row, where, "preference", layouts)
    if isinstance(chosen, str) and isinstance(rejected, str) and "prompt" not in row:
        if "\n\nAssistant:" not in chosen or "\n\nAssistant:" not in rejected:
            raise _missing(row, where, "preference", layouts)
        chosen, rejected = hh_messages(chosen), hh_messages(rejected)
    out: dict = {}
    if _is_messages(chosen) and _is_messages(rejected):
        prompt = row.get("prompt")
        if prompt is None:  # implicit prompt: the turns both conversations share
            k = 0
            while k < min(len(chosen), len(rejected)) - 1 and chosen[k] == rejected[k]:
                k += 1
            prompt, chosen, rejected = chosen[:k], chosen[k:], rejected[k:]
            if not prompt:
                raise DataError(f"{where}: chosen and rejected share no prompt turns")
        if len(chosen) != 1 or len(rejected) != 1:
            raise DataError(
                f"{where}: chosen / rejected must each be one assistant reply after the shared "
                f"prompt; got {len(chosen)} and {len(rejected)} messages"
            )
        out["chosen"] = _final_reply(chosen, where, "chosen")
        out["rejected"] = _final_reply(rejected, where, "rejected")
    elif isinstance(chosen, str) and isinstance(rejected, str):
        prompt = row["prompt"]
        out["chosen"], out["rejected"] = chosen, rejected
    else:
        raise _missing(row, where, "preference", layouts)
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if not _is_messages(prompt):
        raise DataError(f"{where}: prompt is neither text nor chat messages: {str(prompt)[:80]}")
    if not out["chosen"].strip() or not out["rejected"].strip():
        raise DataError(f"{where}: chosen or rejected is empty")
    if out["chosen"] == out["rejected"]:
        raise DataError(f"{where}: chosen equals rejected (no preference to learn)")
    out = {"prompt": prompt, **out}
    if isinstance(row.get("margin"), int | float):
        out["margin"] = float(row["margin"])
    elif all(isinstance(row.get(k), int | float) for k in ("score_chosen", "score_rejected")):
        out["margin"] = float(row["score_chosen"]) - float(row["score_rejected"])
    return out


# ----------------------------------------------------------------------------------- sft
def sft_row(row: dict, where: str) -> dict:
    if _is_messages(row.get("messages")):
        messages = list(row["messages"])
    elif isinstance(row.get("conversations"), list):
        messages = sharegpt_messages(row["conversations"], where)
    elif isinstance(row.get("prompt"), str | list) and isinstance(
        row.get("completion", row.get("response")), str | list
    ):
        prompt = row["prompt"]
        reply = row.get("completion", row.get("response"))
        messages = prompt if _is_messages(prompt) else [{"role": "user", "content": prompt}]
        messages = messages + (
            reply if _is_messages(reply) else [{"role": "assistant", "content": reply}]
        )
    elif isinstance(row.get("instruction"), str) and isinstance(row.get("output"), str):
        user = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
        messages = [
            {"role": "user", "content": user},
            {"role": "assistant", "content": row["output"]},
        ]
    else:
        raise _missing(
            row,
            where,
            "sft",
            [
                "messages",
                "conversations (ShareGPT)",
                "prompt + completion",
                "prompt + response",
                "instruction (+ input) + output (Alpaca)",
            ],
        )
    if not any(m["role"] == "assistant" and str(m["content"]).strip() for m in messages):
        raise DataError(f"{where}: no non-empty assistant turn to train on")
    return {"messages": messages}


FORMATS: dict[str, Callable[[dict, str], dict]] = {
    "gsm8k": gsm8k_row,
    "math": math_row,
    "preference": preference_row,
    "sft": sft_row,
}


def prepare(fmt: str, src: str, out: str, *, limit: int | None = None) -> int:
    """Convert every row of `src` with format `fmt`; write `out` (jsonl) atomically; rows."""
    if fmt not in FORMATS:
        raise DataError(f"format {fmt!r}; accepted: {sorted(FORMATS)}")
    rows = load_rows(src)
    if limit is not None:
        rows = rows[:limit]
    convert = FORMATS[fmt]
    converted = [convert(row, f"row {i} of {src}") for i, row in enumerate(rows)]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{out}.tmp"
    with open(tmp, "w") as f:
        for row in converted:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, out)
    return len(converted)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="megarl prepare-data",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("format", choices=sorted(FORMATS))
    p.add_argument("--in", dest="src", required=True, metavar="PATH", help="local file or dir")
    p.add_argument("--out", required=True, metavar="FILE.jsonl", help="where to write the rows")
    p.add_argument("--limit", type=int, metavar="N", help="only the first N rows")
    p.add_argument("--debug", action="store_true", help="tracebacks for input errors too")
    args = p.parse_args(argv)
    console.setup(verbose=False)

    def go() -> int:
        n = prepare(args.format, args.src, args.out, limit=args.limit)
        print(f"megarl: wrote {n} {args.format} rows to {args.out}")
        return 0

    return console.run_guarded(go, debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
