"""One recipe builds every run: RL training, an offline stage, an evaluation (`build_run`).

The order fails early: everything a user's input can get wrong is checked before any model or
engine exists, and nothing is built twice.

paths -> where the model comes from (GGUF -> cached HF directory, run dir -> its checkpoint) ->
the model's architecture -> the stage's config checks -> the layout (before any megatron group
exists) -> tokenizer -> the architecture the stage builds -> every data row -> the stage's
resolved config (offline: steps from epochs; with an engine: stop tokens, KV cache) -> reward
functions -> the multi-turn environment (one built), its chat format and tool parser -> the
weight files' headers -> the checkpoint to resume from -> `config.yaml`; then
the models, the rollout engine and its weight sync (stages with an engine; with an environment
the multi-turn rollout on them), the scorer, the
evaluator and logging, the checkpoint's state, the models' start-up invariants
(`megarl.trainer.invariants`), and the engine's first weights.

What differs per stage is what `megarl.trainer.stages.Stage` says; the parts built live in
`megarl.trainer.run.Run`.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os

import torch
import torch.distributed as dist
import yaml

from megarl import rollout as rollout_api
from megarl.checkpoint import vetting
from megarl.checkpoint.files import CheckpointError
from megarl.checkpoint.vetting import check_dcp_metadata
from megarl.config import ConfigError, RunConfig, to_dict
from megarl.convert.gguf import is_gguf
from megarl.convert.hf_io import LazyHFTensors
from megarl.convert.mapping import check_hf_names
from megarl.data.sampler import PromptSampler
from megarl.data.tokenizer import load_tokenizer as load_tokenizer_dir
from megarl.data.toy import toy_tokenizer
from megarl.distributed import Topology, device
from megarl.distributed.placement import Job, JobPlacement
from megarl.distributed.process_group import init_distributed
from megarl.distributed.topology import Groups, TopologyError
from megarl.metrics.sinks import MetricsLogger, set_aside_previous_run, wandb_mode
from megarl.models.hf_config import ModelArch
from megarl.rewards.scorer import Scorer, load_functions
from megarl.trainer.evaluate import Evaluator
from megarl.trainer.faults import collective_timeout
from megarl.trainer.invariants import check_models
from megarl.trainer.judge import find_judge, open_judge
from megarl.trainer.model_source import keep_tokenizer, load_arch, resolve_model
from megarl.trainer.models import build_reward_model, check_scalar_tokenizers
from megarl.trainer.run import Data, Run
from megarl.trainer.stages import Stage
from megarl.trainer.teacher import check_teacher

log = logging.getLogger("megarl")


def build_run(cfg: RunConfig, out_dir: str, stage: Stage, job: Job | None = None) -> Run:
    """The run of `stage` from `cfg`, writing into `out_dir` (module docstring); `job`: where
    this process is in the job (None: the default process group's world as it is, every rank
    training). The caller owns the run (`with build_run(...) as run:`). Collective."""
    job = job or init_distributed()
    rank, world = job.placement.rank, job.placement.world
    check_paths(cfg)
    user_model = cfg.model  # config.yaml keeps what the user wrote (e.g. the GGUF file)
    cfg = resolve_model(cfg, stage.sources)
    source_arch = load_arch(cfg, stage.sources)  # what model.* holds
    stage.check(cfg, source_arch)
    sources = stage.model_sources(cfg)  # a reward model, a critic's start, a teacher: small files
    topo, groups = build_topology(cfg, source_arch, world, out_dir, sources.archs())
    tokenizer = load_tokenizer(cfg, out_dir)
    arch = stage.model_arch(source_arch, tokenizer)  # what the stage builds (a reward model)
    if stage.role == "actor":
        check_policy_arch(cfg, arch)
    rm_tokenizer = check_scalar_tokenizers(cfg, tokenizer, sources)
    if sources.teacher is not None:
        check_teacher(cfg, sources.teacher, tokenizer)
    judge_files = find_judge(cfg, gpu=device.use_gpu()) if stage.engine else None
    data = build_data(cfg, stage, tokenizer, groups, arch)
    cfg = stage.resolve(cfg, data.dataset)
    if stage.engine:
        cfg = resolve_rollout(cfg, arch, tokenizer, device.use_gpu())
    functions = load_functions(cfg.reward) if stage.engine else []
    trajectories = None  # loaded (one environment built) before any model, so it fails early
    if stage.engine and cfg.env.multi_turn:
        trajectories = rollout_api.load_trajectories(cfg.env, tokenizer)
    check_model_files(cfg, source_arch)
    resume = None
    if stage.trains:
        resume = resume_state(cfg, out_dir, arch, data.sampler, stage.trained_roles(arch, sources))
        if resume is None and rank == 0:  # starting at step 0: an earlier attempt's logs go aside
            set_aside_previous_run(out_dir)
    # a trained run keeps what the user wrote (a rerun continues it); an evaluation records the
    # checkpoint it evaluated
    job_cfg = dataclasses.replace(cfg, model=user_model) if stage.trains else cfg
    write_config(job_cfg, out_dir, job.placement)
    models = stage.build_models(cfg, arch, source_arch, sources, gpu=device.use_gpu())
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
        resume=resume,
    )
    if stage.engine:
        run.rollout = rollout_api.build_rollout(
            cfg.rollout,
            job,
            arch=arch,
            policy=models.policy(),
            groups=groups,
            dtype=cfg.precision.dtype,
            out_dir=out_dir,
            lora=cfg.model.lora if models.actor is not None else None,
            env=cfg.env,
            trajectories=trajectories,
            tokenizer=tokenizer,
            system_prompt=cfg.data.system_prompt,
        )
        reward_model = build_reward_model(cfg, models, sources, rm_tokenizer, groups, run.pad_to)
        judge = open_judge(cfg, judge_files, out_dir, dtype=cfg.precision.dtype)
        run.scorer = Scorer(functions, cfg.reward, reward_model, tokenizer, judge)
        if data.held_out is not None:
            run.evaluator = Evaluator(
                cfg, data.held_out, run.rollout, tokenizer, run.scorer, groups
            )
    if stage.trains:
        run.maybe_resume()
    check_models(models)  # masters = weights, nothing kept that only training uses (collective)
    if run.rollout is not None:
        run.rollout.sync_weights()
    return run


def build_data(cfg: RunConfig, stage: Stage, tokenizer, groups: Groups, arch: ModelArch) -> Data:
    """The stage's training and held-out rows (`Stage.read_data`, every row read and checked),
    and, for a stage that trains, the resumable order this DP rank reads them in."""
    dataset, held_out = stage.read_data(cfg, tokenizer, arch, groups.dp_size)
    sampler = None
    if stage.trains:
        sampler = PromptSampler(
            len(dataset),
            prompts_per_step=cfg.data.prompts_per_step,
            dp_rank=groups.dp_rank,
            dp_size=groups.dp_size,
            seed=cfg.data.seed,
            shuffle=cfg.data.shuffle,
        )
    return Data(dataset, sampler, held_out)


def load_tokenizer(cfg: RunConfig, out_dir: str):
    path = cfg.model.tokenizer or cfg.model.hf or cfg.model.mcore_ckpt
    if path == "toy":
        return toy_tokenizer(os.path.join(out_dir, "tokenizer") if dist.get_rank() == 0 else None)
    if path is None:
        raise ConfigError(
            "model.tokenizer is required when the model comes from model.config; accepted: a "
            "tokenizer directory or 'toy'"
        )
    tokenizer = load_tokenizer_dir(path)
    if dist.get_rank() == 0:  # kept beside the checkpoints, for exports (`keep_tokenizer`)
        keep_tokenizer(tokenizer, path, out_dir)
    return tokenizer


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


def write_config(cfg: RunConfig, out_dir: str, where: JobPlacement) -> None:
    """The resolved config as `out_dir/config.yaml`, and the job it runs in as `job.yaml`
    (rank 0): the ranks of each role, the torch threads per rank and the device, which
    `megarl plan --stage-costs RUN` needs to scale the run's stage times."""
    if dist.get_rank() == 0:
        _write_yaml(os.path.join(out_dir, "config.yaml"), to_dict(cfg))
        job = {
            "ranks": where.job_world,
            "trainer_ranks": where.world,
            "engine_ranks": where.engines,
            "threads_per_rank": torch.get_num_threads(),
            "device": "gpu" if device.use_gpu() else "cpu",
        }
        _write_yaml(os.path.join(out_dir, "job.yaml"), job)


