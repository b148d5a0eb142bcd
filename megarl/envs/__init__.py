"""Environments for multi-turn rollouts: the interface (`base`), the `env` config section
(`config`), loading by name (`registry`), the built-ins `retry` and `tools`, and tool-call
parsing and running (`tool_calls`). Importing this package imports neither torch nor vLLM."""

from megarl.envs.base import AssistantTurn, Environment, Observation, ToolCall

__all__ = ["AssistantTurn", "Environment", "Observation", "ToolCall"]
