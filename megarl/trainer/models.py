"""The run's megatron models by role (`Models`), each built by one function of its role.

- actor: the policy the run trains (RL, SFT, DPO), from `model.*`;
- reference: frozen chunks of the initial policy (the KL term, DPO);
- critic (PPO): trainable, with a scalar value head; from the actor's trunk and a zero head
  (`model.critic_init: actor`), or from a reward model's trunk and score head
  (`model.critic_init: reward_model` or a directory; then its shape is that model's);
- teacher: a frozen causal LM of any shape that scores the sampled tokens (on-policy
  distillation: `teacher.model`, `megarl.trainer.teacher`);
- reward: a reward model (a scalar score head), frozen and resident in an RL run that scores
  with it (`reward.model`; its shape may differ from the actor's), or the trained role of
  `algorithm.name: rm` (from `model.*`: a reward model's trunk and head, or a causal LM's trunk
  and a new head drawn as transformers initialises one, normal(0, initializer_range)).

Every model is sharded by the run's one topology (the same TP / PP / DP); each rank reads only
its own shards. Starting weights load before a model's optimizer is built, which takes its fp32
masters from them (`megarl.models.optim.build_optimizer`); `megarl.trainer.invariants` checks
that they agree before the first step.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megarl.checkpoint.reader import load_into, open_checkpoint
from megarl.config import ConfigError, RunConfig
from megarl.convert.hf_io import LazyHFTensors
from megarl.convert.model_files import ModelFiles
from megarl.convert.peft import load_peft
from megarl.convert.sharded import copy_weights, load_hf_sharded, seeded_init
from megarl.models import lora
from megarl.models.builder import BuildConfig, ValueHead, build_model, resolve_use_te, unwrap
from megarl.models.hf_config import ModelArch
from megarl.models.mcore_config import packing_refusal, te_attention_refusal
from megarl.models.optim import build_optimizer, main_param_writer
from megarl.rewards.model import (
    RewardModel,
    open_scalar_model,
    reward_tokenizer,
    same_vocabulary,
)
from megarl.trainer.seeds import score_head_seed
from megarl.trainer.teacher import open_teacher

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megarl.distributed.topology import Groups

log = logging.getLogger("megarl")
ROLE_ORDER = ("actor", "reference", "critic", "reward", "teacher")


@dataclass
class Trained:
    """A model the run trains: this rank's megatron chunks (one per virtual pipeline stage),
    its DistributedOptimizer and its LR schedule."""

    chunks: list
    opt: MegatronOptimizer
    sched: OptimizerParamScheduler


@dataclass
class Models:
    """The run's megatron models by role, each sharded by the run's topology."""

    actor: Trained | None = None
    """The policy that trains (what an SFT / DPO / RL run improves and exports); None in a
    reward-model run."""
    reference: list | None = None
    """Frozen chunks of the initial policy (the KL term); None when nothing reads it or when
    the reference is the actor's base (`reference_is_base`)."""
    reference_is_base: bool = False
    """LoRA: the initial policy is the actor with its adapters off (no second model)."""
    critic: Trained | None = None
    """The value model (PPO): a trunk with a scalar head."""
    reward: Trained | list | None = None
    """The reward model (a scalar score head on the last pipeline stage): frozen chunks when an
    RL run scores with it, `Trained` when `algorithm.name: rm` trains it; None without one."""
    teacher: list | None = None
    """Frozen chunks of the distillation teacher (`teacher.model`); None without one."""
    archs: dict[str, ModelArch] = field(default_factory=dict)
    """{role: the architecture it was built from} for every role built."""

    def trained(self) -> dict[str, Trained]:
        """{role: model} of the models with an optimizer, in role order."""
        return {r: m for r in ROLE_ORDER if isinstance(m := getattr(self, r), Trained)}

    def policy(self) -> list:
        """The chunks of the policy the rollout engine generates with: the trained actor's, or
        the frozen policy of an evaluation (`build_frozen_policy`)."""
        return self.actor.chunks if self.actor is not None else self.reference

    @contextlib.contextmanager
    def reference_policy(self):
        """The chunks whose forward is the reference policy inside the block: the frozen copy,
        or the actor's own with the adapters off (LoRA); None without a reference."""
        if self.reference_is_base:
            with lora.disabled(self.actor.chunks) as chunks:
                yield chunks
        else:
            yield self.reference

    def checkpointed(self) -> dict:
        """{name: (chunks, optimizer)} of what a checkpoint holds (the trained models; frozen
        ones are rebuilt from where they came from)."""
        return {r: (m.chunks, m.opt) for r, m in self.trained().items()}


