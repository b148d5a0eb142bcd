"""Offline training data: SFT rows and preference pairs, tokenized once and checked before any
model is built.

Row forms (rows come from `megarl.data.dataset.load_rows`: jsonl / json / parquet files, a
directory of them, or `hf:` datasets; the prompt column is `data.prompt_key`, the others have
fixed names):
- SFT (`read_sft`): `prompt` + `response`, or `messages`, a chat conversation whose assistant
  turns are all trained on.
- Preferences (`read_preferences`, one reader for every pairwise stage): `prompt` + `chosen` +
  `rejected`; or TRL's implicit-prompt form, `chosen` and `rejected` alone, each a whole
  conversation, the longest common prefix of their messages being the prompt. An optional
  numeric `margin` column is kept per pair.
A prompt is a string or chat messages, as for the RL prompt datasets; a response (chosen,
rejected) is a string or a list of messages that continue the prompt.

How a row becomes tokens (`Tokens`: ids and which of them are trained):
- A string response: the prompt's ids exactly as an RL prompt dataset makes them
  (`megarl.data.dataset.prompt_text`: the chat template with the generation prompt), then the
  response tokenized on its own and the tokenizer's EOS: what generation produces (the prompt's
  ids, then tokens up to the EOS), so a later RL run continues from the same distribution.
- A conversation: rendered with the chat template once whole, and for each trained assistant
  turn once up to it (with the generation prompt) and once through it. Most templates,
  SmolLM2's included, mark no generation spans, so the turn is the difference of the two
  renderings; a template whose rendering of a prefix is not the start of the next one cannot
  place the turn, and the row is refused. The untrained and trained pieces are tokenized one by
  one (no special tokens added: the template holds them); tokens after the last trained turn
  are dropped (in a causal model they change no loss).
Too long (`data.max_length`, prompt + response): `data.overlong` says error, drop the row (the
pair), or truncate-left (keep the last max_length tokens). Every problem raises `DataError`
naming the row and its source.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from megarl.data.batch import collate_sequences
from megarl.data.dataset import DataConfig, DataError, prompt_messages, prompt_text

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

RESPONSE, MESSAGES = "response", "messages"
CHOSEN, REJECTED, MARGIN = "chosen", "rejected", "margin"


@dataclass(frozen=True)
class Tokens:
    """One training sequence: token ids, and per token whether it is a training target."""

    ids: list[int]
    trained: list[bool]


class _Encoder:
    """Turns prompts, responses and conversations into `Tokens` (see the module docstring)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig):
        self.tok, self.cfg = tokenizer, cfg
        self.template = cfg.apply_chat_template and getattr(tokenizer, "chat_template", None)
        self.eos = tokenizer.eos_token_id

    def _ids(self, text: str, *, special: bool = False) -> list[int]:
        return list(self.tok(text, add_special_tokens=special)["input_ids"]) if text else []

    def completion(self, prompt: Any, response: str, where: str) -> Tokens:
        text, special = prompt_text(prompt, self.tok, self.cfg, where)
        p = self._ids(text, special=special)
        if not p:
            raise DataError(f"{where}: the prompt tokenizes to no tokens")
        r = self._ids(response)
        if self.eos is not None and (not r or r[-1] != self.eos):
            r.append(self.eos)
        return Tokens(p + r, [False] * len(p) + [True] * len(r))

    def conversation(self, messages: list[dict], train_from: int, where: str, what: str) -> Tokens:
        """Tokens of `messages`, trained on its assistant turns from index `train_from` on."""
        if not self.template:
            why = (
                "data.apply_chat_template is off"
                if not self.cfg.apply_chat_template
                else "the tokenizer has no chat template"
            )
            raise DataError(
                f"{where}: {what} is a chat conversation but {why}; accepted: a tokenizer with a "
                "chat template, or prompt + response strings"
            )
        if self.cfg.system_prompt is not None and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": self.cfg.system_prompt}, *messages]
            train_from += 1

        def render(msgs: list[dict], generation: bool) -> str:
            try:
                return self.tok.apply_chat_template(
                    msgs, tokenize=False, add_generation_prompt=generation
                )
            except Exception as err:  # jinja errors of a template that refuses a prefix
                raise DataError(
                    f"{where}: the chat template cannot render the first {len(msgs)} messages "
                    f"of {what}: {err}"
                ) from err

        full = render(messages, False)
        spans: list[tuple[int, int]] = []
        for i in range(train_from, len(messages)):
            if messages[i].get("role") != "assistant":
                continue
            start = render(messages[:i], True) if i else ""
            end = render(messages[: i + 1], False)
            if (
                not end.startswith(start)
                or not full.startswith(end)
                or len(end) == len(start)
                or (spans and len(start) < spans[-1][1])
            ):
                raise DataError(
                    f"{where}: the chat template cannot place assistant turn {i} of {what}: its "
                    "rendering of the conversation up to that turn is not the start of the "
                    "rendering through it (the template changes earlier text as turns are "
                    "added); accepted: a template that renders conversations prefix by prefix, "
                    "or prompt + response strings"
                )
            spans.append((len(start), len(end)))
        if not spans:
            raise DataError(f"{where}: {what} has no assistant turn to train on")
        ids: list[int] = []
        trained: list[bool] = []
        pos = 0
        for a, b in spans:
            for text, flag in ((full[pos:a], False), (full[a:b], True)):
                piece = self._ids(text)
                ids += piece
                trained += [flag] * len(piece)
            pos = b
        if not any(trained[1:]):
            raise DataError(f"{where}: {what} has no assistant token after the first token")
        return Tokens(ids, trained)


