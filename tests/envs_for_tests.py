"""Environments used by the multi-turn tests (loaded by dotted path, like a user's).

They speak the toy task's alphabet (`megarl.data.toy.TOY_CHARS`), so the character tokenizer
encodes every message they send."""

from __future__ import annotations

import threading

from megarl.envs import Environment, Observation

SLEPT = threading.Event()
"""Set when a `Faulty` "sleep" step ends (after 30 s): still unset when the rollout returned,
the rollout did not wait for it."""
SLOW_GO = threading.Event()
"""`SlowFirst`'s slow rows stay in their first step until this is set (or `delay` passes)."""
SLOW_RELEASED: list[bool] = []
"""Per slow first step: True if `SLOW_GO` ended it (not its `delay`)."""


class CopyAgain(Environment):
    """The toy copy task with retries: a wrong copy is answered with the prompt again
    (`again`, formatted with the row's answer). Each step's info counts one tool call, and one
    tool error for a wrong copy (so the trajectory metrics have values to check)."""

    def __init__(self, again: str = " copy {answer}"):
        self.again = again

    def reset(self, messages, row, seed):
        self.answer = row["answer"]
        self.seed = seed
        return messages

    def step(self, turn):
        # counts to log (the trajectory's sums are rollout/tool_calls, rollout/tool_errors): one
        # "call" per step, an "error" per wrong copy
        if turn.content.strip() == self.answer:
            return Observation(reward=1.0, done=True, info={"tool_calls": 1, "tool_errors": 0})
        return Observation(
            messages=[{"role": "user", "content": self.again.format(answer=self.answer)}],
            reward=0.0,
            info={"tool_calls": 1, "tool_errors": 1},
        )


class Faulty(CopyAgain):
    """CopyAgain, but the row's `fault` column picks a failure: "raise" in step, "sleep" past
    any reasonable timeout in step, "reset" raises in reset, "garbage" returns no Observation."""

    def reset(self, messages, row, seed):
        self.fault = row.get("fault")
        if self.fault == "reset":
            raise RuntimeError("cannot start")
        return super().reset(messages, row, seed)

    def step(self, turn):
        if self.fault == "raise":
            raise ValueError("the environment broke")
        if self.fault == "sleep":
            threading.Event().wait(30)
            SLEPT.set()
        if self.fault == "garbage":
            return {"messages": []}
        return super().step(turn)


class Unreachable(CopyAgain):
    """Cannot be built: its constructor raises, as an environment whose tool server the host
    it is built on cannot reach."""

    def __init__(self, again: str = " copy {answer}"):
        raise ConnectionError("no tool server at tools.invalid:8080 from this host")


class SlowFirst(CopyAgain):
    """CopyAgain whose first step, on rows with `slow` set (a slow tool), waits until the test
    sets `SLOW_GO` or `delay` seconds pass: the other trajectories must not wait for it."""

    def __init__(self, delay: float = 2.0):
        super().__init__()
        self.delay = delay

    def step(self, turn):
        if self.row_slow and turn.index == 0:
            SLOW_RELEASED.append(SLOW_GO.wait(self.delay))
        return super().step(turn)

    def reset(self, messages, row, seed):
        self.row_slow = bool(row.get("slow"))
        return super().reset(messages, row, seed)


class NotAnEnvironment:
    """Has no step(): refused by name before any model is built."""


def copy_agent(row, base_url, seed):
    """CopyAgain as an agent (`env.agent`): an OpenAI client asks for the copy, answers a wrong
    one with the prompt again, up to three turns; reward 1 for a right copy."""
    import openai  # noqa: PLC0415 - deferred: only the agent tests need the client

    client = openai.OpenAI(base_url=base_url, api_key="unused")
    messages = list(row["messages"])
    for _ in range(3):
        out = client.chat.completions.create(
            model="policy", messages=messages, seed=seed, max_tokens=6
        )
        said = out.choices[0].message.content
        if said.strip() == row["answer"]:
            return 1.0
        messages += [
            {"role": "assistant", "content": said},
            {"role": "user", "content": f" copy {row['answer']}="},
        ]
    return 0.0