def build_models(
    cfg: RunConfig,
    arch: ModelArch,
    *,
    gpu: bool,
    updates: int,
    reference: bool = False,
    critic: bool = False,
    reward: ModelFiles | None = None,
    critic_source: ModelFiles | None = None,
    teacher: ModelFiles | None = None,
) -> Models:
    """The actor (with its starting weights), and the reference / critic / reward model /
    teacher when asked, each built by its role's function. `updates`: optimizer steps the LR
    schedules span; `reward`: the frozen reward model's source; `critic_source`: where the
    critic starts when not from the actor (`model.critic_init`); `teacher`: the distillation
    teacher's source."""
    make = _maker(cfg, gpu)
    actor = build_actor(cfg, arch, make, updates)
    frozen_rm = build_reward(make, reward) if reward is not None else None
    models = Models(actor=actor, reward=frozen_rm, archs={"actor": arch})
    if reference and cfg.model.lora.enabled:
        models.reference_is_base = True
        models.archs["reference"] = arch
    elif reference:
        models.reference = build_reference(make, arch, actor)
        models.archs["reference"] = arch
    if critic:
        models.critic = build_critic(cfg, make, arch, actor, updates, critic_source, frozen_rm)
        models.archs["critic"] = arch if critic_source is None else critic_source.arch
    if reward is not None:
        models.archs["reward"] = reward.arch
    if teacher is not None:
        models.teacher = make("teacher", teacher.arch, frozen=True, dtype=cfg.teacher.dtype)
        teacher.load_into(models.teacher)
        models.archs["teacher"] = teacher.arch
    return models


def build_trained_reward(
    cfg: RunConfig, arch: ModelArch, source_arch: ModelArch, *, gpu: bool, updates: int
) -> Models:
    """`algorithm.name: rm`: the reward model as the one trained role, built from `arch` (a
    classifier), its starting weights from `model.*` (whose files are `source_arch`)."""
    chunks = _maker(cfg, gpu)("reward", arch)
    load_initial_weights(cfg, source_arch, chunks, roles=("reward", "actor"))
    if not source_arch.score_head:
        init_score_head(chunks, arch, cfg.model.init_seed)
    opt, sched = _optimizer(cfg, chunks, cfg.optim, updates)
    full_precision_masters(cfg, source_arch, chunks, opt, roles=("reward", "actor"))
    return Models(reward=Trained(chunks, opt, sched), archs={"reward": arch})


def build_frozen_policy(cfg: RunConfig, arch: ModelArch, *, gpu: bool) -> Models:
    """`megarl eval`: the policy with its starting weights, frozen (no gradients, optimizer or
    DDP buffers), as the `reference` role; with `model.lora.init_from` the base with that PEFT
    adapter on it (the engine gets the merged weights)."""
    adapter = cfg.model.lora.init_from if cfg.model.lora.enabled else None
    chunks = _maker(cfg, gpu)("actor" if adapter else "reference", arch, frozen=True)
    load_initial_weights(cfg, arch, chunks)
    if adapter:
        load_peft(chunks, cfg.model.lora, adapter)
    return Models(reference=chunks, archs={"reference": arch})


def _maker(cfg: RunConfig, gpu: bool):
    build = BuildConfig(
        make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by,
        routing_replay=cfg.rollout.engine.routing_replay,
        expert_bias_update_rate=cfg.model.expert_bias_update_rate,
        lora=cfg.model.lora,
        critic_lora=cfg.model.critic_lora,
        lora_seed=cfg.trainer.seed,
    )

    def make(role: str, arch: ModelArch, frozen: bool | None = None, dtype=None) -> list:
        """`dtype`: the role's own (`teacher.dtype`), else `precision.dtype`."""
        precision = cfg.precision if dtype is None else replace(cfg.precision, dtype=dtype)
        if refused := packing_refusal(arch, packed=cfg.algorithm.pack_sequences):
            raise ConfigError(f"{role}: {refused}")
        if gpu and resolve_use_te(precision, build, gpu=gpu):
            import transformer_engine

            refused = te_attention_refusal(
                arch, packed=cfg.algorithm.pack_sequences, te_version=transformer_engine.__version__
            )
            if refused:
                raise ConfigError(f"{role}: {refused}")
        return build_model(
            arch, cfg.parallel, precision, role=role, build=build, gpu=gpu, frozen=frozen
        )

    return make


