"""Run configuration: one dataclass per component, loaded from YAML with dotted overrides.

`load_config(path | None, overrides=["algorithm.kl_coef=0.01", ...]) -> RunConfig`. Unknown keys and
wrong types fail with the full dotted key, the value and what would be accepted. Component configs
live next to the code they configure (`ParallelConfig` in `megarl.distributed`, `RolloutConfig` in
`megarl.rollout`, ...); this module only assembles them.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml

from megarl.distributed.topology import ParallelConfig
from megarl.errors import UserError
from megarl.models.hf_config import PrecisionConfig
from megarl.models.optim import OptimConfig

DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "configs", "default.yaml")


class ConfigError(UserError, ValueError):
    """A config key or value that cannot be used; names the dotted key."""


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

    def __post_init__(self):
        given = [k for k in ("hf", "mcore_ckpt", "config") if getattr(self, k)]
        if len(given) != 1:
            raise ConfigError(
                f"model: exactly one of model.hf, model.mcore_ckpt, model.config must be set; "
                f"got {given or 'none'}"
            )


ALGORITHMS = ("grpo", "ppo", "sft", "dpo")
OFFLINE_ALGORITHMS = ("sft", "dpo")
"""Trained on a fixed dataset by `megarl.trainer.offline`: no rollout engine, no rewards."""
KL_PLACEMENT = ("loss", "reward")


@dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    name: str = "grpo"
    """grpo (no critic; group-relative advantages), ppo (critic + GAE), or an offline stage on
    a fixed dataset: sft (supervised fine-tuning) or dpo (preference pairs; variants in
    algorithm.dpo_loss)."""
    advantage: str = "grpo"
    """Advantage estimator for grpo-style runs: grpo, rloo, dr_grpo, reinforce++."""
    scale: str = "group"
    """Advantage scaling: group, batch or none (see megarl.advantage)."""
    policy_loss: str = "ppo"
    """A registered policy loss (megarl.algorithms.losses): ppo (token-level ratio) or gspo
    (sequence-level ratio)."""
    clip_low: float = 0.2
    """PPO clip range below 1 (ratio >= 1 - clip_low)."""
    clip_high: float = 0.2
    """PPO clip range above 1; > clip_low is DAPO's clip-higher."""
    dual_clip: float | None = None
    """Dual-clip constant c (> 1) for negative advantages; null = off."""
    agg_mode: str = "token-mean"
    """Loss aggregation: token-mean, seq-mean-token-sum, seq-mean-token-mean or
    seq-mean-token-sum-norm (see megarl.algorithms.losses)."""
    kl_coef: float = 0.0
    """KL-to-reference coefficient; 0 disables the reference model."""
    kl_kind: str = "k3"
    """KL estimator: k1, k2, k3, abs."""
    kl_in: str = "loss"
    """Where the KL goes: loss (a loss term) or reward (a per-token reward penalty)."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient."""
    tis_cap: float | None = None
    """Truncated importance sampling cap against the sampler's logprobs; null = off."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    mini_batches: int = 1
    """Optimizer steps per epoch (the rollout batch is split into this many mini-batches)."""
    micro_batch_size: int = 8
    """Most sequences per forward/backward micro-batch (gradient accumulation inside a
    mini-batch). Sequences are grouped by length, longest first; the two sequences of a
    preference pair always share a micro-batch."""
    max_tokens_per_micro_batch: int | None = None
    """Also close a micro-batch before its padded size (sequences x longest) would exceed this
    many tokens; null = no token budget. Changes no loss or gradient, only the grouping."""
    balance_dp_tokens: bool = False
    """Re-deal each step's samples over the DP ranks after scoring so every rank holds the same
    number of samples and near-equal tokens (`megarl.trainer.balance`); no effect at DP 1."""
    gamma: float = 1.0
    """PPO discount."""
    lam: float = 0.95
    """PPO GAE lambda."""
    value_clip: float | None = 0.2
    """PPO value-loss clip; null = off."""
    value_coef: float = 1.0
    """Weight of the critic's loss (the critic has its own optimizer)."""
    dpo_loss: str = "sigmoid"
    """Preference loss of algorithm.name=dpo: sigmoid (DPO), ipo, hinge (SLiC), or simpo
    (reference-free, length-normalised); formulas in megarl.algorithms.preference."""
    dpo_beta: float = 0.1
    """DPO's beta: the strength of the implicit KL to the reference (SimPO: the reward scale)."""
    dpo_label_smoothing: float = 0.0
    """cDPO: the assumed fraction of flipped preference labels, 0 <= eps < 0.5 (sigmoid and
    simpo only)."""
    dpo_length_norm: bool = False
    """Compare mean token logprobs of the responses instead of their sums (always on for
    simpo)."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin gamma (dpo_loss=simpo)."""

    def __post_init__(self):
        if self.name not in ALGORITHMS:
            raise ConfigError(f"algorithm.name={self.name!r}; accepted: {ALGORITHMS}")
        self._check_preference()
        if self.kl_in not in KL_PLACEMENT:
            raise ConfigError(f"algorithm.kl_in={self.kl_in!r}; accepted: {KL_PLACEMENT}")
        if self.kl_in == "reward" and self.kl_coef > 0 and self.name != "ppo":
            # group-relative advantages take one reward per sample: a per-token penalty has no
            # place in them (PPO's GAE takes per-token rewards)
            raise ConfigError(
                f"algorithm.kl_in=reward needs algorithm.name=ppo (per-token rewards into GAE); "
                f"with algorithm.name={self.name} accepted: algorithm.kl_in=loss"
            )
        for k in ("ppo_epochs", "mini_batches", "micro_batch_size"):
            if getattr(self, k) < 1:
                raise ConfigError(f"algorithm.{k}={getattr(self, k)} must be >= 1")
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch < 1:
            raise ConfigError(
                f"algorithm.max_tokens_per_micro_batch={self.max_tokens_per_micro_batch}; "
                "accepted: null or >= 1"
            )
        from megarl.algorithms.advantages import available_advantages
        from megarl.algorithms.kl import kl_penalty  # noqa: F401 - validated at use
        from megarl.algorithms.losses import AGG_MODES, available_policy_losses

        if self.advantage not in available_advantages():
            raise ConfigError(
                f"algorithm.advantage={self.advantage!r}; accepted: {available_advantages()}"
            )
        if self.policy_loss not in available_policy_losses():
            raise ConfigError(
                f"algorithm.policy_loss={self.policy_loss!r}; accepted: {available_policy_losses()}"
            )
        if self.scale not in ("group", "batch", "none"):
            raise ConfigError(f"algorithm.scale={self.scale!r}; accepted: group, batch, none")
        if self.agg_mode not in AGG_MODES:
            raise ConfigError(f"algorithm.agg_mode={self.agg_mode!r}; accepted: {AGG_MODES}")
        if self.kl_kind not in ("k1", "k2", "k3", "abs"):
            raise ConfigError(f"algorithm.kl_kind={self.kl_kind!r}; accepted: k1, k2, k3, abs")

    def _check_preference(self) -> None:
        from megarl.algorithms.preference import available_preference_losses, get_preference_loss

        if self.dpo_loss not in available_preference_losses():
            raise ConfigError(
                f"algorithm.dpo_loss={self.dpo_loss!r}; accepted: {available_preference_losses()}"
            )
        if self.dpo_beta <= 0:
            raise ConfigError(f"algorithm.dpo_beta={self.dpo_beta}; accepted: > 0")
        if not 0.0 <= self.dpo_label_smoothing < 0.5:
            raise ConfigError(
                f"algorithm.dpo_label_smoothing={self.dpo_label_smoothing}; accepted: "
                "0 <= eps < 0.5"
            )
        if self.dpo_label_smoothing and not get_preference_loss(self.dpo_loss).label_smoothing:
            raise ConfigError(
                f"algorithm.dpo_label_smoothing={self.dpo_label_smoothing} with "
                f"algorithm.dpo_loss={self.dpo_loss!r}; label smoothing applies to sigmoid and "
                "simpo only: set it to 0"
            )

    @property
    def needs_reference(self) -> bool:
        """Whether the run builds the frozen reference model: for the KL term of an RL run
        (kl_coef > 0), or for a reference-based preference loss (dpo, all but simpo)."""
        from megarl.algorithms.preference import get_preference_loss

        if self.name == "dpo":
            return get_preference_loss(self.dpo_loss).reference
        return self.name in ("grpo", "ppo") and self.kl_coef > 0

    @property
    def offline(self) -> bool:
        """Trained on a fixed dataset (no rollout engine): `OFFLINE_ALGORITHMS`."""
        return self.name in OFFLINE_ALGORITHMS


