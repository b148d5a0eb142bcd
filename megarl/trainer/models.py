"""The run's megatron models by role (`Models`), each built by one function of its role.

- actor: the policy the run trains (RL, SFT, DPO), from `model.*`;
- reference: frozen chunks of the initial policy (the KL term, DPO);
- critic (PPO): trainable, with a scalar value head; from the actor's trunk and a zero head
  (`model.critic_init: actor`), or from a reward model's trunk and score head
  (`model.critic_init: reward_model` or a directory; then its shape is that model's);
- reward: a reward model (a scalar score head), frozen and resident in an RL run that scores
  with it (`reward.model`; its shape may differ from the actor's), or the trained role of
  `algorithm.name: rm` (from `model.*`: a reward model's trunk and head, or a causal LM's trunk
  and a new head drawn as transformers initialises one, normal(0, initializer_range)).

Every model is sharded by the run's one topology (the same TP / PP / DP); each rank reads only
its own shards. Starting weights load before a model's optimizer is built (a
DistributedOptimizer copies the parameters when it is made).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megarl.config import ConfigError, RunConfig
from megarl.convert.sharded import copy_weights
from megarl.models.builder import BuildConfig, ValueHead, build_model, unwrap
from megarl.models.hf_config import ModelArch
from megarl.models.optim import build_optimizer

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megarl.distributed.topology import Groups
    from megarl.rewards.model import ScalarModelSource

log = logging.getLogger("megarl")
ROLE_ORDER = ("actor", "reference", "critic", "reward")


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
    """Frozen chunks of the initial policy (the KL term); None when nothing reads it."""
    critic: Trained | None = None
    """The value model (PPO): a trunk with a scalar head."""
    reward: Trained | list | None = None
    """The reward model (a scalar score head on the last pipeline stage): frozen chunks when an
    RL run scores with it, `Trained` when `algorithm.name: rm` trains it; None without one."""
    archs: dict[str, ModelArch] = field(default_factory=dict)
    """{role: the architecture it was built from} for every role built."""

    def trained(self) -> dict[str, Trained]:
        """{role: model} of the models with an optimizer, in role order."""
        return {r: m for r in ROLE_ORDER if isinstance(m := getattr(self, r), Trained)}

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
    reward: ScalarModelSource | None = None,
    critic_source: ScalarModelSource | None = None,
) -> Models:
    """The actor (with its starting weights), and the reference / critic / reward model when
    asked, each built by its role's function. `updates`: optimizer steps the LR schedules span;
    `reward`: the frozen reward model's source; `critic_source`: where the critic starts when
    not from the actor (`model.critic_init`)."""
    make = _maker(cfg, gpu)
    actor = build_actor(cfg, arch, make, updates)
    frozen_rm = build_reward(make, reward) if reward is not None else None
    models = Models(actor=actor, reward=frozen_rm, archs={"actor": arch})
    if reference:
        models.reference = build_reference(make, arch, actor)
        models.archs["reference"] = arch
    if critic:
        models.critic = build_critic(cfg, make, arch, actor, updates, critic_source, frozen_rm)
        models.archs["critic"] = arch if critic_source is None else critic_source.arch
    if reward is not None:
        models.archs["reward"] = reward.arch
    return models


def build_trained_reward(
    cfg: RunConfig, arch: ModelArch, source_arch: ModelArch, *, gpu: bool, updates: int
) -> Models:
    """`algorithm.name: rm`: the reward model as the one trained role, built from `arch` (a
    classifier), its starting weights from `model.*` (whose files are `source_arch`)."""
    chunks = _maker(cfg, gpu)("reward", arch)
    _initial_state(cfg, source_arch, chunks, roles=("reward", "actor"))
    if not source_arch.score_head:
        init_score_head(chunks, arch, cfg.model.init_seed)
    opt, sched = build_optimizer(chunks, cfg.optim, dtype=cfg.precision.dtype, total_steps=updates)
    return Models(reward=Trained(chunks, opt, sched), archs={"reward": arch})


def _maker(cfg: RunConfig, gpu: bool):
    build = BuildConfig(
        make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by,
        routing_replay=cfg.rollout.routing_replay,
    )

    def make(role: str, arch: ModelArch, frozen: bool | None = None) -> list:
        return build_model(
            arch, cfg.parallel, cfg.precision, role=role, build=build, gpu=gpu, frozen=frozen
        )

    return make


def build_actor(cfg: RunConfig, arch: ModelArch, make, updates: int) -> Trained:
    chunks = make("actor", arch)
    _initial_state(cfg, arch, chunks)
    opt, sched = build_optimizer(chunks, cfg.optim, dtype=cfg.precision.dtype, total_steps=updates)
    return Trained(chunks, opt, sched)


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
    source: ScalarModelSource | None,
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
    opt, sched = build_optimizer(
        chunks, cfg.critic_optim, dtype=cfg.precision.dtype, total_steps=updates
    )
    return Trained(chunks, opt, sched)


def build_reward(make, source: ScalarModelSource) -> list:
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
            g = torch.Generator().manual_seed(seed * 1_000_003 + 17)
            w = torch.empty(head.weight.shape, dtype=torch.float32).normal_(0.0, std, generator=g)
            head.weight.data.copy_(w.to(head.weight.device, head.weight.dtype))


def _initial_state(
    cfg: RunConfig, arch: ModelArch, chunks: list, roles: tuple[str, ...] = ("actor",)
) -> None:
    """Load the starting weights into `chunks`, each rank reading only the shards it holds
    (`model.hf`: the HF tensors of its own parameters; `model.mcore_ckpt`: a sharded
    `dist_checkpointing` load of the first of `roles` the checkpoint holds; random init from
    `model.config`: `seeded_init`, the same model at every layout, so a run resumed at another
    layout rebuilds the same reference). `arch` describes the files. No rank holds the whole
    model; the reference and the critic trunk are then copied from the actor's shards."""
    m = cfg.model
    if m.hf is None and m.mcore_ckpt is None:
        from megarl.convert.sharded import seeded_init

        seeded_init(chunks, arch, m.init_seed)
    elif m.hf is not None:
        from megarl.convert.sharded import load_hf_sharded

        load_hf_sharded(chunks, arch, m.hf)
    elif m.mcore_ckpt is not None:
        from megarl.checkpoint.reader import load_into, open_checkpoint

        load_into(chunks, open_checkpoint(m.mcore_ckpt, roles))