def build_actor(cfg: RunConfig, arch: ModelArch, make, updates: int) -> Trained:
    chunks = make("actor", arch)
    load_initial_weights(cfg, arch, chunks)
    if cfg.model.lora.init_from:
        load_peft(chunks, cfg.model.lora, cfg.model.lora.init_from)
    opt, sched = _optimizer(cfg, chunks, cfg.optim, updates)
    full_precision_masters(cfg, arch, chunks, opt)
    return Trained(chunks, opt, sched)


def _optimizer(cfg: RunConfig, chunks: list, optim, updates: int):
    """`build_optimizer` for chunks that hold their starting weights, at the run's precision."""
    prec = cfg.precision
    return build_optimizer(
        chunks, optim, dtype=prec.dtype, total_steps=updates, fp8_recipe=prec.active_fp8_recipe
    )


def build_reference(make, arch: ModelArch, actor: Trained) -> list:
    chunks = make("reference", arch)
    copy_weights(actor.chunks, chunks)  # the initial policy (resume loads the actor later)
    return chunks


def build_critic(
    cfg: RunConfig,
    make,
    arch: ModelArch,
    actor: Trained,
    updates: int,
    source: ModelFiles | None,
    reward: list | None,
) -> Trained:
    """From the actor's trunk (zero head), or from `source` (a reward model: trunk and head),
    copied from the run's frozen reward model when it is that model."""
    if source is None:
        chunks = make("critic", arch)
        copy_weights(actor.chunks, chunks)  # the actor's trunk; the value head starts at zero
    else:
        chunks = make("critic", source.arch)
        if reward is not None and source.key == "reward.model":
            copy_weights(reward, chunks)  # the same model at the same layout: no read
        else:
            source.load_into(chunks)
    opt, sched = _optimizer(cfg, chunks, cfg.critic_optim, updates)
    return Trained(chunks, opt, sched)


def build_reward(make, source: ModelFiles) -> list:
    """The frozen reward model of an RL run: `source`'s trunk and score head."""
    chunks = make("reward", source.arch, frozen=True)
    source.load_into(chunks)
    return chunks


@torch.no_grad()
def init_score_head(chunks: list, arch: ModelArch, seed: int) -> None:
    """A new score head drawn as transformers initialises `score` (normal(0,
    initializer_range)), from a generator seeded by `seed`: the same on every rank (the head is
    replicated over TP and DP)."""
    std = float(arch.hf_config.get("initializer_range", 0.02))
    for chunk in chunks:
        head = getattr(unwrap(chunk), "output_layer", None)
        if isinstance(head, ValueHead):
            g = torch.Generator().manual_seed(score_head_seed(seed))
            w = torch.empty(head.weight.shape, dtype=torch.float32).normal_(0.0, std, generator=g)
            head.weight.data.copy_(w.to(head.weight.device, head.weight.dtype))


def load_initial_weights(
    cfg: RunConfig, arch: ModelArch, chunks: list, roles: tuple[str, ...] = ("actor",), into=None
) -> None:
    """Load the starting weights into `chunks`, each rank reading only the shards it holds
    (`model.hf`: the HF tensors of its own parameters; `model.mcore_ckpt`: a sharded
    `dist_checkpointing` load of the first of `roles` the checkpoint holds; random init from
    `model.config`: `seeded_init`, the same model at every layout, so a run resumed at another
    layout rebuilds the same reference). `arch` describes the files. No rank holds the whole
    model; the reference and the critic trunk are then copied from the actor's shards. `into`:
    where each tensor goes instead of its parameter (`full_precision_masters`); not for
    `model.mcore_ckpt`, whose tensors are already in the parameters' dtype."""
    m = cfg.model
    if m.hf is None and m.mcore_ckpt is None:
        seeded_init(chunks, arch, m.init_seed, into)
    elif m.hf is not None:
        load_hf_sharded(chunks, arch, m.hf, into)
    elif m.mcore_ckpt is not None and into is None:
        load_into(chunks, open_checkpoint(m.mcore_ckpt, roles))


def full_precision_masters(
    cfg: RunConfig, arch: ModelArch, chunks: list, optimizer, roles: tuple[str, ...] = ("actor",)
) -> None:
    """16-bit training: the optimizer's fp32 master weights read again from the starting
    weights' source in its own precision (fp32 HF files, the fp32 random init), not copied from
    the 16-bit parameters (`megarl.models.optim.main_param_writer` says why). The parameters are
    unchanged: they stay the masters rounded to 16 bits (or quantized to FP8 with
    `precision.fp8_param`). Nothing to do with LoRA (the frozen base has no masters),
    `model.mcore_ckpt`, or HF files already in the parameters' dtype (the usual bf16 checkpoint,
    unless the parameters are FP8). Not collective."""
    if cfg.model.lora.enabled or cfg.model.mcore_ckpt is not None:
        return
    if cfg.model.hf is not None and not cfg.precision.fp8_param:
        files = LazyHFTensors(cfg.model.hf)
        if all(files.dtype(n) == cfg.precision.torch_dtype for n in files.names):
            return  # the parameters already hold the files' values exactly: no second read
    write = main_param_writer(optimizer)
    if write is not None:
        load_initial_weights(cfg, arch, chunks, roles, into=write)


