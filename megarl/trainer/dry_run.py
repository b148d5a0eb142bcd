"""`megarl train CONFIG --dry-run --world-size N [--rank R]`: one rank's share of an N-rank run,
checked on any machine in seconds.

Rank R's actor chunks are built with megatron-core itself, in this one process, on the meta device
(shapes only: no parameter memory, no initialisation). The process group is torch's "fake"
backend for N ranks: megatron-core's `initialize_model_parallel` creates every group of the N-rank
layout and keeps this rank's, so the group lists and the layer split are megatron's own.

Simplified on purpose:
- no gloo side groups (megatron's CPU groups for the distributed optimizer need a real store);
- megatron-core's local layer spec even where the real run builds Transformer-Engine layers (GPU,
  FP8): the parameters are the same (TE fuses each norm into the next linear layer, same count);
- LoRA (`model.lora`): the adapters are attached to the meta-built actor as the real run does
  (`apply_lora`) and counted as their own part; a GPU run's refusal of Transformer-Engine layers
  with adapters is a note here (this process cannot know the run's device), an error in
  `megarl plan`, which plans for GPUs;
- only the model's shape is read (`model.config`, `model.hf`'s config.json or GGUF metadata, or
  the small files of `model.mcore_ckpt`): no weights, tokenizer, data, reward functions or vLLM
  engine. Paths the real run reads and this machine lacks are listed, not refused.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megarl.config import ConfigError, RunConfig
from megarl.distributed import Topology, TopologyError, device
from megarl.distributed.placement import JobPlacement
from megarl.models.builder import BuildConfig, build_gpt_chunk, num_params
from megarl.models.hf_config import ModelArch, PrecisionConfig
from megarl.models.lora import LoraConfig, apply_lora, check_lora, te_refusal
from megarl.models.mcore_config import (
    check_fp8_shapes,
    packing_refusal,
    te_attention_refusal,
    transformer_config,
)
from megarl.rollout import check_kv_cache
from megarl.trainer.model_source import check_shape_source, load_arch
from megarl.trainer.teacher import teacher_arch

# parameter names -> the part of the model they belong to (GPTModel's attribute names)
PARTS = (
    ("embedding.", "embedding"),
    ("decoder.final_layernorm.", "final norm"),
    ("output_layer.", "output layer"),
    ("decoder.layers.", "layers"),
    ("lora.", "adapters"),  # LoRA's trainable pairs (`GPTModel.lora`), only with model.lora
)


@dataclass(frozen=True)
class Chunk:
    """One model chunk (virtual pipeline stage) on this rank: `layers` are 0-based HF indices."""

    vp_stage: int | None
    layers: tuple[int, ...]
    params: dict[str, int]
    """Parameter count per part (`PARTS`), split into "experts" / "layers" for MoE; "adapters"
    only with LoRA."""
    adapted: int = 0
    """LoRA: elements of the base weights the adapters change (the adapted megatron linears:
    linear_qkv, linear_proj, linear_fc1, linear_fc2), whose merged copies the weight sync holds."""
    largest_adapted: int = 0
    """LoRA: elements of the largest of those weights."""

    @property
    def total(self) -> int:
        return sum(self.params.values())

    @property
    def adapters(self) -> int:
        return self.params.get("adapters", 0)


@dataclass(frozen=True)
class DryRun:
    """What rank `rank` of a `world_size`-rank run holds; `describe()` is what the CLI prints."""

    config_path: str | None
    rank: int
    topo: Topology
    arch: ModelArch
    padded_vocab: int
    coords: dict[str, int]
    groups: dict[str, list[int]]
    chunks: list[Chunk]
    critic_params: int | None
    critic_trained: int | None
    """The critic's parameters with gradients and Adam state: all, or with
    `model.critic_lora` its adapters and value head."""
    teacher_params: int | None
    """The distillation teacher's parameters on this rank (frozen); None without one."""
    teacher_arch: ModelArch | None
    """The teacher's architecture (`teacher.model`); None without one."""
    model_params: int
    dtype: str
    notes: list[str]

    @property
    def rank_params(self) -> int:
        """Every parameter on this rank, LoRA adapters included."""
        return sum(c.total for c in self.chunks)

    @property
    def rank_adapters(self) -> int:
        """LoRA adapter parameters on this rank (0 without LoRA)."""
        return sum(c.adapters for c in self.chunks)

    @property
    def padded_model_params(self) -> int:
        """`model_params` (the HF count) with megatron's padded embedding and output rows."""
        a = self.arch
        matrices = 1 if a.tie_word_embeddings else 2
        return self.model_params + (self.padded_vocab - a.vocab_size) * a.hidden_size * matrices

    def describe(self) -> str:
        t, a, p = self.topo, self.arch, self.topo.parallel
        vocab = f"vocab {a.vocab_size}"
        if self.padded_vocab != a.vocab_size:
            vocab += f" (padded to {self.padded_vocab})"
        if t.tp > 1:
            vocab += f", {self.padded_vocab // t.tp} rows per TP rank"
        etp = p.expert_tensor_parallel or t.tp
        lines = [
            f"megarl dry run: rank {self.rank} of {t.world_size}"
            f" ({self.config_path or 'embedded default config'})",
            f"model: {a.family}, {a.num_layers} layers, hidden {a.hidden_size}, "
            + (
                f"{a.num_attention_heads} heads / {a.num_key_value_heads} KV heads"
                if a.mla is None
                else f"{a.num_attention_heads} heads, latent attention (kv {a.mla.kv_lora_rank})"
            )
            + f", {vocab}"
            + (f", {a.num_experts} experts top-{a.moe_topk}" if a.is_moe else "")
            + (f", first {a.dense_layers} dense" if a.dense_layers else ""),
            f"layout: TP {t.tp} x PP {t.pp} x CP {t.cp} x DP {t.dp} = {t.world_size} "
            f"rank{'s' if t.world_size > 1 else ''}; "
            f"VPP {t.vpp or '-'}, "
            f"EP {t.ep}, ETP {etp}, sequence parallel {'on' if p.sequence_parallel else 'off'}",
            "this rank: " + ", ".join(f"{k} rank {v}" for k, v in self.coords.items()),
            f"groups of rank {self.rank}:",
        ]
        width = max(len(k) for k in self.groups)
        lines += [f"  {k:<{width}}  {_rank_list(v)}" for k, v in self.groups.items()]
        lines.append(f"parameters on rank {self.rank} (actor, {self.dtype}):")
        for c in self.chunks:
            name = "chunk" if c.vp_stage is None else f"chunk {c.vp_stage}"
            layers = {0: "no layers", 1: f"layer {c.layers[0]}"}.get(
                len(c.layers), f"layers {c.layers[0]}-{c.layers[-1]}"
            )
            parts = " + ".join(
                f"{k} {v:,}{' (trainable)' if k == 'adapters' else ''}"
                for k, v in c.params.items()
                if v
            )
            lines.append(f"  {name:<8} {layers:<14} {parts} = {c.total:,}")
        model, hf = self.padded_model_params, self.model_params
        nbytes = self.rank_params * PrecisionConfig(dtype=self.dtype).torch_dtype.itemsize
        size = f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"
        base, adapters = self.rank_params - self.rank_adapters, self.rank_adapters
        share = (
            f"{base / model:.2%} of the model's "
            f"{model:,}{f' with its padded vocab; {hf:,} in HF' if model != hf else ''}"
        )
        if adapters:  # LoRA: the base's share of the model, then the adapters beside it
            share = f"= {base:,} base ({share}) + {adapters:,} adapters"
            lines.append(f"  total    {self.rank_params:,} {share}; weights {size} in {self.dtype}")
        else:
            lines.append(
                f"  total    {self.rank_params:,} ({share}; weights {size} in {self.dtype})"
            )
        if self.critic_params is not None:
            trained = (
                f"; {self.critic_trained:,} of them trained: LoRA adapters + value head"
                if self.critic_trained != self.critic_params
                else ""
            )
            lines.append(
                f"  critic   {self.critic_params:,} (the actor's trunk with a value head{trained})"
            )
        if self.teacher_params is not None:
            t = self.teacher_arch
            lines.append(
                f"  teacher  {self.teacher_params:,} (frozen; {t.family}, {t.num_layers} layers, "
                f"hidden {t.hidden_size}, vocab {t.vocab_size})"
            )
        lines += self.notes
        return "\n".join(lines) + "\n"