def build_logger(cfg: RunConfig, out_dir: str) -> MetricsLogger:
    """metrics.jsonl on rank 0, and wandb / tensorboard as `logging` asks."""
    lg = cfg.logging
    wandb_cfg = None
    mode = wandb_mode(lg.wandb_mode)  # logging.wandb_mode, else WANDB_MODE, else offline
    if lg.wandb and mode != "disabled":
        wandb_cfg = {
            "mode": mode,
            "project": lg.wandb_project,
            "config": to_dict(cfg),
            "dir": out_dir,
        }
    return MetricsLogger(
        out_dir,
        rank=dist.get_rank(),
        wandb_cfg=wandb_cfg,
        tensorboard=lg.tensorboard,
        plot_every_s=lg.plot_every_minutes * 60.0,
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
    e = cfg.eval
    if e.path is not None and not e.path.startswith("hf:") and not os.path.exists(e.path):
        raise ConfigError(f"eval.path={e.path!r} does not exist")


def check_model_files(cfg: RunConfig, arch: ModelArch) -> None:
    """What the initial weights are read from, checked from headers and metadata only (cheap):
    the HF tensor names and shapes against `arch`, or the megatron checkpoint's metadata."""
    m = cfg.model
    if m.hf is not None:
        lazy = LazyHFTensors(m.hf)
        check_hf_names(arch, lazy.names, shape_of=lazy.shape)
    elif m.mcore_ckpt is not None:
        check_dcp_metadata(m.mcore_ckpt)


def resume_state(cfg: RunConfig, out_dir: str, arch: ModelArch, sampler, roles: dict):
    """(newest complete checkpoint of `out_dir`, its trainer state), or None when there is none
    or `trainer.resume` is off (damaged ones are skipped: `vetting.resumable`). Its small
    files are read and checked now, before the models exist: the model config (and that of
    each trained role, `roles` {role: ModelArch}), the data order, that its metadata is safe to
    unpickle and that its tensor files are whole."""
    if not cfg.trainer.resume:
        return None
    return vetting.resumable(
        out_dir, lambda path, state: _check_resumable(cfg, path, state, arch, sampler, roles)
    )


def _changed(a: dict, b: dict) -> list[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def _check_resumable(
    cfg: RunConfig, path: str, state: dict, arch: ModelArch, sampler, roles: dict
) -> None:
    if state["arch"] != arch.hf_config:
        raise CheckpointError(
            f"checkpoint {path} was written for a different model config (differs in "
            f"{_changed(state['arch'], arch.hf_config)[:8]}); resume with the same model, or use "
            "a new run directory (--out) or trainer.resume=false"
        )
    for role, role_arch in roles.items():
        if f"{role}_sched" not in state:
            has = sorted(k[: -len("_sched")] for k in state if k.endswith("_sched"))
            raise CheckpointError(
                f"checkpoint {path} holds no {role} (it trained {has}) but algorithm.name="
                f"{cfg.algorithm.name} trains one; resume with the algorithm that wrote it, or "
                "use a new run directory (--out)"
            )
        written = (state.get("archs") or {}).get(role, state["arch"])
        if written != role_arch.hf_config:
            raise CheckpointError(
                f"checkpoint {path}: its {role} was built from another model (differs in "
                f"{_changed(written, role_arch.hf_config)[:8]}); keep model.critic_init as it "
                "was, or use a new run directory (--out)"
            )
    try:  # on a copy: the run's sampler takes the state in maybe_resume, with the rest
        copy.copy(sampler).load_state_dict(state["sampler"])
    except ValueError as e:
        raise CheckpointError(
            f"checkpoint {path} cannot continue this run's prompt order: {e}; keep data.* as it "
            "was, or use a new run directory (--out) or trainer.resume=false"
        ) from e


def resolve_rollout(cfg: RunConfig, arch: ModelArch, tokenizer, gpu: bool) -> RunConfig:
    """`cfg` with the rollout's settings resolved and checked (`megarl.rollout.resolve`)."""
    dirs = [d for d in (cfg.model.hf, cfg.model.tokenizer, cfg.model.mcore_ckpt) if d]
    rollout = rollout_api.resolve(
        cfg.rollout, arch, tokenizer, dtype=cfg.precision.dtype, gpu=gpu, model_dirs=dirs
    )
    return dataclasses.replace(cfg, rollout=rollout)
