"""The `reward` section: reward functions, their weights, and a reward model.

A sample's reward is `sum_f w_f r_f + reward.model_weight x rm` (`rm`: the reward model's score,
normalised when `reward.model_normalize: running`), plus `reward.env_weight x env` for a multi-turn
trajectory (`env`: its environment's reward), minus `reward.truncated_penalty` for a response cut at
`rollout.sampling.max_tokens` without EOS, plus `reward.judge.weight x judge` with a judge model
(`judge`: the score parsed from its answer); a trajectory whose environment failed scores 0. Without
`reward.functions` in the config the functions are `[toy]` (the embedded task's reward) when no
reward model or judge is set, and none with one: a model is never mixed with the toy reward unless
the config names it. Checked here: the shapes of the section; the paths and the model behind
`reward.model` are checked when a run starts (`megarl.rewards.model`)."""

from __future__ import annotations

import re
import string
from dataclasses import dataclass, field

from megarl.errors import ConfigError

NORMALIZE = ("none", "running")

JUDGE_TEMPLATE = (
    "Read the question and the response, then grade the response's correctness from 0 to 10.\n\n"
    "Question: {prompt}\n\nResponse: {response}\n\nEnd with one line 'Score: N'."
)
JUDGE_PARSE = r"(?i)score:\s*(-?\d+(?:\.\d+)?)"


@dataclass(frozen=True, kw_only=True)
class JudgeConfig:
    model: str | None = None
    """A generative judge that reads each sample and answers with a score (LLM-as-judge): a
    Hugging Face causal-LM directory with its tokenizer, or a GGUF file (converted once into
    $MEGARL_CACHE). It runs on a vLLM engine of its own in every trainer process, frozen;
    null = none."""
    template: str = JUDGE_TEMPLATE
    """The judge's prompt, Python format fields: {prompt}, {response}, {conversation} (a
    multi-turn trajectory's messages, one 'role: content' line each) and any column of the
    dataset ({answer} for a reference answer). Literal braces are doubled."""
    chat: bool = True
    """Wrap the prompt as one user message in the judge tokenizer's chat template (when it has
    one); false = the plain text."""
    parse: str = JUDGE_PARSE
    """A regular expression over the judge's answer; the score is its last match's group 1 (the
    whole match without a group), read as a number."""
    on_parse_error: float = 0.0
    """The score of an answer the pattern does not match (or that runs out of time); counted
    as reward/judge_parse_failures."""
    max_tokens: int = 64
    """Tokens the judge may write per answer."""
    temperature: float = 0.0
    """The judge's sampling temperature; 0 = greedy."""
    weight: float = 1.0
    """Weight of the judge's score in the total reward."""
    timeout_s: float = 600.0
    """Seconds one scoring call may take; the answers unfinished then score on_parse_error and
    count as reward/judge_timeouts."""
    max_model_len: int = 2048
    """The longest judge request, prompt and answer tokens together (sizes its KV cache)."""
    log_answers: int = 4
    """Judged samples of each step (per DP rank) written to RUN/judge/dp_<rank>.jsonl with the
    judge's prompt and answer; 0 = none."""
    kv_cache_memory_bytes: int = 256 * 2**20
    """The judge engine's KV cache (CPU; GPU: see gpu_memory_utilization)."""
    gpu_memory_utilization: float = 0.1
    """GPU: the share of the device the judge engine takes (weights + KV cache)."""

    def __post_init__(self):
        if self.model is not None and not self.model.strip():
            raise ConfigError("reward.judge.model is empty; accepted: a path, or null")
        try:
            fields = [f for _, f, _, _ in string.Formatter().parse(self.template) if f is not None]
        except ValueError as e:
            raise ConfigError(
                f"reward.judge.template: {e}; accepted: Python format fields such as {{prompt}} "
                "and {response}, literal braces doubled"
            ) from e
        bad = [f for f in fields if not f.isidentifier()]
        if bad:
            raise ConfigError(
                f"reward.judge.template has the field(s) {bad}; accepted: plain names such as "
                "{prompt}, {response}, {conversation} or a dataset column"
            )
        try:
            groups = re.compile(self.parse).groups
        except re.error as e:
            raise ConfigError(
                f"reward.judge.parse={self.parse!r} is not a regular expression: {e}"
            ) from e
        if groups > 1:
            raise ConfigError(
                f"reward.judge.parse={self.parse!r} has {groups} groups; accepted: at most one "
                "(the score)"
            )
        for key, value, ok, accepted in (
            ("max_tokens", self.max_tokens, self.max_tokens >= 1, ">= 1"),
            ("temperature", self.temperature, 0 <= self.temperature <= 2, "0 (greedy) to 2"),
            ("timeout_s", self.timeout_s, self.timeout_s > 0, "> 0"),
            ("max_model_len", self.max_model_len, self.max_model_len > self.max_tokens,
             f"> reward.judge.max_tokens ({self.max_tokens})"),
            ("log_answers", self.log_answers, self.log_answers >= 0, ">= 0"),
            ("kv_cache_memory_bytes", self.kv_cache_memory_bytes,
             self.kv_cache_memory_bytes > 0, "> 0"),
            ("gpu_memory_utilization", self.gpu_memory_utilization,
             0 < self.gpu_memory_utilization < 1, "between 0 and 1"),
        ):  # fmt: skip
            if not ok:
                raise ConfigError(f"reward.judge.{key}={value}; accepted: {accepted}")

    def fields(self) -> list[str]:
        """The template's field names, in order of first use."""
        names = [f for _, f, _, _ in string.Formatter().parse(self.template) if f]
        return list(dict.fromkeys(names))


@dataclass(frozen=True, kw_only=True)
class RewardConfig:
    functions: tuple[str, ...] | None = None
    """Reward functions: built-in names or dotted paths 'pkg.module:function'; null = [toy]
    without reward.model or reward.judge.model, none with either."""
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
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """A judge model as a reward (logged as reward/judge); see its keys."""
    truncated_penalty: float | None = None
    """Subtracted from the total reward of each response cut at rollout.sampling.max_tokens
    without EOS (finish reason length); null = none."""

    def __post_init__(self):
        if self.functions is None:  # frozen: resolve the default once, here
            scored = self.model is not None or self.judge.model is not None
            object.__setattr__(self, "functions", () if scored else ("toy",))
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
