"""Everything one training run holds, built once: topology, models, optimizers, the colocated
rollout engine and its weight sync, data, reward functions, logging, and resume.

The named steps of the RL loop (`megarl.trainer.loop`) are methods of `Run`, so the loop itself
reads like the algorithm. Process groups come from the topology and are passed down explicitly.
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

import torch
import torch.distributed as dist
import yaml

from megarl.config import ConfigError, RunConfig, to_dict
from megarl.convert.sharded import copy_weights
from megarl.distributed import Topology, device
from megarl.distributed.topology import Groups, TopologyError
from megarl.metrics.sinks import set_aside_previous_run
from megarl.models.builder import BuildConfig, build_model
from megarl.models.hf_config import ModelArch, arch_from_hf
from megarl.models.optim import build_optimizer
from megarl.trainer import checkpoint
from megarl.trainer.faults import attempt_store, collective_timeout

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
        dist.init_process_group(device.backend(), timeout=timeout, **attempt_store(timeout))
    return dist.get_rank(), dist.get_world_size()


def load_arch(cfg: RunConfig) -> ModelArch:
    m = cfg.model
    if m.config is not None:
        return arch_from_hf(m.config, where="model.config")
    if m.hf is not None:
        return arch_from_hf(m.hf)
    from megarl.convert.checkpoint import read_checkpoint_arch

    return read_checkpoint_arch(m.mcore_ckpt)


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
    return load(path)


@dataclass
class Run:
    cfg: RunConfig
    out_dir: str
    topo: Topology
    groups: Groups
    arch: ModelArch
    tokenizer: object
    actor: list
    actor_opt: object
    actor_sched: object
    reference: list | None
    critic: list | None
    critic_opt: object
    critic_sched: object
    engine: object
    sync: object
    dispatcher: object
    dataset: object
    sampler: object
    reward_fns: list
    logger: object
    resume: tuple[str, dict] | None = None
    """(checkpoint directory, its trainer state) to resume from, read and checked in create."""
    step: int = 0
    bad_steps: int = 0
    extra: dict = field(default_factory=dict)

    # ------------------------------------------------------------------ construction
    @staticmethod
    def create(cfg: RunConfig, out_dir: str) -> Run:
        rank, world = init_distributed()
        check_paths(cfg)
        arch = load_arch(cfg)
        longest = cfg.data.max_prompt_length + cfg.rollout.max_tokens
        if longest > arch.max_position_embeddings:
            raise ConfigError(
                f"data.max_prompt_length ({cfg.data.max_prompt_length}) + rollout.max_tokens "
                f"({cfg.rollout.max_tokens}) = {longest} exceeds the model's "
                f"max_position_embeddings ({arch.max_position_embeddings})"
            )
        p = cfg.parallel
        try:
            topo = Topology.for_model(p, world, arch)
            topo.check_training(arch)
        except TopologyError as e:  # name the config section
            raise TopologyError(f"parallel: {e}") from e
        gpu = device.use_gpu()
        slow = None if gpu else device.cpu_half_precision_note(cfg.precision.dtype)
        if slow and rank == 0:
            log.warning(slow)
        if rank == 0:
            os.makedirs(out_dir, exist_ok=True)
        groups = topo.initialize(seed=cfg.model.init_seed, timeout=collective_timeout(cfg.trainer))
        tokenizer = load_tokenizer(cfg, out_dir)
        # everything a user can get wrong is checked before the models and the engine exist
        cfg = _resolve_rollout(cfg, arch, tokenizer, gpu)
        dataset, sampler = _data(cfg, tokenizer, groups)
        reward_fns = _reward_functions(cfg)
        _check_model_files(cfg, arch)
        resume = _resume_state(cfg, out_dir, arch, sampler)
        if rank == 0:
            if resume is None:  # starting at step 0: an earlier attempt's metrics go aside
                set_aside_previous_run(out_dir)
            _write_yaml(os.path.join(out_dir, "config.yaml"), to_dict(cfg))
        build = BuildConfig(
            make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by,
            routing_replay=cfg.rollout.routing_replay,
        )
        make = lambda role: build_model(arch, p, cfg.precision, role=role, build=build, gpu=gpu)  # noqa: E731

        actor = make("actor")
        _initial_state(cfg, arch, actor)
        updates = cfg.trainer.steps * cfg.algorithm.ppo_epochs * cfg.algorithm.mini_batches
        actor_opt, actor_sched = build_optimizer(
            actor, cfg.optim, dtype=cfg.precision.dtype, total_steps=updates
        )
        reference = None
        if cfg.algorithm.kl_coef > 0:
            reference = make("reference")
            copy_weights(actor, reference)  # the initial policy (resume loads the actor later)
        critic = critic_opt = critic_sched = None
        if cfg.algorithm.name == "ppo":
            critic = make("critic")
            copy_weights(actor, critic)  # the actor's trunk; the value head starts at zero
            critic_opt, critic_sched = build_optimizer(
                critic, cfg.critic_optim, dtype=cfg.precision.dtype, total_steps=updates
            )

        engine, sync, dispatcher = _rollout(cfg, arch, actor, groups, out_dir)
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
        logger = MetricsLogger(out_dir, rank=rank, wandb_cfg=wandb_cfg, tensorboard=lg.tensorboard)
        run = Run(
            cfg=cfg,
            out_dir=out_dir,
            topo=topo,
            groups=groups,
            arch=arch,
            tokenizer=tokenizer,
            actor=actor,
            actor_opt=actor_opt,
            actor_sched=actor_sched,
            reference=reference,
            critic=critic,
            critic_opt=critic_opt,
            critic_sched=critic_sched,
            engine=engine,
            sync=sync,
            dispatcher=dispatcher,
            dataset=dataset,
            sampler=sampler,
            reward_fns=reward_fns,
            logger=logger,
            resume=resume,
        )
        run.maybe_resume()
        run.sync_weights()
        return run

    # ------------------------------------------------------------------ checkpoints
    def _models(self) -> dict:
        models = {"actor": (self.actor, self.actor_opt)}
        if self.critic is not None:
            models["critic"] = (self.critic, self.critic_opt)
        return models

    def trainer_state(self) -> dict:
        state = {
            "step": self.step,
            "sampler": self.sampler.state_dict(),
            "actor_sched": self.actor_sched.state_dict(),
            "arch": self.arch.hf_config,
        }
        if self.critic_sched is not None:
            state["critic_sched"] = self.critic_sched.state_dict()
        return state

    def save(self) -> str:
        path = checkpoint.save(
            self.out_dir,
            self.step,
            self._models(),
            self.trainer_state(),
            keep_last=self.cfg.trainer.keep_last,
        )
        log.info("saved checkpoint %s", path)
        return path

    def maybe_resume(self) -> None:
        if self.resume is None:
            return
        path, state = self.resume
        checkpoint.load_models(path, self._models())
        torch.set_rng_state(state["torch_rng"])
        self.step = state["step"]
        self.sampler.load_state_dict(state["sampler"])
        self.actor_sched.load_state_dict(state["actor_sched"])
        if self.critic_sched is not None:
            self.critic_sched.load_state_dict(state["critic_sched"])
        self.logger.truncate_after(self.step)
        log.info("resumed from %s at step %d", path, self.step)

    # ------------------------------------------------------------------ weight sync
    def sync_weights(self) -> dict:
        """Push the actor's weights into this rank's vLLM engine (collective).

        The engine slept after generating (GPU: its weights and KV cache were freed while the
        trainer used the memory): release the trainer's cached blocks, wake the weights, write
        them (the sync also drops vLLM's prefix cache, computed with the old weights), then wake
        the KV cache."""
        torch.cuda.empty_cache()  # a no-op on CPU
        self.engine.wake_up(["weights"])
        stats = self.sync.sync()
        self.engine.wake_up(["kv_cache"])
        return stats

    def close(self) -> None:
        self.logger.close()


def _write_yaml(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        yaml.safe_dump(data, f, sort_keys=False)
    os.replace(tmp, path)


def check_paths(cfg: RunConfig) -> None:
    """Fail (`ConfigError` naming the key) when a file or directory the config names is absent:
    before anything is read or built, and before a deeper error could name only the file."""
    m, d = cfg.model, cfg.data
    dirs = {
        "model.hf": (m.hf, "a Hugging Face model directory (config.json + *.safetensors)"),
        "model.mcore_ckpt": (m.mcore_ckpt, "a directory from `tools/convert.py hf-to-mcore`"),
        "model.tokenizer": (
            None if m.tokenizer == "toy" else m.tokenizer,
            "a tokenizer directory (tokenizer.json / tokenizer_config.json) or 'toy'",
        ),
    }
    for key, (path, accepted) in dirs.items():
        if path is not None and not os.path.isdir(path):
            what = "is not a directory" if os.path.exists(path) else "does not exist"
            raise ConfigError(f"{key}={path!r} {what}; accepted: {accepted}")
    if d.path is not None and not d.path.startswith("hf:") and not os.path.exists(d.path):
        raise ConfigError(
            f"data.path={d.path!r} does not exist; accepted: a .jsonl/.json/.parquet file, a "
            "directory of them, 'hf:NAME[:SPLIT]', or null for the toy task"
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


def _resume_state(cfg: RunConfig, out_dir: str, arch: ModelArch, sampler):
    """(newest complete checkpoint of `out_dir`, its trainer state), or None when there is none
    or `trainer.resume` is off (damaged ones are skipped: `checkpoint.resumable`). Its small
    files are read and checked now, before the models exist: the model config, the data order,
    that its metadata is safe to unpickle and that its tensor files are whole."""
    if not cfg.trainer.resume:
        return None
    return checkpoint.resumable(
        out_dir, lambda path, state: _check_resumable(cfg, path, state, arch, sampler)
    )


def _check_resumable(cfg: RunConfig, path: str, state: dict, arch: ModelArch, sampler) -> None:
    if state["arch"] != arch.hf_config:
        changed = sorted(
            k
            for k in set(state["arch"]) | set(arch.hf_config)
            if state["arch"].get(k) != arch.hf_config.get(k)
        )
        raise checkpoint.CheckpointError(
            f"checkpoint {path} was written for a different model config (differs in "
            f"{changed[:8]}); resume with the same model, or use a new run directory (--out) or "
            "trainer.resume=false"
        )
    if cfg.algorithm.name == "ppo" and "critic_sched" not in state:
        raise checkpoint.CheckpointError(
            f"checkpoint {path} holds no critic (a grpo run wrote it) but algorithm.name=ppo; "
            "resume with algorithm.name=grpo, or use a new run directory (--out)"
        )
    try:  # on a copy: the run's sampler takes the state in maybe_resume, with the rest
        copy.copy(sampler).load_state_dict(state["sampler"])
    except ValueError as e:
        raise checkpoint.CheckpointError(
            f"checkpoint {path} cannot continue this run's prompt order: {e}; keep data.* as it "
            "was, or use a new run directory (--out) or trainer.resume=false"
        ) from e


def _initial_state(cfg: RunConfig, arch: ModelArch, actor: list) -> None:
    """Load the starting weights into `actor`, each rank reading only the shards it holds
    (`model.hf`: the HF tensors of its own parameters; `model.mcore_ckpt`: a sharded
    `dist_checkpointing` load; random init from `model.config`: `seeded_init`, the same model at
    every layout, so a run resumed at another layout rebuilds the same reference). No rank holds
    the whole model; the reference and the critic trunk are then copied from the actor's shards."""
    m = cfg.model
    if m.hf is None and m.mcore_ckpt is None:
        from megarl.convert.sharded import seeded_init

        seeded_init(actor, arch, m.init_seed)
    elif m.hf is not None:
        from megarl.convert.sharded import load_hf_sharded

        load_hf_sharded(actor, arch, m.hf)
    elif m.mcore_ckpt is not None:
        from megarl.convert.checkpoint import load_model_checkpoint

        load_model_checkpoint(actor, m.mcore_ckpt)


def _resolve_rollout(cfg: RunConfig, arch: ModelArch, tokenizer, gpu: bool) -> RunConfig:
    """`cfg` with the rollout's stop tokens resolved (None = the model's EOS ids), after
    checking that vLLM is importable and that its KV cache can hold one whole sequence."""
    from megarl.rollout.engine import check_kv_cache, require_vllm, resolve_stop_tokens
    from megarl.rollout.routes import check_routing_replay

    dirs = [d for d in (cfg.model.hf, cfg.model.tokenizer, cfg.model.mcore_ckpt) if d]
    stop = resolve_stop_tokens(cfg.rollout.stop_token_ids, tokenizer, arch.hf_config, dirs)
    if cfg.rollout.stop_token_ids is None:
        log.info("rollout.stop_token_ids: %s (the model's EOS ids)", list(stop) or "none found")
    rollout = dataclasses.replace(cfg.rollout, stop_token_ids=stop)
    check_kv_cache(arch, rollout, dtype=cfg.precision.dtype, gpu=gpu)
    check_routing_replay(arch, rollout)
    require_vllm()
    return dataclasses.replace(cfg, rollout=rollout)


def _rollout(cfg: RunConfig, arch: ModelArch, actor, groups: Groups, out_dir: str):
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
    return engine, sync, RolloutDispatcher(engine, groups.dp_rank)


def _data(cfg: RunConfig, tokenizer, groups: Groups):
    from megarl.data.dataset import PromptDataset
    from megarl.data.sampler import PromptSampler

    dataset = PromptDataset.from_config(cfg.data, tokenizer)
    sampler = PromptSampler(
        len(dataset),
        prompts_per_step=cfg.data.prompts_per_step,
        dp_rank=groups.dp_rank,
        dp_size=groups.dp_size,
        seed=cfg.data.seed,
        shuffle=cfg.data.shuffle,
    )
    return dataset, sampler


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
