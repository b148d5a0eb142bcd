"""Everything one training run holds, built once: topology, models by role (`Models`), the
colocated rollout engine and its weight sync (`RolloutParts`), data (`Data`), reward functions,
logging, and resume.

Each part has one builder below; `Run.create` is the RL run's sequence of them, checking
everything a user can get wrong before any model or engine exists. A run that needs no engine
builds models, data and logging only. Process groups come from the topology and are passed down
explicitly.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import logging
import os
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import yaml

from megarl.config import ConfigError, RunConfig, to_dict
from megarl.distributed import Topology, device
from megarl.distributed.topology import Groups, TopologyError
from megarl.metrics.sinks import set_aside_previous_run
from megarl.models.forward import sequence_multiple
from megarl.models.hf_config import ModelArch, arch_from_hf
from megarl.trainer import checkpoint
from megarl.trainer.evaluate import Evaluator, check_eval
from megarl.trainer.faults import attempt_store, collective_timeout
from megarl.trainer.model_source import keep_tokenizer, resolve_model
from megarl.trainer.models import (
    Models,
    build_models,
    build_scorer,
    check_scalar_tokenizers,
    scalar_sources,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from megarl.data.dataset import PromptDataset
    from megarl.data.offline import PreferenceDataset, SFTDataset
    from megarl.data.sampler import PromptSampler
    from megarl.metrics.sinks import MetricsLogger
    from megarl.rewards.model import RewardModel
    from megarl.rollout.dispatch import RolloutDispatcher
    from megarl.rollout.engine import RolloutEngine
    from megarl.rollout.weight_sync import WeightSync

log = logging.getLogger("megarl")


def init_distributed(timeout: datetime.timedelta | None = None) -> tuple[int, int]:
    """torch.distributed from torchrun's environment, or a one-process group when run plainly.
    `timeout`: of every collective on the default group (None: torch's default;
    `megarl.trainer.faults.collective_timeout` keeps it above the hang watchdog's)."""
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            from megarl.distributed.launch import free_port

            os.environ.update(
                RANK="0",
                WORLD_SIZE="1",
                LOCAL_RANK="0",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(free_port()),
            )
        device.setup()
        _checkpoint_queue()  # before the group's sockets exist: the forked manager holds none
        dist.init_process_group(device.backend(), timeout=timeout, **attempt_store(timeout))
    _checkpoint_queue()  # a group made by the caller (made once: a no-op after the one above)
    return dist.get_rank(), dist.get_world_size()


def _checkpoint_queue() -> None:
    """On CPU, megatron's checkpoint-writer queue forked before any model exists (its
    docstring says why)."""
    if not device.use_gpu():
        from megarl.convert.checkpoint import fork_write_results_queue

        fork_write_results_queue()


def load_arch(cfg: RunConfig, roles: tuple[str, ...] = ("actor",)) -> ModelArch:
    """The model's architecture from its small files: `model.config`, `model.hf`'s config.json
    (a GGUF file not converted yet, as in a dry run: its metadata), or the checkpoint of
    `model.mcore_ckpt` (its first role of `roles`; `megarl.convert.source`)."""
    m = cfg.model
    if m.config is not None:
        return arch_from_hf(m.config, where="model.config")
    if m.hf is not None:
        if os.path.isfile(m.hf):
            from megarl.convert.gguf import gguf_hf_config

            return arch_from_hf(gguf_hf_config(m.hf), where=f"model.hf={m.hf}")
        return arch_from_hf(m.hf)
    from megarl.convert.source import open_checkpoint

    return open_checkpoint(m.mcore_ckpt, roles).arch


def load_tokenizer(cfg: RunConfig, out_dir: str):
    from megarl.data.tokenizer import load_tokenizer as load
    from megarl.data.toy import toy_tokenizer

    path = cfg.model.tokenizer or cfg.model.hf or cfg.model.mcore_ckpt
    if path == "toy":
        return toy_tokenizer(os.path.join(out_dir, "tokenizer") if dist.get_rank() == 0 else None)
    if path is None:
        raise ConfigError(
            "model.tokenizer is required when the model comes from model.config; accepted: a "
            "tokenizer directory or 'toy'"
        )
    tokenizer = load(path)
    if dist.get_rank() == 0:  # kept beside the checkpoints, for exports (`keep_tokenizer`)
        keep_tokenizer(tokenizer, path, out_dir)
    return tokenizer


@dataclass
class RolloutParts:
    """The colocated generation side: this rank's vLLM engine, the weight sync from the actor's
    shards into it, and the dispatcher that has each prompt generated once."""

    engine: RolloutEngine
    sync: WeightSync
    dispatcher: RolloutDispatcher

    def sync_weights(self) -> dict:
        """Push the actor's weights into this rank's vLLM engine (collective).

        The engine slept after generating (GPU: its weights and KV cache were freed while the
        trainer used the memory): release the trainer's cached blocks, wake the weights, write
        them (the sync also drops vLLM's prefix cache, computed with the old weights), then wake
        the KV cache."""
        torch.cuda.empty_cache()  # a no-op on CPU
        stats = self.sync.sync()  # wakes the engine's weights before writing them
        self.engine.wake_up(["kv_cache"])
        return stats


@dataclass
class Data:
    """The training rows and the resumable order this DP rank reads them in."""

    dataset: PromptDataset | SFTDataset | PreferenceDataset
    sampler: PromptSampler
    held_out: PromptDataset | SFTDataset | PreferenceDataset | None = None
    """The held-out rows of `eval` (removed from `dataset`; RL: prompts evaluated through the
    engine, offline stages: rows evaluated by forward passes); None without eval.path /
    eval.fraction (`megarl.data.split`)."""


@dataclass
class Run:
    cfg: RunConfig
    out_dir: str
    topo: Topology
    groups: Groups
    arch: ModelArch
    tokenizer: PreTrainedTokenizerBase
    models: Models
    data: Data
    logger: MetricsLogger
    rollout: RolloutParts | None = None
    """The generation side; None for a run that builds no engine."""
    reward_fns: list = field(default_factory=list)
    """The loaded `reward.functions`, in order."""
    reward_model: RewardModel | None = None
    """Scores samples with `models.reward` (`reward.model`); None without a reward model."""
    evaluator: Evaluator | None = None
    """Held-out evaluation through the rollout engine; None without held-out prompts."""
    resume: tuple[str, dict] | None = None
    """(checkpoint directory, its trainer state) to resume from, read and checked in create."""
    step: int = 0
    bad_steps: int = 0

    # ------------------------------------------------------------------ construction
    @staticmethod
    def create(cfg: RunConfig, out_dir: str) -> Run:
        """The RL run: every check a user's input can fail, then models, engine and logging."""
        rank, world = init_distributed()
        check_paths(cfg)
        user_model = cfg.model  # config.yaml keeps what the user wrote (e.g. the GGUF file)
        cfg = resolve_model(cfg)  # GGUF -> cached HF dir (rank 0), run dir -> its checkpoint
        arch = load_arch(cfg)
        check_policy_arch(cfg, arch)
        _check_rollout_length(cfg, arch)
        check_eval(cfg, arch)
        rm, critic_from = scalar_sources(cfg)  # reward model, critic start: small files only
        others = {s.key: s.arch for s in (rm, critic_from) if s is not None}
        topo, groups = build_topology(cfg, arch, world, out_dir, others)
        tokenizer = load_tokenizer(cfg, out_dir)
        gpu = device.use_gpu()
        # everything a user can get wrong is checked before the models and the engine exist
        rm_tokenizer = check_scalar_tokenizers(cfg, tokenizer, rm, critic_from)
        cfg = _resolve_rollout(cfg, arch, tokenizer, gpu)
        data = build_data(cfg, tokenizer, groups)
        reward_fns = _reward_functions(cfg)
        _check_model_files(cfg, arch)
        a = cfg.algorithm
        roles = {"actor": arch}  # the trained roles and what each is built from
        if a.name == "ppo":
            roles["critic"] = critic_from.arch if critic_from is not None else arch
        resume = _resume_state(cfg, out_dir, arch, data.sampler, roles)
        if resume is None and rank == 0:  # starting at step 0: an earlier attempt's logs go aside
            set_aside_previous_run(out_dir)
        write_config(dataclasses.replace(cfg, model=user_model), out_dir)
        models = build_models(
            cfg,
            arch,
            gpu=gpu,
            updates=cfg.trainer.steps * a.ppo_epochs * a.mini_batches,
            reference=a.needs_reference,
            critic=a.name == "ppo",
            reward=rm,
            critic_source=critic_from,
        )
        rollout = build_rollout(cfg, arch, models.actor.chunks, groups, out_dir)
        run = Run(
            cfg=cfg,
            out_dir=out_dir,
            topo=topo,
            groups=groups,
            arch=arch,
            tokenizer=tokenizer,
            models=models,
            data=data,
            logger=build_logger(cfg, out_dir),
            rollout=rollout,
            reward_fns=reward_fns,
            reward_model=build_scorer(cfg, models, rm, rm_tokenizer, groups),
            evaluator=Evaluator.create(
                cfg, data.held_out, rollout.dispatcher, tokenizer, reward_fns, groups
            ),
            resume=resume,
        )
        run.maybe_resume()
        run.rollout.sync_weights()
        return run

    # ------------------------------------------------------------------ checkpoints
    def trainer_state(self) -> dict:
        m = self.models
        state = {
            "step": self.step,
            "sampler": self.data.sampler.state_dict(),
            "arch": self.arch.hf_config,
        }
        for role, model in m.trained().items():
            state[f"{role}_sched"] = model.sched.state_dict()
        archs = {
            r: a.hf_config
            for r, a in m.archs.items()
            if r in m.trained() and a.hf_config != self.arch.hf_config
        }
        if archs:  # roles built from another model (a critic from a reward model)
            state["archs"] = archs
        if self.reward_model is not None and self.reward_model.state_dict() is not None:
            state["reward_model_stats"] = self.reward_model.state_dict()
        return state

    def save(self) -> str:
        path = checkpoint.save(
            self.out_dir,
            self.step,
            self.models.checkpointed(),
            self.trainer_state(),
            keep_last=self.cfg.trainer.keep_last,
            tokenizer_dir=os.path.join(self.out_dir, "tokenizer"),
        )
        log.info("saved checkpoint %s", path)
        return path

    def maybe_resume(self) -> None:
        if self.resume is None:  # a fresh start: what an earlier attempt logged here goes
            self.logger.truncate_after(-1)
            return
        path, state = self.resume
        m = self.models
        checkpoint.load_models(path, m.checkpointed())
        torch.set_rng_state(state["torch_rng"])
        self.step = state["step"]
        self.data.sampler.load_state_dict(state["sampler"])
        for role, model in m.trained().items():
            model.sched.load_state_dict(state[f"{role}_sched"])
        if self.reward_model is not None:
            self.reward_model.load_state_dict(state.get("reward_model_stats"))
        self.logger.truncate_after(self.step)
        log.info("resumed from %s at step %d", path, self.step)

    @property
    def pad_id(self) -> int:
        """The token that pads sequences: the tokenizer's pad, else its EOS, else 0."""
        tok = self.tokenizer
        return tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)

    @property
    def pad_to(self) -> int:
        """Sequences are padded to a multiple of this (sequence parallelism, FP8 recipes)."""
        prec = self.cfg.precision
        return sequence_multiple(
            self.groups.tp_size, self.cfg.parallel.sequence_parallel, prec.fp8 and prec.fp8_recipe
        )

    def close(self) -> None:
        self.logger.close()