# ---------------------------------------------------------------------- scalar models' sources
def scalar_sources(cfg: RunConfig) -> tuple[ScalarModelSource | None, ScalarModelSource | None]:
    """(the reward model of `reward.model`, where the PPO critic starts when not from the
    actor: `model.critic_init`), described from their small files (`megarl.rewards.model`)."""
    from megarl.rewards.model import open_scalar_model

    rm = open_scalar_model(cfg.reward.model, "reward.model") if cfg.reward.model else None
    init = cfg.model.critic_init
    if cfg.algorithm.name != "ppo" or init == "actor":
        return rm, None
    if init == "reward_model":
        return rm, rm
    return rm, open_scalar_model(init, "model.critic_init", ("reward", "critic"))


def check_scalar_tokenizers(cfg: RunConfig, tokenizer, rm, critic_from):
    """(the reward model's tokenizer, whether it is the policy's: `megarl.rewards.model`), or
    None without a reward model, after checking that a critic started from a reward model reads
    the policy's tokens."""
    from megarl.rewards.model import reward_tokenizer, same_vocabulary

    rm_tokenizer = same = None
    if rm is not None:
        rm_tokenizer, same = reward_tokenizer(rm, tokenizer)
        longest = cfg.data.max_prompt_length + cfg.rollout.max_tokens
        if same and longest > rm.arch.max_position_embeddings:
            raise ConfigError(
                f"data.max_prompt_length + rollout.max_tokens = {longest} exceeds the "
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


def build_scorer(cfg: RunConfig, models: Models, rm, rm_tokenizer, groups: Groups):
    """The `RewardModel` that scores with `models.reward`; None without `reward.model`.
    `rm_tokenizer`: (its tokenizer, whether it is the policy's)."""
    if rm is None:
        return None
    from megarl.models.forward import sequence_multiple
    from megarl.rewards.model import RewardModel

    prec = cfg.precision
    pad_to = sequence_multiple(
        groups.tp_size, cfg.parallel.sequence_parallel, prec.fp8 and prec.fp8_recipe
    )
    return RewardModel(
        models.reward,
        rm.arch,
        rm_tokenizer[0],
        reuse_ids=rm_tokenizer[1],
        cfg=cfg,
        groups=groups,
        pad_to=pad_to,
    )