@dataclass(frozen=True, kw_only=True)
class RewardConfig:
    functions: tuple[str, ...] = ("toy",)
    """Reward functions: built-in names or dotted paths 'pkg.module:function'."""
    weights: tuple[float, ...] | None = None
    """One weight per function; null = all 1."""
    on_error: str = "raise"
    """A reward function that raises: raise (stop the run) or zero (score 0, count it)."""
    kwargs: dict = field(default_factory=dict)
    """Per-function keyword arguments, keyed by the entry as written in reward.functions (a
    built-in name or 'pkg.module:function'): {entry: {arg: value}}."""

    def __post_init__(self):
        if self.on_error not in ("raise", "zero"):
            raise ConfigError(f"reward.on_error={self.on_error!r}; accepted: raise, zero")
        if self.weights is not None and len(self.weights) != len(self.functions):
            raise ConfigError(
                f"reward.weights has {len(self.weights)} entries for "
                f"{len(self.functions)} reward.functions"
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
    rollout.top_p and rollout.top_k."""
    max_tokens: int | None = None
    """Longest evaluation response; null = rollout.max_tokens."""
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
    """Log to Weights & Biases (offline unless wandb_mode says online or WANDB_MODE is set)."""
    wandb_project: str = "megarl"
    """Weights & Biases project the run is logged under."""
    wandb_mode: str = "offline"
    """offline, online or disabled."""
    tensorboard: bool = True
    """Also write tensorboard events if tensorboard is installed."""
    progress: bool = True
    """Console progress bar on rank 0."""
    samples_per_step: int = 4
    """Samples of each step written to samples.jsonl (and a wandb table): the best and the
    worst by total reward, then a seeded pick of the others; 0 = none."""
    show_samples: bool = False
    """Print each step's best and worst sample on the console (`megarl train --show-samples`);
    needs logging.samples_per_step >= 2."""

    def __post_init__(self):
        if self.samples_per_step < 0:
            raise ConfigError(
                f"logging.samples_per_step={self.samples_per_step}; accepted: >= 0 (0 = none)"
            )
        if self.show_samples and self.samples_per_step < 2:
            raise ConfigError(
                f"logging.show_samples (--show-samples) prints each step's best and worst sample "
                f"but logging.samples_per_step={self.samples_per_step}; accepted: >= 2"
            )


def _rollout_config():
    from megarl.rollout.engine import RolloutConfig

    return RolloutConfig


def _data_config():
    from megarl.data.dataset import DataConfig

    return DataConfig


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    model: ModelConfig
    """The policy model: where its architecture, weights and tokenizer come from."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """How the trainer's models are split across ranks (TP, PP, CP, EP; DP is what is left)."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """Parameter and compute dtype, FP8 and Transformer-Engine layers."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The actor's optimizer (Adam) and learning-rate schedule."""
    critic_optim: OptimConfig = field(default_factory=OptimConfig)
    """The critic's optimizer and schedule (PPO only)."""
    rollout: Any = None
    """The colocated vLLM engine: sampling, stop tokens, its memory and parallelism."""
    data: Any = None
    """The prompt dataset, its tokenization and the prompts per step."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """The RL algorithm: advantages, policy loss and clipping, KL, PPO epochs and batching."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward functions and their weights."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Steps, seeds, checkpoints, resume and export."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation: which prompts, how often, how they are sampled."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Where metrics go besides metrics.jsonl (wandb, tensorboard) and the console progress."""

    def __post_init__(self):
        fns = self.reward.functions
        if self.eval.pass_reward is not None and self.eval.pass_reward not in fns:
            raise ConfigError(
                f"eval.pass_reward={self.eval.pass_reward!r} is not one of reward.functions; "
                f"accepted: {list(fns)}"
            )
        if not fns and (self.eval.every or self.eval.path or self.eval.fraction):
            raise ConfigError("eval: reward.functions is empty; a pass needs a reward function")


_LAZY = {"rollout": _rollout_config, "data": _data_config}


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
        if name in _LAZY and cls is RunConfig:
            kwargs[name] = build(_LAZY[name](), data.get(name), key)
        elif name in data:
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
    for o in overrides:
        apply_override(tree, o)
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
