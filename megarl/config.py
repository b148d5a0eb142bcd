"""Run configuration: one dataclass per component, loaded from YAML with dotted overrides.

`load_config(path | None, overrides=["algorithm.kl_coef=0.01", ...]) -> RunConfig`. Unknown keys and
wrong types fail with the full dotted key, the value and what would be accepted. Component configs
live next to the code they configure (`ParallelConfig` in `megarl.distributed`, `RolloutConfig` in
`megarl.rollout`, ...); this module only assembles them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml

from megarl.algorithms.config import AlgorithmConfig
from megarl.data.dataset import DataConfig
from megarl.distributed.topology import ParallelConfig
from megarl.dtypes import BYTES
from megarl.envs.config import EnvConfig
from megarl.errors import ConfigError
from megarl.metrics.sinks import WANDB_MODES
from megarl.models.hf_config import PrecisionConfig
from megarl.models.lora import LoraConfig
from megarl.models.optim import OptimConfig
from megarl.rewards.config import RewardConfig
from megarl.rollout import (
    RolloutConfig,
    RolloutConfigError,
    check_rollout_with,
    migrate_keys,
    new_key,
)

log = logging.getLogger("megarl")

DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "configs", "default.yaml")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    hf: str | None = None
    """Hugging Face model directory to start from (config.json + safetensors), or a GGUF file
    (dequantized to fp32 once, into $MEGARL_CACHE/gguf, and reused by later runs)."""
    mcore_ckpt: str | None = None
    """megarl checkpoint to start from: a trainer checkpoint RUN/checkpoints/step_N or a run
    directory RUN (its newest; the actor's weights only, a fresh optimizer and step 0), or a
    directory from `megarl convert hf-to-mcore`."""
    config: dict | None = None
    """Inline HF config dict for a model trained from random init (tiny runs and tests)."""
    tokenizer: str | None = None
    """Tokenizer directory; default: the model directory (a checkpoint's kept tokenizer). 'toy' =
    the embedded toy tokenizer."""
    make_vocab_size_divisible_by: int = 128
    """Embedding rows are padded to a multiple of this x TP."""
    init_seed: int = 1234
    """Seed of the random init (when neither hf nor mcore_ckpt is given)."""
    critic_init: str = "actor"
    """Where the PPO critic starts: actor (the policy's trunk, a zero value head), reward_model
    (the trunk and score head of reward.model), or a reward model directory (the forms of
    reward.model). It must use the policy's tokenizer."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters on the trained model (docs/lora.md): the policy, or the reward model of
    algorithm.name=rm; rank 0 = full fine-tuning."""
    critic_lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters on the PPO critic, its value head trained in full (docs/lora.md): rank,
    alpha, dropout, targets; rank 0 = the critic trains in full."""
    expert_bias_update_rate: float = 0.0
    """MoE routers with an expert bias (GLM-4.5, DeepSeek-V3, Kimi-K2): DeepSeek's aux-loss-free
    update, bias += rate x sign(mean load - expert load) after every optimizer step (DeepSeek-V3
    pretrained with 0.001). Default 0: frozen, the released routing balance kept through RL, and
    the sampler routes with the same bias as the trainer (the bias is synced with the weights
    either way)."""

    def __post_init__(self):
        given = [k for k in ("hf", "mcore_ckpt", "config") if getattr(self, k)]
        if len(given) != 1:
            raise ConfigError(
                f"model: exactly one of model.hf, model.mcore_ckpt, model.config must be set; "
                f"got {given or 'none'}"
            )
        if not self.expert_bias_update_rate >= 0:
            raise ConfigError(
                f"model.expert_bias_update_rate={self.expert_bias_update_rate}; accepted: a "
                "number >= 0 (0 = the expert bias frozen)"
            )
        if not self.critic_init.strip():
            raise ConfigError(
                "model.critic_init is empty; accepted: actor, reward_model, or a reward model "
                "directory"
            )


@dataclass(frozen=True, kw_only=True)
class TeacherConfig:
    model: str | None = None
    """The teacher of on-policy distillation (algorithm.name=distill, or algorithm.distill_coef >
    0): a frozen causal LM that scores every sampled token. A Hugging Face directory, a GGUF file
    (converted once into $MEGARL_CACHE), a megarl run RUN or checkpoint RUN/checkpoints/step_N
    (its actor), or a `megarl convert hf-to-mcore` directory; any architecture megarl builds,
    with the policy's tokenizer. Built frozen at the run's layout; null = none."""
    dtype: str | None = None
    """The teacher's parameter and compute dtype (fp32, bf16, fp16); null = precision.dtype. A
    bf16 teacher beside an fp32 student holds half the weights' bytes; its logprobs are taken in
    fp32 from its logits. The run's other precision settings (FP8) apply to it as they are."""

    def __post_init__(self):
        if self.model is not None and not self.model.strip():
            raise ConfigError("teacher.model is empty; accepted: a path, or null")
        if self.dtype is not None and self.dtype not in BYTES:
            raise ConfigError(
                f"teacher.dtype={self.dtype!r}; accepted: {sorted(BYTES)}, or null (the run's)"
            )


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    steps: int = 60
    """Steps to run: RL steps (rollout + update), or optimizer steps of an offline stage."""
    epochs: float | None = None
    """Offline stages (sft, dpo): passes over the training rows instead of trainer.steps (the
    steps become ceil(epochs x rows / data.prompts_per_step)); null = trainer.steps."""
    seed: int = 0
    """Global seed (data order, sampling, init)."""
    save_every: int = 0
    """Checkpoint every k steps (0 = only at the end; see also save_every_minutes)."""
    save_every_minutes: float = 30.0
    """Also checkpoint at the first step boundary this many minutes after the last checkpoint
    (the clock starts when the process starts, so setup counts); 0 = off."""
    time_limit_minutes: float = 0.0
    """Stop with a checkpoint (exit status 4) before this many minutes since the process
    started: at the first step boundary where the time left is shorter than the longest step
    plus the longest checkpoint save so far. 0 = no limit. See docs/preemption.md."""
    step_timeout_minutes: float = 60.0
    """Hang watchdog: a step (with its checkpoint save) that runs longer than this dumps every
    thread's Python stack to RUN/hang-rank{R}.txt, names the stage, and exits with status 5;
    the process groups' collective timeout is set a few minutes above it. 0 = off."""
    keep_last: int = 2
    """Checkpoints kept (the newest complete one is never removed); 0 = keep all."""
    resume: bool = True
    """Resume from the newest checkpoint in the run directory if there is one."""
    max_bad_steps: int = 3
    """Stop after this many consecutive steps with NaN/Inf loss (each is skipped)."""
    export_hf: bool = False
    """Write the final policy as an HF directory (out/hf) at the end."""
    critic_warmup_steps: int = 0
    """PPO: steps that train only the critic."""

    def __post_init__(self):
        for k in ("steps", "save_every", "keep_last", "critic_warmup_steps"):
            if getattr(self, k) < 0:
                raise ConfigError(f"trainer.{k}={getattr(self, k)}; accepted: >= 0")
        if self.max_bad_steps < 1:
            raise ConfigError(f"trainer.max_bad_steps={self.max_bad_steps}; accepted: >= 1")
        for k in ("save_every_minutes", "time_limit_minutes", "step_timeout_minutes"):
            v = getattr(self, k)
            if not v >= 0 or v == float("inf"):
                raise ConfigError(f"trainer.{k}={v}; accepted: a number of minutes >= 0 (0 = off)")
        if self.epochs is not None and self.epochs <= 0:
            raise ConfigError(f"trainer.epochs={self.epochs}; accepted: null or > 0")


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    every: int = 0
    """Evaluate every this many steps, at step 0 (before any update) and after the last step;
    0 = no evaluation."""
    path: str | None = None
    """Held-out prompt source (same forms as data.path, read with the data.* settings); null:
    see eval.fraction."""
    fraction: float = 0.0
    """With no eval.path: hold out this seeded fraction of the training data's distinct prompts
    (every row of a held-out prompt is removed from training, so the two sets are disjoint)."""
    seed: int = 0
    """Seed of the eval.fraction split."""
    max_prompts: int | None = None
    """Evaluate at most this many held-out prompts, the first ones (of eval.path in file order;
    of eval.fraction's split in its seeded order, so a random subset); null = all."""
    n: int = 1
    """Samples per prompt (pass@k for k <= n)."""
    temperature: float = 0.0
    """Sampling temperature of evaluation in [0, 2]; 0 = greedy. Above 0 it samples with
    rollout.sampling.top_p and top_k."""
    max_tokens: int | None = None
    """Longest evaluation response; null = rollout.sampling.max_tokens."""
    pass_reward: str | None = None
    """The reward function that decides a pass (an entry of reward.functions, as written
    there); null = the first one."""
    pass_threshold: float = 1.0
    """A sample passes when the value of eval.pass_reward is >= this."""
    pass_k: tuple[int, ...] | None = None
    """The k of the logged eval/pass@k (each 1 <= k <= eval.n); null = 1 and eval.n."""
    samples_logged: int | None = 64
    """Held-out prompts whose samples go to eval_samples.jsonl at every evaluation (the first
    ones); null = all, 0 = none."""

    def __post_init__(self):
        if self.every < 0:
            raise ConfigError(f"eval.every={self.every}; accepted: 0 (off) or >= 1")
        if not 0.0 <= self.fraction < 1.0:
            raise ConfigError(f"eval.fraction={self.fraction}; accepted: 0 <= fraction < 1")
        if self.path is not None and self.fraction > 0:
            raise ConfigError("eval.path and eval.fraction are both set; accepted: one of them")
        if self.every and self.path is None and self.fraction == 0:
            raise ConfigError(
                f"eval.every={self.every} needs held-out prompts: set eval.path or eval.fraction"
            )
        if self.seed < 0:
            raise ConfigError(f"eval.seed={self.seed}; accepted: >= 0")
        if self.n < 1:
            raise ConfigError(f"eval.n={self.n}; accepted: >= 1")
        if not 0 <= self.temperature <= 2:
            raise ConfigError(f"eval.temperature={self.temperature}; accepted: 0 <= T <= 2")
        if self.temperature == 0 and self.n > 1:
            raise ConfigError(
                f"eval.n={self.n} with eval.temperature=0: greedy decoding gives {self.n} "
                "identical samples; set eval.temperature > 0 (e.g. 1.0) or eval.n=1"
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ConfigError(f"eval.max_tokens={self.max_tokens}; accepted: null or >= 1")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise ConfigError(f"eval.max_prompts={self.max_prompts}; accepted: null or >= 1")
        for k in self.pass_k or ():
            if not 1 <= k <= self.n:
                raise ConfigError(
                    f"eval.pass_k={list(self.pass_k)}: {k} is out of range; accepted: "
                    f"1 <= k <= eval.n={self.n}"
                )
        if self.samples_logged is not None and self.samples_logged < 0:
            raise ConfigError(f"eval.samples_logged={self.samples_logged}; accepted: null or >= 0")

    @property
    def ks(self) -> tuple[int, ...]:
        """The k of every logged pass@k, ascending."""
        return tuple(sorted(set(self.pass_k or (1, self.n))))


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    wandb: bool = True
    """Log to Weights & Biases, in the mode of logging.wandb_mode (offline by default: files in
    RUN/wandb/, uploaded later with `wandb sync`)."""
    wandb_project: str = "megarl"
    """Weights & Biases project the run is logged under."""
    wandb_mode: str | None = None
    """offline, online or disabled; a value set here wins over the WANDB_MODE environment
    variable. null = WANDB_MODE when the environment sets it (the Dockerfile and the Slurm
    example set offline), else offline."""
    tensorboard: bool = False
    """Also write tensorboard events to RUN/tensorboard/. tensorboard is not a dependency of
    megarl: `pip install tensorboard` first (without it a warning says nothing is written)."""
    plot_every_minutes: float = 3.0
    """Redraw RUN/reward.png (offline stages: loss.png) during the run, after the first step
    this many minutes after the last draw (rank 0; a failed plot is a warning); 0 = only at the
    end. `megarl plot RUN` redraws it at any time."""
    progress: bool = True
    """Console progress bar on rank 0."""
    samples_per_step: int = 4
    """Samples of each step written to samples.jsonl (and a wandb table): the best and the
    worst by total reward, then a seeded pick of the others; 0 = none."""
    show_samples: bool = False
    """Print each step's best and worst sample on the console (`megarl train --show-samples`);
    needs logging.samples_per_step >= 2."""

    def __post_init__(self):
        if self.wandb_mode is not None and self.wandb_mode not in WANDB_MODES:
            raise ConfigError(
                f"logging.wandb_mode={self.wandb_mode!r}; accepted: {', '.join(WANDB_MODES)} or "
                "null (the WANDB_MODE environment variable, else offline)"
            )
        if self.plot_every_minutes < 0:
            raise ConfigError(
                f"logging.plot_every_minutes={self.plot_every_minutes}; accepted: >= 0 (0 = only "
                "at the end of the run)"
            )
        if self.samples_per_step < 0:
            raise ConfigError(
                f"logging.samples_per_step={self.samples_per_step}; accepted: >= 0 (0 = none)"
            )
        if self.show_samples and self.samples_per_step < 2:
            raise ConfigError(
                f"logging.show_samples (--show-samples) prints each step's best and worst sample "
                f"but logging.samples_per_step={self.samples_per_step}; accepted: >= 2"
            )


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    model: ModelConfig
    """The policy model: where its architecture, weights and tokenizer come from (one of
    model.hf, model.mcore_ckpt, model.config; `--set` of one replaces the file's)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """How the trainer's models are split across ranks (TP, PP, CP, EP; DP is what is left)."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """Parameter and compute dtype, FP8 and Transformer-Engine layers."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The actor's optimizer (Adam) and learning-rate schedule."""
    critic_optim: OptimConfig = field(default_factory=OptimConfig)
    """The critic's optimizer and schedule (PPO only)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation: what samples are drawn with, the vLLM engines and where they run."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Multi-turn trajectories: the environment (or agent), turns, token budget, tool calls."""
    data: DataConfig = field(default_factory=DataConfig)
    """The prompt dataset, its tokenization and the prompts per step."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """The RL algorithm: advantages, policy loss and clipping, KL, PPO epochs and batching."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward functions and their weights, and a reward model."""
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """The frozen teacher model of on-policy distillation."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Steps, seeds, checkpoints, resume and export."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation: which prompts, how often, how they are sampled."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Where metrics go besides metrics.jsonl (wandb, tensorboard) and the console progress."""

    def __post_init__(self):
        fns, rl = self.reward.functions, not self.algorithm.offline
        env_reward = self.env.multi_turn and self.reward.env_weight != 0
        self._check_teacher()
        distill = self.algorithm.name == "distill"  # its signal is the teacher's, not a reward
        scored = self.reward.model is not None or self.reward.judge.model is not None
        if rl and not distill and not fns and not scored and not env_reward:
            raise ConfigError(
                "reward: no reward.functions, no reward.model, no reward.judge.model and no "
                "environment reward; accepted: at least one function, a reward model, a judge, "
                "or env.name / env.agent with reward.env_weight != 0 "
                f"(got {self.reward.env_weight:g})"
            )
        init = self.model.critic_init
        if init != "actor" and self.algorithm.name != "ppo":
            raise ConfigError(
                f"model.critic_init={init!r} with algorithm.name={self.algorithm.name}: only "
                "ppo has a critic; accepted: model.critic_init=actor"
            )
        if init == "reward_model" and self.reward.model is None:
            raise ConfigError(
                "model.critic_init=reward_model needs reward.model; accepted: set reward.model, "
                "or model.critic_init=actor or a reward model directory"
            )
        if self.eval.pass_reward is not None and self.eval.pass_reward not in fns:
            raise ConfigError(
                f"eval.pass_reward={self.eval.pass_reward!r} is not one of reward.functions; "
                f"accepted: {list(fns)}"
            )
        lora = self.model.lora
        if lora.enabled and not lora.merge and lora.rank > 512 and rl:
            raise ConfigError(
                f"model.lora.rank={lora.rank} with model.lora.merge=false: vLLM's LoRA layers "
                "take ranks up to 512; accepted: a rank <= 512, or merge=true"
            )
        critic_lora = self.model.critic_lora
        if critic_lora.enabled and self.algorithm.name != "ppo":
            raise ConfigError(
                f"model.critic_lora.rank={critic_lora.rank} with algorithm.name="
                f"{self.algorithm.name}: only ppo has a critic; accepted: model.critic_lora.rank=0"
            )
        if critic_lora.init_from or critic_lora.merge:
            raise ConfigError(
                "model.critic_lora.init_from / merge: the critic's adapters start fresh and are "
                "never synced to an engine; accepted: rank, alpha, dropout, targets"
            )
        if self.model.expert_bias_update_rate and self.precision.dtype != "fp32":
            # a 16-bit run keeps the expert bias on the model dtype's grid (synced in it), where
            # steps of 1e-3 vanish beside values of order 0.1 (bf16 spacing there: 2^-11 x 2^-3)
            raise ConfigError(
                f"model.expert_bias_update_rate={self.model.expert_bias_update_rate} with "
                f"precision.dtype={self.precision.dtype}: the expert bias is kept on the "
                f"{self.precision.dtype} grid (the weight sync carries it so), which swallows "
                "such steps; accepted: rate 0, or precision.dtype=fp32"
            )
        if not fns and (self.eval.every or self.eval.path or self.eval.fraction):
            raise ConfigError("eval: reward.functions is empty; a pass needs a reward function")
        if self.env.multi_turn and not rl:
            raise ConfigError(
                f"env.name / env.agent with algorithm.name={self.algorithm.name}: multi-turn "
                "trajectories are RL rollouts; accepted: grpo or ppo (or env.name: null)"
            )
        if self.algorithm.dynamic_sampling:
            self._check_dynamic_sampling()
        try:
            check_rollout_with(self.rollout, self.env, rl=rl, algorithm=self.algorithm.name)
        except RolloutConfigError as e:
            raise ConfigError(str(e)) from None

    def _check_teacher(self) -> None:
        alg = self.algorithm
        if alg.uses_teacher and self.teacher.model is None:
            why = (
                "algorithm.name=distill"
                if alg.name == "distill"
                else f"algorithm.distill_coef={alg.distill_coef:g}"
            )
            raise ConfigError(
                f"{why} needs teacher.model; accepted: a teacher model's HF directory, GGUF "
                "file or megarl checkpoint"
            )
        if self.teacher.model is not None and not alg.uses_teacher:
            raise ConfigError(
                f"teacher.model={self.teacher.model!r} with algorithm.name={alg.name} and "
                "algorithm.distill_coef=0: nothing reads the teacher; accepted: "
                "algorithm.name=distill, algorithm.distill_coef > 0 (grpo, ppo), or "
                "teacher.model=null"
            )
        if self.teacher.dtype is not None and self.teacher.model is None:
            raise ConfigError(
                f"teacher.dtype={self.teacher.dtype} without teacher.model; accepted: "
                "teacher.dtype=null, or a teacher"
            )

    def _check_dynamic_sampling(self) -> None:
        staleness, n = self.rollout.placement.max_staleness, self.rollout.sampling.n
        if staleness > 0:
            raise ConfigError(
                f"algorithm.dynamic_sampling=true with rollout.placement.max_staleness={staleness}:"
                " requests sent ahead cannot know how many rounds a step takes; accepted: "
                "max_staleness=0, or algorithm.dynamic_sampling=false"
            )
        if n < 2:
            raise ConfigError(
                f"algorithm.dynamic_sampling=true with rollout.sampling.n={n}: a group of one "
                "sample has no reward spread, so every group would be dropped; accepted: n >= 2"
            )


def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: bad value {value!r}")
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return build(tp, value, key)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r}: expected a list")
        (elem, *_rest) = typing.get_args(tp) or (Any,)
        return tuple(_coerce(v, elem, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r}: expected a mapping")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r}: expected true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r}: expected an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "5e-3" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}={value!r}: expected a number")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}={value!r}: expected a string")
    return value


def build(cls, data: Any, prefix: str = ""):
    """Instantiate dataclass `cls` from a mapping, strictly (unknown keys and types raise)."""
    if data is None:
        data = {}
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {data!r}")
    types_ = _field_types(cls)
    unknown = sorted(set(data) - set(types_))
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(
            f"unknown config key {where}{unknown[0]}; accepted keys"
            f"{' under ' + prefix if prefix else ''}: {sorted(types_)}"
        )
    kwargs = {}
    for name, tp in types_.items():
        key = f"{prefix}.{name}" if prefix else name
        if name in data:
            kwargs[name] = _coerce(data[name], tp, key)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{prefix or 'config'}: {e}") from e


def apply_override(tree: dict, override: str) -> None:
    """`a.b.c=value` (value parsed as YAML) into a nested dict."""
    if "=" not in override:
        raise ConfigError(f"override {override!r}: expected key=value (e.g. trainer.steps=10)")
    key, raw = override.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {override!r}: expected a dotted key, e.g. trainer.steps=10")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {override!r}: {p} is not a section")
    try:
        node[parts[-1]] = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ConfigError(
            f"override {override!r}: the value is not valid YAML ({_yaml_problem(e)}); quote "
            "strings with YAML's special characters"
        ) from None


MODEL_SOURCES = ("hf", "mcore_ckpt", "config")


def _one_model_source(tree: dict, overrides) -> None:
    """`--set model.hf=DIR` (or model.mcore_ckpt, model.config) replaces the model source the
    file sets (the embedded default's inline `model.config`, an example's `model.mcore_ckpt`)
    unless an override sets that one too. The rest of the model section stays (the default's
    toy tokenizer: the task's reward reads its ids)."""
    keys = {o.split("=", 1)[0].strip() for o in overrides}
    model = tree.get("model")
    if not isinstance(model, dict):
        return
    if not any(f"model.{k}" in keys and model.get(k) for k in MODEL_SOURCES):
        return
    for k in MODEL_SOURCES:  # several set by overrides: the model section's check names them
        if f"model.{k}" not in keys and model.get(k):
            model.pop(k)


def _reward_model_alone(tree: dict, overrides) -> None:
    """The embedded default with `--set reward.model=...`: its toy reward functions go unless an
    override names reward.functions (a reward model is never mixed with the toy reward
    silently)."""
    reward = tree.get("reward")
    keys = {o.split("=", 1)[0].strip() for o in overrides}
    if isinstance(reward, dict) and reward.get("model") and "reward.functions" not in keys:
        reward.pop("functions", None)
        if "reward.weights" not in keys:
            reward.pop("weights", None)


def _new_override(override: str, moved: list) -> str:
    """`override` with its key of an earlier release replaced by the new one (recorded in
    `moved`)."""
    key, sep, raw = override.partition("=")
    try:
        value = yaml.safe_load(raw) if sep else None
    except yaml.YAMLError:
        value = None  # (apply_override names the problem)
    new = new_key(key.strip(), value) if sep else None
    if new is None:
        return override
    moved.append((key.strip(), new))
    return f"{new}={raw}"


def _yaml_problem(e: yaml.YAMLError) -> str:
    """One line: what is wrong and where (YAML's own message spans several lines)."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{problem}"


def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load `path` (default: the embedded tiny CPU GRPO run) and apply dotted overrides."""
    src = path or DEFAULT_CONFIG
    if not os.path.exists(src):
        raise ConfigError(f"config file {src} does not exist")
    with open(src) as f:
        try:
            tree = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{src}: invalid YAML: {_yaml_problem(e)}") from e
    if not isinstance(tree, dict):
        raise ConfigError(
            f"{src}: expected a mapping of sections (model:, rollout:, ...), got "
            f"{type(tree).__name__}"
        )
    moved = migrate_keys(tree)
    overrides = [_new_override(o, moved) for o in overrides]
    for o in overrides:
        apply_override(tree, o)
    _one_model_source(tree, overrides)
    if path is None:
        _reward_model_alone(tree, overrides)
    if moved and os.environ.get("RANK", "0") == "0":  # (once, not from every rank)
        for old, new in dict.fromkeys(moved):
            log.warning(
                "config key %s is now %s; the old key is read until the next release", old, new
            )
    try:
        return build(RunConfig, tree)
    except ConfigError as e:
        # name where the bad key came from: an override if one sets it, else the file
        keys = [o.split("=", 1)[0].strip() for o in overrides]
        origin = next(
            (f"--set {o}" for o, k in zip(overrides, keys, strict=True) if k in str(e)), src
        )
        raise ConfigError(f"{origin}: {e}") from e


def to_dict(cfg) -> dict:
    """Plain nested dict (for config.yaml in the run directory)."""

    def conv(v):
        if dataclasses.is_dataclass(v):
            return {f.name: conv(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, tuple):
            return [conv(x) for x in v]
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        return v

    return conv(cfg)