def dry_run(
    cfg: RunConfig, *, world_size: int, rank: int = 0, config_path: str | None = None
) -> DryRun:
    """Validate `cfg`'s layout for `world_size` ranks and build rank `rank`'s chunks on the meta
    device; raises `TopologyError` / `ConfigError` (user errors) for what cannot work."""
    if world_size < 1:
        raise ConfigError(f"--world-size {world_size}: accepted: a number of ranks >= 1")
    if not 0 <= rank < world_size:
        raise ConfigError(f"--rank {rank}: accepted: 0 to {world_size - 1} (--world-size)")
    where = JobPlacement.split(
        rank, world_size, cfg.rollout.placement.mode, cfg.rollout.placement.ranks
    )
    job_world = world_size
    if where.role == "rollout":
        raise ConfigError(
            f"--rank {rank} hosts a vLLM engine only (rollout.placement.mode=separate: ranks "
            f"{world_size - where.world}-{world_size - 1} of {world_size}); accepted: a trainer "
            f"rank, 0 to {world_size - where.world - 1}"
        )
    world_size, rank = where.world, where.rank  # the trainers' own world
    check_shape_source(cfg)
    arch, tarch = load_arch(cfg), teacher_arch(cfg)
    try:
        topo = Topology.for_model(cfg.parallel, world_size, arch)
        topo.check_training(arch)
    except TopologyError as e:  # name the config section, as a real run does
        raise TopologyError(f"parallel: {e}") from e
    if tarch is not None:  # built at the run's layout, as `megarl.trainer.recipe` checks
        try:
            Topology.for_model(cfg.parallel, world_size, tarch).check_training(tarch)
        except TopologyError as e:
            raise TopologyError(
                f"teacher.model: parallel: {e} (it is built at the run's layout)"
            ) from e
    if cfg.precision.fp8 is not None:
        check_fp8_shapes(arch, cfg.parallel, cfg.precision)
    # the real run's check (megarl.models.builder) for local layers: the ones built here
    check_lora(cfg.model.lora, arch, tp=topo.tp, use_te=False)
    check_lora(cfg.model.critic_lora, arch, tp=topo.tp, use_te=False)
    if not cfg.algorithm.offline and cfg.rollout.engine.kv_cache_memory_bytes is not None:
        # the run's own check of a set KV budget (a null one is sized from the GPU at start)
        check_kv_cache(arch, cfg.rollout.engine, dtype=cfg.precision.dtype, gpu=True)
    if dist.is_initialized():
        raise RuntimeError("dry_run needs a process without torch.distributed initialised")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    device.setup()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        topo.initialize(seed=cfg.model.init_seed, gloo_groups=False)
        coords, groups = _coordinates(), _groups(topo, arch)
        build = BuildConfig(make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by)
        # megatron's local layers in the run's dtype: FP8 and TE are GPU-only (see the notes)
        precision = PrecisionConfig(dtype=cfg.precision.dtype, transformer_engine=False)
        config = transformer_config(arch, cfg.parallel, precision, gpu=False)
        actor = _build(arch, config, build, "actor", cfg.model.lora, cfg.trainer.seed)
        chunks = _count(actor, arch)
        critic = critic_trained = None
        if cfg.algorithm.name == "ppo":
            lora = cfg.model.critic_lora
            built = _build(arch, config, build, "critic", lora, cfg.trainer.seed)
            critic = sum(c.total for c in _count(built, arch))
            critic_trained = critic
            if lora.enabled:  # `build_model` leaves the adapters and the value head trainable
                critic_trained = sum(
                    p.numel()
                    for c in built
                    for n, p in c.named_parameters()
                    if n.startswith(("lora.", "output_layer."))
                )
        teacher = None
        if tarch is not None:
            tconfig = transformer_config(tarch, cfg.parallel, precision, gpu=False)
            teacher = sum(c.total for c in _count(_build(tarch, tconfig, build, "teacher"), tarch))
    finally:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        dist.destroy_process_group()
    return DryRun(
        config_path=config_path,
        rank=rank,
        topo=topo,
        arch=arch,
        padded_vocab=arch.padded_vocab_size(build.make_vocab_size_divisible_by, topo.tp),
        coords=coords,
        groups=groups,
        chunks=chunks,
        critic_params=critic,
        critic_trained=critic_trained,
        teacher_params=teacher,
        teacher_arch=tarch,
        model_params=num_params(arch),
        dtype=cfg.precision.dtype,
        notes=_notes(cfg, job_world, arch),
    )