# ---------------------------------------------------------------------- other models' sources
@dataclass(frozen=True)
class ModelSources:
    """The models an RL run reads besides the policy, described from their small files: none
    unless `reward.model` / `model.critic_init` (scalar heads, `megarl.rewards.model`) or
    `teacher.model` (`megarl.trainer.teacher`) name one."""

    reward: ModelFiles | None = None
    """The reward model of `reward.model`."""
    critic: ModelFiles | None = None
    """Where the PPO critic starts when not from the actor (`model.critic_init`)."""
    teacher: ModelFiles | None = None
    """The distillation teacher of `teacher.model`."""

    def archs(self) -> dict[str, ModelArch]:
        """{config key: architecture} of each, checked against the run's layout."""
        out = {s.key: s.arch for s in (self.reward, self.critic) if s is not None}
        if self.teacher is not None:
            out["teacher.model"] = self.teacher.arch
        return out


def model_sources(cfg: RunConfig) -> ModelSources:
    """The reward model, the critic's start and the teacher that `cfg` names (`ModelSources`).
    Collective when the teacher is a GGUF file."""
    rm = open_scalar_model(cfg.reward.model, "reward.model") if cfg.reward.model else None
    teacher = open_teacher(cfg) if cfg.algorithm.uses_teacher else None
    init = cfg.model.critic_init
    if cfg.algorithm.name != "ppo" or init == "actor":
        return ModelSources(rm, None, teacher)
    if init == "reward_model":
        return ModelSources(rm, rm, teacher)
    critic = open_scalar_model(init, "model.critic_init", ("reward", "critic"))
    return ModelSources(rm, critic, teacher)


def check_scalar_tokenizers(cfg: RunConfig, tokenizer, sources: ModelSources):
    """(the reward model's tokenizer, whether it is the policy's: `megarl.rewards.model`), or
    None without a reward model, after checking that a critic started from a reward model reads
    the policy's tokens."""
    rm, critic_from = sources.reward, sources.critic
    rm_tokenizer = same = None
    if rm is not None:
        rm_tokenizer, same = reward_tokenizer(rm, tokenizer)
        longest = cfg.data.max_prompt_length + cfg.rollout.sampling.max_tokens
        if same and longest > rm.arch.max_position_embeddings:
            raise ConfigError(
                f"data.max_prompt_length + rollout.sampling.max_tokens = {longest} exceeds the "
                f"max_position_embeddings of reward.model ({rm.arch.max_position_embeddings})"
            )
        if dist.get_rank() == 0:
            log.info(
                "reward.model: %s",
                "the policy's tokenizer: scores the generated ids"
                if same
                else "another tokenizer: re-tokenizes prompt and response text",
            )
    if critic_from is not None:
        theirs = rm_tokenizer if critic_from is rm else reward_tokenizer(critic_from, tokenizer)[0]
        if not same_vocabulary(theirs, tokenizer):
            raise ConfigError(
                f"model.critic_init={cfg.model.critic_init!r}: {critic_from.describe()} uses "
                f"another tokenizer ({len(theirs)} tokens vs the policy's {len(tokenizer)}, or "
                "other ids); the critic gives a value per policy token, so it needs the "
                "policy's vocabulary. Accepted: a reward model trained with the policy's "
                "tokenizer, or model.critic_init=actor"
            )
    return None if rm is None else (rm_tokenizer, same)


def build_reward_model(
    cfg: RunConfig,
    models: Models,
    sources: ModelSources,
    rm_tokenizer,
    groups: Groups,
    pad_to: int,
) -> RewardModel | None:
    """The `RewardModel` that scores samples with `models.reward`; None without `reward.model`.
    `rm_tokenizer`: (its tokenizer, whether it is the policy's: `check_scalar_tokenizers`)."""
    if sources.reward is None:
        return None
    return RewardModel(
        models.reward,
        sources.reward.arch,
        rm_tokenizer[0],
        reuse_ids=rm_tokenizer[1],
        cfg=cfg,
        groups=groups,
        pad_to=pad_to,
    )
