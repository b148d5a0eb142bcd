"""HF directory <-> megatron checkpoint, streaming, in one CPU process.

hf-to-mcore builds the megatron model once without random init (world 1, TP=PP=1: the
checkpoint is layout-independent, so `--tp/--pp` are only validated and recorded as the suggested
training layout), copies each canonical tensor into its parameter as it is streamed from the
safetensors files (one HF tensor in flight), then saves with `dist_checkpointing`. Peak host
memory is about one copy of the model plus one layer's tensors.

mcore-to-hf loads the checkpoint into the same model and streams the parameters back through the
mapping into sharded safetensors; HF tensors that are plain copies stay views of the parameters.
A sequence classifier with one label (a reward model) converts with its `score` head, both ways.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

from megarl import dtypes
from megarl.checkpoint.files import CheckpointError, looks_like_checkpoint
from megarl.checkpoint.reader import load_into, open_checkpoint
from megarl.checkpoint.writer import save_model_checkpoint
from megarl.convert.export import critic_tensors, export_config, finish_hf_dir
from megarl.convert.hf_io import LazyHFTensors
from megarl.convert.hf_write import AtomicDir, write_hf_files
from megarl.convert.layout import VOCAB_PARAMS, local_params, pad_rows, split_tp
from megarl.convert.mapping import canonical_to_hf, check_hf_names, hf_to_canonical, to_files
from megarl.distributed import ParallelConfig, Topology, TopologyError
from megarl.distributed.launch import free_port
from megarl.errors import OutputExistsError
from megarl.models.builder import BuildConfig, build_gpt_chunk, unwrap
from megarl.models.hf_config import (
    DTYPES,
    ModelArch,
    PrecisionConfig,
    arch_from_hf,
    load_hf_config,
)
from megarl.models.mcore_config import transformer_config

log = logging.getLogger(__name__)


def init_single_process(seed: int = 0):
    """torch.distributed with one gloo rank and megatron's parallel state at TP=PP=1, on CPU."""
    os.environ["MEGARL_DEVICE"] = "cpu"
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    return Topology.create(ParallelConfig(), 1).initialize(seed=seed)


