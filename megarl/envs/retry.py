"""The `retry` environment: a wrong answer gets fixed feedback and another attempt.

The answer is the row's `answer_key` column; a turn is right when the last number in it equals
that answer exactly as a rational number (`last_number`: "1,000" is 1000, "1/2" equals "0.5",
"-3" is negative but the "3" of "5-3" is not). This is simpler than `math_verify` (no LaTeX
beyond the digits, no expressions, no tolerance: "0.333" is not "1/3") and needs no optional
package; the reward function `last_number` is the same check. Attempts are bounded by the
rollout's `env.max_turns`, not here.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from megarl.envs.base import AssistantTurn, Environment, Observation
from megarl.rewards.builtins import last_number

__all__ = ["RetryEnv", "last_number", "row_answer"]


def row_answer(row: dict[str, Any], key: str, env: str) -> Fraction:
    """The number in the data row's column `key` (`last_number`). Raises KeyError naming the
    column and the row's columns when it is missing, ValueError when it holds no number; `env`
    names the environment in the message."""
    if key not in row:
        raise KeyError(
            f"{env} environment: the data row has no column {key!r} (env.kwargs.answer_key); "
            f"its columns: {sorted(row)}"
        )
    answer = last_number(str(row[key]))
    if answer is None:
        raise ValueError(
            f"{env} environment: column {key!r} holds {row[key]!r}, which has no number to "
            "compare the model's answer with"
        )
    return answer


class RetryEnv(Environment):
    """Right answer: `reward`, done. Wrong: reward 0 and a user message `feedback`."""

    def __init__(
        self,
        feedback: str = "That is not correct. Try again.",
        answer_key: str = "answer",
        reward: float = 1.0,
    ):
        self.feedback = feedback
        self.answer_key = answer_key
        self.reward = float(reward)
        self.answer: Fraction | None = None

    def reset(self, messages: list[dict], row: dict[str, Any], seed: int) -> list[dict]:
        """Remembers the row's answer; the conversation is unchanged. Raises KeyError when the
        row has no `answer_key` column and ValueError when its value holds no number."""
        self.answer = row_answer(row, self.answer_key, "retry")
        return messages

    def step(self, turn: AssistantTurn) -> Observation:
        """Done with `reward` when the turn's last number is the answer; else the feedback."""
        if self.answer is None:
            raise RuntimeError("retry environment: step() before reset()")
        if last_number(turn.content) == self.answer:
            return Observation(reward=self.reward, done=True)
        return Observation(messages=[{"role": "user", "content": self.feedback}], reward=0.0)