def _coordinates() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    return {
        "TP": ps.get_tensor_model_parallel_rank(),
        "PP": ps.get_pipeline_model_parallel_rank(),
        "DP": ps.get_data_parallel_rank(),
        "CP": ps.get_context_parallel_rank(),
        "EP": ps.get_expert_model_parallel_rank(),
    }


def _groups(topo: Topology, arch: ModelArch) -> dict[str, list[int]]:
    """The global ranks of every group this rank belongs to, as megatron-core made them."""
    from megatron.core import parallel_state as ps

    groups = {
        "TP": ps.get_tensor_model_parallel_group(),
        "PP": ps.get_pipeline_model_parallel_group(),
        "DP": ps.get_data_parallel_group(),
        "CP": ps.get_context_parallel_group(),
    }
    if topo.cp > 1:
        groups["DP x CP"] = ps.get_data_parallel_group(with_context_parallel=True)
    groups["TP x PP (model parallel)"] = ps.get_model_parallel_group()
    if arch.is_moe:
        groups["EP"] = ps.get_expert_model_parallel_group()
        groups["ETP"] = ps.get_expert_tensor_parallel_group()
        groups["expert DP"] = ps.get_expert_data_parallel_group()
    if arch.tie_word_embeddings and topo.pp > 1:
        embedding = ps.get_embedding_group(check_initialized=False)
        if embedding is not None:  # only the first and the last stage share the embedding
            groups["embedding (tied)"] = embedding
    return {k: dist.get_process_group_ranks(g) for k, g in groups.items()}


