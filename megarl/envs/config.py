"""The `env` section: multi-turn trajectories with an environment (or an agent) in the loop.

`env.name` null (the default) keeps the one-prompt, one-response rollout. Otherwise every
sample is a trajectory of up to `max_turns` assistant turns, each answered by the environment
(`megarl.envs.base`), or, with `env.agent`, a function that drives the model through an
OpenAI-compatible endpoint. This module imports neither torch nor vLLM (`megarl.config` imports
it at module level).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megarl.errors import ConfigError

SCHEDULERS = ("waves", "stream")
ON_TOOL_ERROR = ("message", "end")


@dataclass(frozen=True, kw_only=True)
class EnvConfig:
    name: str | None = None
    """The environment: a built-in (retry, tools), 'package.module:Class' or
    'path/to/file.py:Class'; null = single-turn rollout."""
    kwargs: dict = field(default_factory=dict)
    """Keyword arguments of the environment's constructor (one object per trajectory)."""
    agent: str | None = None
    """Instead of an environment: a function 'package.module:fn' (or 'file.py:fn') called as
    fn(row, base_url, seed) -> reward | None once per trajectory, that talks to the policy
    through the OpenAI-compatible endpoint at base_url (/v1/chat/completions, tools included)."""
    max_turns: int = 4
    """Most assistant turns per trajectory (finish reason max_turns when the environment is
    not done by then)."""
    max_tokens: int = 1024
    """Token budget per trajectory: response tokens (sampled and observation) after the
    prompt; a turn samples at most min(rollout.sampling.max_tokens, what is left)."""
    timeout_s: float = 60.0
    """Longest an environment call (reset, step) or an agent run may take; past it the
    trajectory ends with finish reason env_error and environment reward 0."""
    tool_parser: str = "hermes"
    """vLLM tool parser that reads the model's tool calls (vllm.tool_parsers: hermes,
    llama3_json, mistral, pythonic, ...)."""
    tool_timeout_s: float = 10.0
    """Longest a single tool call may run (tools environment)."""
    on_tool_error: str = "message"
    """A malformed call or a raising / timed-out tool: message (the error goes back to the
    model as the tool's answer) or end (the trajectory ends, finish reason env_error)."""
    scheduler: str = "waves"
    """How the turns of many trajectories share the engine: waves (one generate call per wave
    of turns; the same batches whatever the threads' timing, megarl.rollout.multi_turn.waves) or
    stream
    (vLLM's continuous batching: a turn starts as soon as its environment answered, the batches
    depend on timing; rollout.engine.tensor_parallel=1 only, megarl.rollout.multi_turn.stream)."""
    wave_wait_s: float = 0.5
    """How long a generation wave waits for environments still stepping before it starts
    without them (they join a later wave): a slow tool never stalls the others for longer."""

    def __post_init__(self):
        if self.name is not None and self.agent is not None:
            raise ConfigError(
                f"env.name={self.name!r} and env.agent={self.agent!r}; accepted: one of them"
            )
        checks = [
            (self.max_turns >= 1, "max_turns", self.max_turns, ">= 1"),
            (self.max_tokens >= 1, "max_tokens", self.max_tokens, ">= 1"),
            (self.timeout_s > 0, "timeout_s", self.timeout_s, "> 0"),
            (self.tool_timeout_s > 0, "tool_timeout_s", self.tool_timeout_s, "> 0"),
            (self.wave_wait_s >= 0, "wave_wait_s", self.wave_wait_s, ">= 0"),
            (self.scheduler in SCHEDULERS, "scheduler", self.scheduler, " or ".join(SCHEDULERS)),
            (
                self.on_tool_error in ON_TOOL_ERROR,
                "on_tool_error",
                self.on_tool_error,
                " or ".join(ON_TOOL_ERROR),
            ),
        ]
        for ok, key, value, accepted in checks:
            if not ok:
                raise ConfigError(f"env.{key}={value!r}; accepted: {accepted}")

    @property
    def multi_turn(self) -> bool:
        """Whether samples are trajectories (an environment or an agent is set)."""
        return self.name is not None or self.agent is not None
