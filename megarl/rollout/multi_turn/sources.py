"""What trajectories start from and what drives them: `trajectory_items` (a prompt's chat
messages, its dataset row and its token ids) and `EnvTrajectories` (an environment of `env.name`
per trajectory, its chat format and tool parser, loaded and checked once).
"""

from __future__ import annotations

from megarl.data.dataset import prompt_messages
from megarl.envs.config import EnvConfig
from megarl.envs.registry import environment_factory
from megarl.envs.tool_calls import ToolCallParser
from megarl.rollout.multi_turn.chat_format import ChatFormat
from megarl.rollout.multi_turn.trajectory import EnvTrajectory, TurnLimits


def trajectory_items(prompts, system_prompt: str | None) -> list[dict]:
    """What a trajectory starts from, per prompt of `prompts` (a `PromptBatch`): its chat
    messages, its dataset row (the environment's `reset` reads it) and its token ids."""
    return [
        {
            "messages": prompt_messages(p, system_prompt, "prompt"),
            "row": {"prompt": p, **{k: v[i] for k, v in prompts.columns.items()}},
            "prompt_ids": prompts.prompt_ids[i],
        }
        for i, p in enumerate(prompts.prompts)
    ]


class EnvTrajectories:
    """Trajectories with an environment of `env.name`. Building one checks the setup: one
    environment is made now (a bad name, class or kwargs fails here), then the chat format and,
    when the environment declares tools, vLLM's tool parser `env.tool_parser`."""

    def __init__(self, cfg: EnvConfig, tokenizer):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.make_env = environment_factory(cfg)
        tools = getattr(self.make_env(), "tools", None) or None
        self.fmt = ChatFormat(tokenizer, tools)
        self.parser = ToolCallParser(cfg.tool_parser, tokenizer, tools) if tools else None

    def make(self, item: dict, seed: int, index: int, limits: TurnLimits) -> EnvTrajectory:
        parse = self.parser.parse if self.parser is not None else None
        return EnvTrajectory(
            self.cfg, self.make_env, self.fmt, parse, self._decode,
            item["messages"], item["row"], seed, index, limits,
        )  # fmt: skip

    def close(self) -> None:
        """Nothing is shared between an environment's trajectories."""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