def _check_messages(value: Any, where: str, column: str) -> list[dict]:
    if not (
        isinstance(value, list)
        and value
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    ):
        raise DataError(
            f"{where}: column {column!r} must be a non-empty list of chat messages "
            f"({{'role': ..., 'content': ...}}), got {_describe(value)}"
        )
    return value


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _present(row: dict, key: str, where: str, accepted: str) -> Any:
    """row[key], refused when absent or empty."""
    if key not in row or row[key] is None:
        raise DataError(
            f"{where}: column {key!r} is missing; {accepted} (columns present: {sorted(row)})"
        )
    value = row[key]
    if (isinstance(value, (str, list)) and not value) or (
        isinstance(value, str) and not value.strip()
    ):
        raise DataError(f"{where}: column {key!r} is empty; {accepted}")
    return value


def _response(
    enc: _Encoder, prompt: Any, response: Any, where: str, column: str, cfg: DataConfig
) -> Tokens:
    """Prompt + a string response, or prompt messages continued by response messages."""
    if isinstance(response, str):
        return enc.completion(prompt, response, where)
    turns = _check_messages(response, where, column)
    head = prompt_messages(prompt, None, where)
    return enc.conversation(head + turns, len(head), where, f"{cfg.prompt_key} + {column}")


def _fit(t: Tokens, limit: int, overlong: str, where: str, what: str) -> Tokens | None:
    """`t` within `limit` tokens per `data.overlong` (None: drop the row)."""
    if len(t.ids) <= limit:
        return t
    if overlong == "error":
        raise DataError(
            f"{where}: {what} is {len(t.ids)} tokens, longer than data.max_length={limit} (set "
            "data.overlong to 'drop' or 'truncate-left', or raise data.max_length)"
        )
    if overlong == "drop":
        return None
    return Tokens(t.ids[-limit:], t.trained[-limit:])


