"""What an environment is: the other side of a multi-turn trajectory.

megarl makes one environment object per trajectory (`cls(**env.kwargs)`), from a registry name
(`retry`, `tools`), a dotted path `package.module:Class` or a file `path/to/file.py:Class`
(`megarl.envs.registry`). The rollout then calls, from a worker thread of its own:

    messages = env.reset(messages, row, seed)    # the conversation the model starts from
    obs = env.step(turn)                         # after every assistant turn
    ...                                          # until obs.done, max_turns or the token budget

`row` is the data row (its prompt and every other column, as reward functions get them);
`seed` is the trajectory's own (fixed by the step's seed and the sample's place in the global
batch), so a resumed run's environments replay a straight run's. `turn` is what the model just
said: its text, and the tool calls the run's tool parser found in it. `obs` holds the messages
to append (role "user" or "tool"), an optional reward for this turn and whether the
trajectory is over. The trajectory's environment reward is the sum of its turns' rewards (None
when the environment gave none), weighted by `reward.env_weight` beside the reward functions
(which score the final answer) and the reward model (which scores the whole trajectory).

An environment declares tools by setting `tools` (OpenAI function schemas, e.g. from
`megarl.envs.tool_calls.tool_schema(fn)`): they are rendered into the prompt through the
tokenizer's chat template (or, for a template without tool support, a system message) and
the model's calls are parsed by vLLM's tool parser named by `env.tool_parser`.

An environment that raises, or whose call runs past `env.timeout_s`, ends its trajectory
(finish reason `env_error`, environment reward 0); the run goes on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    """One call the model made, as the tool parser read it."""

    name: str
    arguments: dict
    """The call's arguments, parsed from the model's JSON."""
    id: str = ""


@dataclass(frozen=True)
class AssistantTurn:
    """What the model said in one turn."""

    text: str
    """The turn's text as sampled (special tokens dropped), tool-call markup included."""
    content: str
    """The text without the tool calls (the parser's `content`; == text when there are none)."""
    tool_calls: tuple[ToolCall, ...] = ()
    malformed: str | None = None
    """Why a tool call could not be read (the model began one the parser could not parse);
    None when every call parsed or there was none."""
    index: int = 0
    """0 for the first assistant turn of the trajectory, 1 for the next, ..."""


@dataclass
class Observation:
    """The environment's answer to one assistant turn."""

    messages: list[dict] = field(default_factory=list)
    """Messages appended to the conversation: {"role": "user" | "tool", "content": str}; a
    tool message may carry "tool_call_id" and "name"."""
    reward: float | None = None
    """This turn's reward (None: none)."""
    done: bool = False
    """The trajectory is over (its messages, if any, are not shown to the model)."""
    info: dict[str, float] = field(default_factory=dict)
    """Counts to log, summed over the turns: e.g. {"tool_calls": 2, "tool_errors": 1}."""


class Environment:
    """The base class of an environment (a class with these methods is enough)."""

    tools: list[dict] | None = None
    """OpenAI function schemas of the tools the model may call; None = no tools."""

    def reset(self, messages: list[dict], row: dict[str, Any], seed: int) -> list[dict]:
        """The conversation the first turn is sampled from; `messages` is the data row's prompt
        as chat messages (the data's `system_prompt` first, if set). Default: unchanged."""
        return messages

    def step(self, turn: AssistantTurn) -> Observation:
        """The answer to the model's turn."""
        raise NotImplementedError