def _build(
    arch: ModelArch,
    config,
    build: BuildConfig,
    role: str,
    lora: LoraConfig = LoraConfig(),
    seed: int = 0,
) -> list[torch.nn.Module]:
    """This rank's `GPTModel` chunks of `role`, unwrapped (no DDP, whose grad buffers would be
    real memory), on the meta device; with `lora`'s adapters (seeded by `seed`) on them."""
    from megatron.core import parallel_state as ps

    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    # meta tensors hold no values: megatron's weight init would only run its decompositions
    # (11 of 16 s of a 512-expert plan)
    config = copy.copy(config)
    config.perform_initialization = False
    chunks = []
    with torch.device("meta"):  # the adapters' A and B too: their init draws nothing here
        for vp in range(vpp) if vpp else [None]:
            chunk = build_gpt_chunk(arch, config, vp_stage=vp, role=role, build=build, use_te=False)
            if lora.enabled:
                apply_lora(chunk, lora, arch, seed)
            chunks.append(chunk)
    return chunks


def _count(chunks: list[torch.nn.Module], arch: ModelArch) -> list[Chunk]:
    out = []
    for vp, chunk in enumerate(chunks):
        adapters = getattr(chunk, "lora", None)
        params = {name: 0 for _, name in PARTS if name != "adapters"}
        if arch.is_moe:
            params["experts"] = 0
        if adapters is not None:
            params["adapters"] = 0
        for name, param in chunk.named_parameters():
            part = next(part for prefix, part in PARTS if name.startswith(prefix))
            if part == "layers" and ".mlp.experts." in name:
                part = "experts"
            params[part] += param.numel()
        # megatron numbers layers from 1 across the whole model
        layers = tuple(layer.layer_number - 1 for layer in chunk.decoder.layers)
        weights = [a.weight.numel() for a in adapters.adapted] if adapters is not None else []
        out.append(
            Chunk(
                vp_stage=vp if len(chunks) > 1 else None,
                layers=layers,
                params=params,
                adapted=sum(weights),
                largest_adapted=max(weights, default=0),
            )
        )
    return out