class SFTDataset:
    """SFT sequences by row: `sequences[i]` (`Tokens`), `source_rows[i]` (the row's index in
    the input), `num_dropped`, `num_truncated` (rows of the input; 0 in a `subset`)."""

    def __init__(self, sequences: list[Tokens], source_rows: list[int], source: str, stats):
        self.sequences, self.source_rows, self.source = sequences, source_rows, source
        self.num_dropped, self.num_truncated = stats

    def __len__(self) -> int:
        return len(self.sequences)

    def subset(self, indices: list[int]) -> SFTDataset:
        return SFTDataset(
            [self.sequences[i] for i in indices],
            [self.source_rows[i] for i in indices],
            self.source,
            (0, 0),
        )

    def batch(self, indices: list[int], *, pad_id: int, pad_to: int = 1) -> dict:
        """The collated sequences at `indices` (`megarl.data.batch.collate_sequences`)."""
        seqs = [self.sequences[i] for i in indices]
        return collate_sequences(
            [s.ids for s in seqs], [s.trained for s in seqs], pad_id, pad_to_multiple=pad_to
        )


class PreferenceDataset:
    """Preference pairs: `chosen[i]`, `rejected[i]` (`Tokens`, trained on the response only),
    `margins[i]` (float, or None when the source has no margin column), `source_rows[i]`."""

    def __init__(self, chosen, rejected, margins, source_rows, source: str, stats):
        self.chosen, self.rejected, self.margins = chosen, rejected, margins
        self.source_rows, self.source = source_rows, source
        self.num_dropped, self.num_truncated = stats

    def __len__(self) -> int:
        return len(self.chosen)

    def subset(self, indices: list[int]) -> PreferenceDataset:
        return PreferenceDataset(
            [self.chosen[i] for i in indices],
            [self.rejected[i] for i in indices],
            [self.margins[i] for i in indices],
            [self.source_rows[i] for i in indices],
            self.source,
            (0, 0),
        )

    def batch(self, indices: list[int], *, pad_id: int, pad_to: int = 1) -> dict:
        """The pairs at `indices` as 2P rows, chosen then rejected per pair: the collated
        fields plus `pair` [2P] (the pair's position in `indices`, for
        `split_micro_batches(together=...)`) and, when the source has them, `margin` [2P]."""
        seqs = [s for i in indices for s in (self.chosen[i], self.rejected[i])]
        out = collate_sequences(
            [s.ids for s in seqs], [s.trained for s in seqs], pad_id, pad_to_multiple=pad_to
        )
        out["pair"] = torch.arange(len(indices)).repeat_interleave(2)
        if self.margins and self.margins[0] is not None:
            m = torch.tensor([self.margins[i] for i in indices], dtype=torch.float32)
            out["margin"] = m.repeat_interleave(2)
        return out


def read_sft(
    rows: list[dict], tokenizer, cfg: DataConfig, *, max_length: int, source: str
) -> SFTDataset:
    enc = _Encoder(tokenizer, cfg)
    key = cfg.prompt_key
    accepted = f"an sft row holds {key!r} + {RESPONSE!r}, or {MESSAGES!r}"
    seqs, kept, dropped, truncated = [], [], 0, 0
    for i, row in enumerate(rows):
        where = f"row {i} of {source}"
        if MESSAGES in row and key not in row:
            msgs = _check_messages(_present(row, MESSAGES, where, accepted), where, MESSAGES)
            t = enc.conversation(msgs, 0, where, MESSAGES)
        elif key in row or RESPONSE in row:
            prompt = _present(row, key, where, accepted)
            response = _present(row, RESPONSE, where, accepted)
            t = _response(enc, prompt, response, where, RESPONSE, cfg)
        else:
            raise DataError(f"{where}: {accepted}; columns present: {sorted(row)}")
        fitted = _fit(t, max_length, cfg.overlong, where, "prompt + response")
        if fitted is None:
            dropped += 1
            continue
        truncated += fitted is not t
        seqs.append(fitted)
        kept.append(i)
    if not seqs:
        raise DataError(f"every row of {source} is longer than data.max_length={max_length}")
    return SFTDataset(seqs, kept, source, (dropped, truncated))


