"""The `reward` section: reward functions, their weights, and a reward model.

A sample's reward is `sum_f w_f r_f + reward.model_weight x rm` (`rm`: the reward model's score,
normalised when `reward.model_normalize: running`), plus `reward.env_weight x env` for a multi-turn
trajectory (`env`: its environment's reward), minus `reward.truncated_penalty` for a response cut at
`rollout.sampling.max_tokens` without EOS; a trajectory whose environment failed scores 0. Without
`reward.functions` in the config the functions are `[toy]` (the embedded task's reward) when no
reward model is set, and none with one: a reward model is never mixed with the toy reward unless the
config names it. Checked here: the shapes of the section; the paths and the model behind
`reward.model` are checked when a run starts (`megarl.rewards.model`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from megarl.errors import ConfigError

NORMALIZE = ("none", "running")


@dataclass(frozen=True, kw_only=True)
class RewardConfig:
    functions: tuple[str, ...] | None = None
    """Reward functions: built-in names or dotted paths 'pkg.module:function'; null = [toy]
    without reward.model, none with it."""
    weights: tuple[float, ...] | None = None
    """One weight per function; null = all 1."""
    on_error: str = "raise"
    """A reward function that raises: raise (stop the run) or zero (score 0, count it)."""
    kwargs: dict = field(default_factory=dict)
    """Per-function keyword arguments, keyed by the entry as written in reward.functions (a
    built-in name or 'pkg.module:function'): {entry: {arg: value}}."""
    model: str | None = None
    """A reward model that scores every sample (logged as reward/rm): a Hugging Face
    <Family>ForSequenceClassification directory with one label (Llama, Mistral, Qwen2, Qwen3,
    Qwen3-MoE, Mixtral), a megarl reward-model run RUN (its newest checkpoint) or checkpoint
    RUN/checkpoints/step_N (role reward), or a `megarl convert hf-to-mcore` directory of one.
    Built frozen at the run's layout; null = none."""
    model_weight: float = 1.0
    """Weight of the reward model's score in the total reward (added to the weighted function
    rewards)."""
    model_normalize: str = "none"
    """none (the raw score), or running: (score - mean) / std with the mean and std of every
    score seen so far in the run, this step's included (kept in checkpoints)."""
    env_weight: float = 1.0
    """Multi-turn (env.name): weight of the environment's reward (the sum of its turns'
    rewards) in the total."""
    truncated_penalty: float | None = None
    """Subtracted from the total reward of each response cut at rollout.sampling.max_tokens
    without EOS (finish reason length); null = none."""

    def __post_init__(self):
        if self.functions is None:  # frozen: resolve the default once, here
            object.__setattr__(self, "functions", () if self.model else ("toy",))
        if self.on_error not in ("raise", "zero"):
            raise ConfigError(f"reward.on_error={self.on_error!r}; accepted: raise, zero")
        if self.weights is not None and len(self.weights) != len(self.functions):
            raise ConfigError(
                f"reward.weights has {len(self.weights)} entries for "
                f"{len(self.functions)} reward.functions"
            )
        if self.model is not None and not self.model.strip():
            raise ConfigError("reward.model is empty; accepted: a directory, or null")
        if self.model_normalize not in NORMALIZE:
            raise ConfigError(
                f"reward.model_normalize={self.model_normalize!r}; accepted: {NORMALIZE}"
            )
        if self.truncated_penalty is not None and self.truncated_penalty < 0:
            raise ConfigError(
                f"reward.truncated_penalty={self.truncated_penalty}; accepted: null or >= 0 "
                "(the amount subtracted)"
            )