def _notes(cfg: RunConfig, job_world: int, arch: ModelArch) -> list[str]:
    p = cfg.precision
    notes = []
    if cfg.rollout.placement.separate:
        first = job_world - cfg.rollout.placement.ranks
        notes.append(
            f"placement: separate; ranks {first}-{job_world - 1} of {job_world} host vLLM "
            f"engines only (rollout.placement.ranks={cfg.rollout.placement.ranks}), the layout "
            "above is the trainers'"
        )
    adapters = cfg.model.lora
    models = [
        f"actor (base frozen; LoRA rank {adapters.rank} on {', '.join(adapters.modules())} trains)"
        if adapters.enabled
        else "actor (trainable)"
    ]
    if cfg.algorithm.needs_reference:
        why = (
            f"algorithm.dpo_loss={cfg.algorithm.dpo_loss}"
            if cfg.algorithm.offline
            else f"algorithm.kl_coef={cfg.algorithm.kl_coef}"
        )
        if adapters.enabled:
            models.append(f"reference = the actor with its adapters off (no copy; {why})")
        else:
            models.append(f"reference (frozen, actor's shape; {why})")
    if cfg.algorithm.uses_teacher:
        own = f", teacher.dtype={cfg.teacher.dtype}" if cfg.teacher.dtype else ""
        models.append(f"teacher (frozen; teacher.model={cfg.teacher.model}{own})")
    if cfg.reward.judge.model is not None and not cfg.algorithm.offline:
        models.append(
            f"judge on a vLLM engine of its own (reward.judge.model={cfg.reward.judge.model})"
        )
    if cfg.algorithm.offline:
        models.append(f"no rollout engine (offline stage algorithm.name={cfg.algorithm.name})")
    if cfg.algorithm.name == "ppo":
        c = cfg.model.critic_lora
        models.append(
            f"critic (base frozen; LoRA rank {c.rank} on {', '.join(c.modules())} and the value "
            "head train)"
            if c.enabled
            else "critic (trainable)"
        )
    notes.append("models on every rank: " + " + ".join(models))
    layers = "megatron-core local layers on the meta device (no memory)"
    if packed := packing_refusal(arch, packed=cfg.algorithm.pack_sequences):
        notes.append(f"the run refuses this config: {packed}")
    refused = te_refusal(cfg.model.lora, cfg.precision)
    if p.transformer_engine is not False and not refused:
        refused = te_attention_refusal(arch, packed=cfg.algorithm.pack_sequences, te_version=None)
    if refused:
        layers += f"; a GPU run refuses this config: {refused}"
    elif p.transformer_engine is not False:
        fp8 = f" with FP8 {p.fp8}, recipe {p.fp8_recipe}" if p.fp8 else ""
        layers += (
            f"; the real run on GPU builds Transformer-Engine layers{fp8} (same parameters, "
            "Transformer-Engine not needed here)"
        )
    notes.append(f"layers: {layers}")
    missing = [
        f"{key}={path}"
        for key, path in (("model.tokenizer", cfg.model.tokenizer), ("data.path", cfg.data.path))
        if path not in (None, "toy") and not path.startswith("hf:") and not os.path.exists(path)
    ]
    if missing:
        notes.append(f"not found on this machine (the real run reads them): {', '.join(missing)}")
    return notes


def _rank_list(ranks: list[int]) -> str:
    """`0-7, 16-23 (16 ranks)`: runs of consecutive ranks; `0, 8, ..., 504 (64 ranks)` for a long
    evenly spaced list."""
    if len(ranks) == 1:
        return str(ranks[0])
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    step = ranks[1] - ranks[0]
    if len(runs) > 8 and all(b - a == step for a, b in zip(ranks, ranks[1:], strict=False)):
        text = f"{ranks[0]}, {ranks[1]}, {ranks[2]}, ..., {ranks[-1]}"
    else:
        text = ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)
    return f"{text} ({len(ranks)} ranks)"
