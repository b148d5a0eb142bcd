"""A judge model as a reward: its prompts from `reward.judge.template`, its score parsed from the
answer by `reward.judge.parse`.

`Judge.judge(prompts, responses, columns, conversations)` renders one judge prompt per sample,
tokenizes it (in the judge tokenizer's chat template with `reward.judge.chat`), generates through
the `generate` callable it was given (the judge's vLLM engine, `megarl.rollout.judge`), decodes and
parses. An answer the pattern does not match, or one unfinished at `reward.judge.timeout_s`,
scores `reward.judge.on_parse_error` and is counted. Nothing here knows vLLM.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megarl.errors import ConfigError
from megarl.rewards.config import JudgeConfig

OWN_FIELDS = ("prompt", "response", "conversation")
"""Template fields every sample has; the others are the dataset's columns."""


def conversation_text(messages: list[dict]) -> str:
    """A trajectory's messages as the judge reads them: one 'role: content' line each."""
    return "\n".join(f"{m.get('role', '?')}: {m.get('content') or ''}" for m in messages)


def parse_score(text: str, pattern: re.Pattern) -> float | None:
    """The number in `pattern`'s last match in `text` (its group 1, or the whole match without
    a group); None where it does not match or the match is not a finite number."""
    matches = list(pattern.finditer(text))
    if not matches:
        return None
    last = matches[-1]
    try:
        value = float(last.group(1) if pattern.groups else last.group(0))
    except ValueError:
        return None
    return value if abs(value) != float("inf") and value == value else None


@dataclass
class Verdicts:
    """What judging B samples gives."""

    scores: torch.Tensor
    """[B] float32: the parsed scores, `on_parse_error` where none was parsed."""
    parsed: torch.Tensor
    """[B] bool: a score was parsed from the answer."""
    timed_out: torch.Tensor
    """[B] bool: the answer was unfinished at the time limit."""
    prompts: list[str]
    """The judge's prompts as rendered from the template (before the chat template)."""
    answers: list[str]
    """The judge's decoded answers."""


Generate = Callable[[list[list[int]], float], tuple[list[list[int]], list[bool]]]
"""(prompt token ids, seconds allowed) -> (answer token ids, finished in time) per prompt."""


class Judge:
    """Scores samples with a judge model (module docstring)."""

    def __init__(self, cfg: JudgeConfig, tokenizer, generate: Generate):
        """tokenizer: the judge's (HF); generate: its engine (`Generate`)."""
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.generate = generate
        self.pattern = re.compile(cfg.parse)

    def check_columns(self, columns) -> None:
        """Refuse a template field that is neither the sample's own nor a dataset column."""
        known = set(OWN_FIELDS) | set(columns)
        unknown = [f for f in self.cfg.fields() if f not in known]
        if unknown:
            raise ConfigError(
                f"reward.judge.template uses {unknown}, which the data does not have; accepted: "
                f"{sorted(known)}"
            )

    def render(self, values: dict) -> str:
        """The judge's prompt for one sample (`values`: every template field)."""
        return self.cfg.template.format_map(values)

    def prompt_ids(self, text: str) -> list[int]:
        """`text` tokenized for the judge, as one chat user turn with `reward.judge.chat`."""
        tok = self.tokenizer
        if self.cfg.chat and getattr(tok, "chat_template", None):
            messages = [{"role": "user", "content": text}]
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return list(tok(text, add_special_tokens=False)["input_ids"])  # BOS: the template's
        return list(tok(text, add_special_tokens=True)["input_ids"])

    def judge(
        self,
        prompts: list,
        responses: list[str],
        columns: dict[str, list],
        conversations: list[list[dict]] | None = None,
    ) -> Verdicts:
        """Verdicts on B samples: `prompts[i]` (text, or a chat dataset's messages) /
        `responses[i]` (text), `columns` ({name: [B]}
        the dataset's columns of each sample's prompt), `conversations` (multi-turn: each
        sample's messages)."""
        self.check_columns(columns)
        texts = []
        for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
            values = {k: v[i] for k, v in columns.items()}
            # a chat dataset's prompt is its messages
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            values["prompt"] = prompt if isinstance(prompt, str) else conversation_text(prompt)
            values["response"] = response
            if conversations is not None:
                values["conversation"] = conversation_text(conversations[i])
            else:
                answer = {"role": "assistant", "content": response}
                values["conversation"] = conversation_text([*messages, answer])
            texts.append(self.render(values))
        ids, finished = self.generate([self.prompt_ids(t) for t in texts], self.cfg.timeout_s)
        answers = [self.tokenizer.decode(a, skip_special_tokens=True) for a in ids]
        parsed = [
            parse_score(a, self.pattern) if done else None
            for a, done in zip(answers, finished, strict=True)
        ]
        scores = torch.tensor(
            [self.cfg.on_parse_error if s is None else s for s in parsed], dtype=torch.float32
        )
        return Verdicts(
            scores=scores,
            parsed=torch.tensor([s is not None for s in parsed]),
            timed_out=torch.tensor([not f for f in finished]),
            prompts=texts,
            answers=answers,
        )