def build_chunks(
    arch: ModelArch,
    parallel=None,
    *,
    dtype: str = "fp32",
    make_vocab_size_divisible_by: int = 128,
    role: str = "reference",
) -> list[torch.nn.Module]:
    """This rank's frozen GPTModel chunks with *uninitialised* weights (megatron parallel state
    must exist). Used where every weight is overwritten next: conversion and verification.
    `role="critic"` / `"reward"`: with a scalar head instead of the LM head."""
    from megatron.core import parallel_state as ps

    parallel = parallel or ParallelConfig()
    config = transformer_config(arch, parallel, PrecisionConfig(dtype=dtype), gpu=False)
    config.perform_initialization = False  # torch.empty weights: no seconds spent on random init
    build = BuildConfig(make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    chunks = []
    for vp_stage in range(vpp) if vpp else [None]:
        chunk = build_gpt_chunk(
            arch, config, vp_stage=vp_stage, role=role, build=build, use_te=False
        )
        chunk.requires_grad_(False)
        chunk.eval()
        _mark_tp_params(chunk)
        chunks.append(chunk)
    return chunks


def _mark_tp_params(model: torch.nn.Module) -> None:
    """megatron sets `tensor_model_parallel` / `partition_dim` on weights only inside its init
    functions, which `perform_initialization=False` skips; `layout` relies on them."""
    from megatron.core.tensor_parallel import layers

    dims = {
        layers.ColumnParallelLinear: 0,
        layers.RowParallelLinear: 1,
        layers.VocabParallelEmbedding: 0,
    }
    for module in model.modules():
        dim = next((d for cls, d in dims.items() if isinstance(module, cls)), None)
        w = getattr(module, "weight", None)
        if dim is not None and isinstance(w, torch.nn.Parameter):
            if not getattr(w, "tensor_model_parallel", False):
                layers.set_tensor_model_parallel_attributes(w, True, dim, 1)


@torch.no_grad()
def fill_from_canonical(
    chunks: list[torch.nn.Module], items: Iterable[tuple[str, torch.Tensor]]
) -> None:
    """Copy streamed canonical tensors into this rank's shards, one at a time (any layout:
    tensors this rank does not hold are skipped). Every local parameter must be filled."""
    from megatron.core import parallel_state as ps

    targets = {name: (local, p) for name, local, p in local_params(chunks)}
    tied_out = [
        unwrap(c).shared_embedding_or_output_weight()
        for c in chunks
        if getattr(unwrap(c), "share_embeddings_and_output_weights", False)
        and unwrap(c).post_process
        and not unwrap(c).pre_process
    ]
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    filled = set()
    for name, t in items:
        if name == "embedding.word_embeddings.weight":
            for w in tied_out:  # last stage's own copy of a tied embedding
                w.copy_(pad_rows(t, w.shape[0] * tp).chunk(tp, 0)[tp_rank])
        if name not in targets:
            continue
        local, p = targets[name]
        if name in VOCAB_PARAMS:
            t = pad_rows(t, p.shape[0] * tp)
        if getattr(p, "tensor_model_parallel", False) and getattr(p, "partition_dim", -1) >= 0:
            allreduce = getattr(p, "allreduce", True)
            group = (
                ps.get_expert_tensor_parallel_group()
                if allreduce is False
                else ps.get_tensor_model_parallel_group()
            )
            size, rank = dist.get_world_size(group), dist.get_rank(group)
            t = split_tp(name, t, p.partition_dim, size, rank, getattr(p, "tp_parts", None))
        if t.shape != p.shape:
            raise CheckpointError(f"{name}: tensor shape {tuple(t.shape)} != parameter {p.shape}")
        p.copy_(t)
        filled.add(name)
    left = sorted(set(targets) - filled)
    if left:
        raise CheckpointError(f"no tensor was given for parameter(s) {left[:8]}")


def local_canonical(chunks: list[torch.nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream the canonical state of a model held whole by this rank (TP=PP=EP=1): parameters
    as views, vocab rows cut to the real vocab size."""
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() * ps.get_pipeline_model_parallel_world_size() > 1:
        raise CheckpointError("local_canonical needs TP=PP=1; use layout.gather_full_state")
    vocab = unwrap(chunks[0]).megarl_vocab_size
    for name, _, p in local_params(chunks):
        t = p.detach()
        yield name, (t[:vocab] if name in VOCAB_PARAMS else t)


class _Progress:
    """Bytes-based progress bar on stderr (tqdm), silent when disabled."""

    def __init__(self, total: int, desc: str, enabled: bool):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, leave=False)

    def __call__(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _refuse_existing(out_dir: str, overwrite: bool) -> None:
    """Fail before any work when the output would be refused at the end anyway."""
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        what = "a checkpoint" if looks_like_checkpoint(out_dir) else "files"
        raise OutputExistsError(f"{out_dir} already holds {what}; pass --overwrite to replace it")


def _resolve_dtype(dtype: str | None, hf_cfg: dict) -> str:
    if dtype is None:
        name = hf_cfg.get("dtype") or hf_cfg.get("torch_dtype") or "float32"
        inverse = {v: k for k, v in dtypes.NAMES.items()}
        dtype = inverse.get(str(name).replace("torch.", ""), "fp32")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}; accepted: {sorted(DTYPES)}")
    return dtype


def hf_to_mcore(
    hf_dir: str,
    out_dir: str,
    *,
    tp: int = 1,
    pp: int = 1,
    dtype: str | None = None,
    make_vocab_size_divisible_by: int = 128,
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """Convert an HF directory into a megarl megatron checkpoint; returns a summary dict.

    `dtype` None = the HF config's dtype. Must run in a process with no other torch.distributed
    job (a one-rank gloo group is created)."""
    t0 = time.perf_counter()
    _refuse_existing(out_dir, overwrite)
    hf_cfg = load_hf_config(hf_dir)
    arch = arch_from_hf(hf_dir)
    # fail now, before reading anything, if the suggested layout cannot hold this model
    try:
        Topology.for_model(ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp), tp * pp, arch)
    except TopologyError as e:
        raise TopologyError(f"tp={tp} pp={pp} does not fit the model in {hf_dir}: {e}") from e
    dtype = _resolve_dtype(dtype, hf_cfg)
    lazy = LazyHFTensors(hf_dir)
    check_hf_names(arch, lazy.names, shape_of=lazy.shape)  # before the model is built
    init_single_process()
    chunks = build_chunks(
        arch,
        dtype=dtype,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        role="reward" if arch.score_head else "reference",  # a classifier: its score head
    )
    bar = _Progress(lazy.total_bytes(), "read HF", progress)

    def get(name: str) -> torch.Tensor:
        bar(lazy.nbytes(name))
        return lazy.get(name)

    # fail on unknown/missing keys and shapes before any data is read
    stream = hf_to_canonical(arch, get, lazy.names, shape_of=lazy.shape)
    fill_from_canonical(chunks, stream)
    bar.close()
    t_read = time.perf_counter() - t0
    save_model_checkpoint(
        chunks,
        out_dir,
        arch=arch,
        tokenizer_dir=hf_dir,
        overwrite=overwrite,
        extra_meta={
            "hf_config": hf_cfg,  # as written by the source (arch.hf_config is normalised)
            "make_vocab_size_divisible_by": make_vocab_size_divisible_by,
            "suggested_layout": {"tensor_parallel": tp, "pipeline_parallel": pp},
            "source": os.path.abspath(hf_dir),
        },
    )
    return {
        "seconds": time.perf_counter() - t0,
        "read_seconds": t_read,
        "bytes_read": lazy.total_bytes(),
        "dtype": dtype,
        "family": arch.family,
    }


def mcore_to_hf(
    ckpt_dir: str,
    out_dir: str,
    *,
    role: str | None = None,
    dtype: str | None = None,
    max_shard_bytes: int = 2 * 2**30,
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """Convert role `role` of a megarl checkpoint (trainer or converter, any layout; see
    `megarl.checkpoint.reader`) into a complete HF directory (`megarl.convert.export`); `dtype`
    None = the checkpoint's dtype. A critic becomes a sequence-classification model (value
    head `score.weight`)."""
    t0 = time.perf_counter()
    _refuse_existing(out_dir, overwrite)
    source = open_checkpoint(ckpt_dir, role)  # also vets the metadata, before the model is built
    arch = source.arch
    dtype = dtype or source.dtype
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype={dtype!r}; accepted: {sorted(DTYPES)}")
    init_single_process()
    with AtomicDir(out_dir, overwrite=overwrite) as d:
        chunks = build_chunks(
            arch, dtype=source.dtype, role="critic" if source.value_head else "reference"
        )
        load_into(chunks, source)
        total = sum(p.numel() * p.element_size() for p in chunks[0].parameters())
        bar = _Progress(total, "write HF", progress)
        torch_dtype = DTYPES[dtype]
        canonical = local_canonical(chunks)
        hf = (
            critic_tensors(arch, canonical)
            if source.value_head
            else canonical_to_hf(arch, canonical)
        )
        tensors = ((n, t.to(torch_dtype)) for n, t in to_files(arch, hf))
        write_hf_files(d.tmp, tensors, max_shard_bytes=max_shard_bytes, progress=bar)
        bar.close()
        config = export_config(arch.hf_config, arch.family, dtype, value_head=source.value_head)
        finish_hf_dir(d.tmp, config, source.tokenizer_dir)
    return {
        "seconds": time.perf_counter() - t0,
        "dtype": dtype,
        "family": arch.family,
        "role": source.role,
        "source": source.describe(),
    }