# ---------------------------------------------------------------------- the builders
def _check_rollout_length(cfg: RunConfig, arch: ModelArch) -> None:
    longest = cfg.data.max_prompt_length + cfg.rollout.max_tokens
    if longest > arch.max_position_embeddings:
        raise ConfigError(
            f"data.max_prompt_length ({cfg.data.max_prompt_length}) + rollout.max_tokens "
            f"({cfg.rollout.max_tokens}) = {longest} exceeds the model's "
            f"max_position_embeddings ({arch.max_position_embeddings})"
        )


def build_topology(
    cfg: RunConfig, arch: ModelArch, world: int, out_dir: str, others: dict | None = None
) -> tuple[Topology, Groups]:
    """Check the layout for `world` ranks (naming the `parallel` section) against the model and
    the `others` ({config key: ModelArch}: a reward model, a critic's start, built at the same
    layout), create the run directory and megatron's process groups."""
    rank = dist.get_rank()
    try:
        topo = Topology.for_model(cfg.parallel, world, arch)
        topo.check_training(arch)
    except TopologyError as e:  # name the config section
        raise TopologyError(f"parallel: {e}") from e
    for key, other in (others or {}).items():
        try:
            Topology.for_model(cfg.parallel, world, other).check_training(other)
        except TopologyError as e:
            raise TopologyError(f"{key}: parallel: {e} (it is built at the run's layout)") from e
    slow = None if device.use_gpu() else device.cpu_half_precision_note(cfg.precision.dtype)
    if slow and rank == 0:
        log.warning(slow)
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
    return topo, topo.initialize(seed=cfg.model.init_seed, timeout=collective_timeout(cfg.trainer))