def read_preferences(
    rows: list[dict], tokenizer, cfg: DataConfig, *, max_length: int, source: str
) -> PreferenceDataset:
    enc = _Encoder(tokenizer, cfg)
    key = cfg.prompt_key
    accepted = (
        f"a preference row holds {key!r} + {CHOSEN!r} + {REJECTED!r}, or {CHOSEN!r} and "
        f"{REJECTED!r} as whole conversations sharing their prompt"
    )
    chosen, rejected, margins, kept, dropped, truncated = [], [], [], [], 0, 0
    for i, row in enumerate(rows):
        where = f"row {i} of {source}"
        c_val = _present(row, CHOSEN, where, accepted)
        r_val = _present(row, REJECTED, where, accepted)
        if c_val == r_val:
            raise DataError(f"{where}: {CHOSEN!r} equals {REJECTED!r}; a pair needs two answers")
        if row.get(key) is not None:
            prompt = _present(row, key, where, accepted)
            c = _response(enc, prompt, c_val, where, CHOSEN, cfg)
            r = _response(enc, prompt, r_val, where, REJECTED, cfg)
        else:
            if not (isinstance(c_val, list) and isinstance(r_val, list)):
                raise DataError(
                    f"{where}: no {key!r} column, so {CHOSEN!r} and {REJECTED!r} must be whole "
                    f"conversations (lists of chat messages) sharing their prompt; got "
                    f"{_describe(c_val)}; {accepted}"
                )
            c_msgs = _check_messages(c_val, where, CHOSEN)
            r_msgs = _check_messages(r_val, where, REJECTED)
            k = 0
            while k < min(len(c_msgs), len(r_msgs)) and c_msgs[k] == r_msgs[k]:
                k += 1
            if k == 0 or k == len(c_msgs) or k == len(r_msgs):
                raise DataError(
                    f"{where}: no {key!r} column, and {CHOSEN!r} / {REJECTED!r} do not share a "
                    f"prompt ({k} common leading messages; each must continue past it); "
                    f"{accepted}"
                )
            c = enc.conversation(c_msgs, k, where, CHOSEN)
            r = enc.conversation(r_msgs, k, where, REJECTED)
        if c == r:
            raise DataError(f"{where}: {CHOSEN!r} and {REJECTED!r} tokenize to the same ids")
        margin = row.get(MARGIN)
        if isinstance(margin, bool) or not isinstance(margin, (int, float, type(None))):
            raise DataError(f"{where}: column {MARGIN!r} must be a number, got {_describe(margin)}")
        c_fit = _fit(c, max_length, cfg.overlong, where, f"prompt + {CHOSEN}")
        r_fit = _fit(r, max_length, cfg.overlong, where, f"prompt + {REJECTED}")
        if c_fit is None or r_fit is None:
            dropped += 1
            continue
        truncated += (c_fit is not c) or (r_fit is not r)
        chosen.append(c_fit)
        rejected.append(r_fit)
        margins.append(None if margin is None else float(margin))
        kept.append(i)
    if not chosen:
        raise DataError(f"every pair of {source} is longer than data.max_length={max_length}")
    if any(m is None for m in margins) and any(m is not None for m in margins):
        first = margins.index(None)
        raise DataError(
            f"row {kept[first]} of {source}: no {MARGIN!r} while other rows have one; give "
            "every row a margin or none"
        )
    return PreferenceDataset(chosen, rejected, margins, kept, source, (dropped, truncated))


def split_held_out(rows: list, fraction: float, seed: int) -> tuple[list, list]:
    """(training rows, held-out rows): a seeded `fraction` of `rows` (at least one, and at least
    one left to train on) held out; both keep the input order."""
    n = len(rows)
    count = min(max(1, round(fraction * n)), n - 1)
    if count < 1:
        raise DataError(f"eval.fraction={fraction} of {n} rows leaves no row to train on")
    held = set(random.Random(seed).sample(range(n), count))
    train = [r for i, r in enumerate(rows) if i not in held]
    return train, [r for i, r in enumerate(rows) if i in held]