def write_config(cfg: RunConfig, out_dir: str) -> None:
    """The resolved config as `out_dir/config.yaml` (rank 0)."""
    if dist.get_rank() == 0:
        _write_yaml(os.path.join(out_dir, "config.yaml"), to_dict(cfg))


def build_logger(cfg: RunConfig, out_dir: str) -> MetricsLogger:
    """metrics.jsonl on rank 0, and wandb / tensorboard as `logging` asks."""
    from megarl.metrics.sinks import MetricsLogger

    lg = cfg.logging
    wandb_cfg = None
    if lg.wandb and lg.wandb_mode != "disabled":
        wandb_cfg = {
            "mode": os.environ.get("WANDB_MODE", lg.wandb_mode),
            "project": lg.wandb_project,
            "config": to_dict(cfg),
            "dir": out_dir,
        }
    return MetricsLogger(
        out_dir, rank=dist.get_rank(), wandb_cfg=wandb_cfg, tensorboard=lg.tensorboard
    )


def _write_yaml(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        yaml.safe_dump(data, f, sort_keys=False)
    os.replace(tmp, path)


def check_policy_arch(cfg: RunConfig, arch: ModelArch) -> None:
    """The trained policy needs an LM head: a reward model (a sequence classifier) is refused."""
    if arch.score_head:
        m = cfg.model
        key, path = next(
            (k, v)
            for k, v in (
                ("model.hf", m.hf),
                ("model.mcore_ckpt", m.mcore_ckpt),
                ("model.config", "inline"),
            )
            if v
        )
        raise ConfigError(
            f"{key}={path!r} is a reward model (a score head, no LM head), not a policy; use it "
            "as reward.model or model.critic_init, or train it with algorithm.name=rm"
        )


def check_paths(cfg: RunConfig) -> None:
    """Fail (`ConfigError` naming the key) when a file or directory the config names is absent:
    before anything is read or built, and before a deeper error could name only the file."""
    m, d = cfg.model, cfg.data
    dirs = {
        "model.mcore_ckpt": (
            m.mcore_ckpt,
            "a trainer checkpoint RUN/checkpoints/step_N, a run directory RUN, or a directory "
            "from `megarl convert hf-to-mcore`",
        ),
        "model.tokenizer": (
            None if m.tokenizer == "toy" else m.tokenizer,
            "a tokenizer directory (tokenizer.json / tokenizer_config.json) or 'toy'",
        ),
    }
    for key, (path, accepted) in dirs.items():
        if path is not None and not os.path.isdir(path):
            what = "is not a directory" if os.path.exists(path) else "does not exist"
            raise ConfigError(f"{key}={path!r} {what}; accepted: {accepted}")
    if m.hf is not None and not os.path.isdir(m.hf):
        from megarl.convert.gguf import is_gguf

        if not is_gguf(m.hf):
            what = "is not a directory or a GGUF file" if os.path.exists(m.hf) else "does not exist"
            raise ConfigError(
                f"model.hf={m.hf!r} {what}; accepted: a Hugging Face model directory "
                "(config.json + *.safetensors) or a GGUF file (.gguf, converted once into "
                "MEGARL_CACHE)"
            )
    if d.path is not None and not d.path.startswith("hf:") and not os.path.exists(d.path):
        raise ConfigError(
            f"data.path={d.path!r} does not exist; accepted: a .jsonl/.json/.parquet/.arrow "
            "file, a directory of them, 'hf:NAME[:SPLIT]', or null for the toy task"
        )


def _check_model_files(cfg: RunConfig, arch: ModelArch) -> None:
    """What the initial weights are read from, checked from headers and metadata only (cheap):
    the HF tensor names and shapes against `arch`, or the megatron checkpoint's metadata."""
    m = cfg.model
    if m.hf is not None:
        from megarl.convert.hf_io import LazyHFTensors
        from megarl.convert.mapping import check_hf_names

        lazy = LazyHFTensors(m.hf)
        check_hf_names(arch, lazy.names, shape_of=lazy.shape)
    elif m.mcore_ckpt is not None:
        from megarl.convert.checkpoint import check_dcp_metadata

        check_dcp_metadata(m.mcore_ckpt)


def _resume_state(cfg: RunConfig, out_dir: str, arch: ModelArch, sampler, roles: dict):
    """(newest complete checkpoint of `out_dir`, its trainer state), or None when there is none
    or `trainer.resume` is off (damaged ones are skipped: `checkpoint.resumable`). Its small
    files are read and checked now, before the models exist: the model config (and that of
    each trained role, `roles` {role: ModelArch}), the data order, that its metadata is safe to
    unpickle and that its tensor files are whole."""
    if not cfg.trainer.resume:
        return None
    return checkpoint.resumable(
        out_dir, lambda path, state: _check_resumable(cfg, path, state, arch, sampler, roles)
    )


def _changed(a: dict, b: dict) -> list[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def _check_resumable(
    cfg: RunConfig, path: str, state: dict, arch: ModelArch, sampler, roles: dict
) -> None:
    if state["arch"] != arch.hf_config:
        raise checkpoint.CheckpointError(
            f"checkpoint {path} was written for a different model config (differs in "
            f"{_changed(state['arch'], arch.hf_config)[:8]}); resume with the same model, or use "
            "a new run directory (--out) or trainer.resume=false"
        )
    for role, role_arch in roles.items():
        if f"{role}_sched" not in state:
            has = sorted(k[: -len("_sched")] for k in state if k.endswith("_sched"))
            raise checkpoint.CheckpointError(
                f"checkpoint {path} holds no {role} (it trained {has}) but algorithm.name="
                f"{cfg.algorithm.name} trains one; resume with the algorithm that wrote it, or "
                "use a new run directory (--out)"
            )
        written = (state.get("archs") or {}).get(role, state["arch"])
        if written != role_arch.hf_config:
            raise checkpoint.CheckpointError(
                f"checkpoint {path}: its {role} was built from another model (differs in "
                f"{_changed(written, role_arch.hf_config)[:8]}); keep model.critic_init as it "
                "was, or use a new run directory (--out)"
            )
    try:  # on a copy: the run's sampler takes the state in maybe_resume, with the rest
        copy.copy(sampler).load_state_dict(state["sampler"])
    except ValueError as e:
        raise checkpoint.CheckpointError(
            f"checkpoint {path} cannot continue this run's prompt order: {e}; keep data.* as it "
            "was, or use a new run directory (--out) or trainer.resume=false"
        ) from e


def _resolve_rollout(cfg: RunConfig, arch: ModelArch, tokenizer, gpu: bool) -> RunConfig:
    """`cfg` with the rollout's stop tokens resolved (None = the model's EOS ids), after
    checking that vLLM is importable and that its KV cache can hold one whole sequence."""
    from megarl.rollout.checks import check_kv_cache, require_vllm
    from megarl.rollout.routes import check_routing_replay
    from megarl.rollout.stop_tokens import resolve_stop_tokens

    dirs = [d for d in (cfg.model.hf, cfg.model.tokenizer, cfg.model.mcore_ckpt) if d]
    stop = resolve_stop_tokens(cfg.rollout.stop_token_ids, tokenizer, arch.hf_config, dirs)
    if cfg.rollout.stop_token_ids is None:
        log.info("rollout.stop_token_ids: %s (the model's EOS ids)", list(stop) or "none found")
    rollout = dataclasses.replace(cfg.rollout, stop_token_ids=stop)
    check_kv_cache(arch, rollout, dtype=cfg.precision.dtype, gpu=gpu)
    check_routing_replay(arch, rollout)
    require_vllm()
    return dataclasses.replace(cfg, rollout=rollout)


def build_rollout(
    cfg: RunConfig, arch: ModelArch, actor: list, groups: Groups, out_dir: str
) -> RolloutParts:
    """An engine on every rank: SPMD (external_launcher, its own TP) on GPU; on CPU a TP=1
    engine per rank that receives the full model. The dispatcher has each prompt generated
    once, by the engines of its model-parallel group."""
    from megarl.rollout.dispatch import RolloutDispatcher
    from megarl.rollout.engine import RolloutEngine
    from megarl.rollout.weight_sync import WeightSync

    # vLLM reads the model's config.json from a directory on every node: the first rank of
    # each node writes it (the same bytes; atomic per writer, so a shared run directory is fine)
    model_dir = os.path.join(out_dir, "rollout_model")
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        os.makedirs(model_dir, exist_ok=True)
        tmp = os.path.join(model_dir, f".config.json.{socket.gethostname()}.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            json.dump(dict(arch.hf_config), f, indent=1)
        os.replace(tmp, os.path.join(model_dir, "config.json"))
    dist.barrier()
    engine = RolloutEngine(model_dir, arch, cfg.rollout, dtype=cfg.precision.dtype)
    sync = WeightSync(actor, arch, engine, groups)
    return RolloutParts(engine, sync, RolloutDispatcher(engine, groups.dp_rank))


def build_data(cfg: RunConfig, tokenizer, groups: Groups) -> Data:
    """Training prompts, their resumable order on this DP rank, and the held-out prompts."""
    from megarl.data.sampler import PromptSampler
    from megarl.data.split import prompt_sets

    dataset, held_out = prompt_sets(cfg.data, cfg.eval, tokenizer)
    sampler = PromptSampler(
        len(dataset),
        prompts_per_step=cfg.data.prompts_per_step,
        dp_rank=groups.dp_rank,
        dp_size=groups.dp_size,
        seed=cfg.data.seed,
        shuffle=cfg.data.shuffle,
    )
    return Data(dataset, sampler, held_out)


def _reward_functions(cfg: RunConfig) -> list:
    from megarl.rewards import RewardFunctionError, load_reward_function

    fns = []
    for i, spec in enumerate(cfg.reward.functions):
        kwargs = cfg.reward.kwargs.get(spec, {})
        try:
            fns.append(load_reward_function(spec, **kwargs))
        except RewardFunctionError as e:
            raise RewardFunctionError(f"reward.functions[{i}]: {e}") from e
    return fns
