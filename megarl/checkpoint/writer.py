"""One model saved as a converter checkpoint: a layout-independent `torch_dist` directory.

The directory holds megatron's `dist_checkpointing` files plus `megarl_model.json`
(`files.META`: format tag, the original HF config, dtype, vocab padding and the layout it was
written from, for information only) and, when given, the tokenizer files. Tensor names are
global (`keys`), so the directory loads at any TP / PP / VPP / EP (`reader`); padded vocab rows
are `allow_shape_mismatch` tensors, so a different padding at load time is zero-filled or cut.
Assumes torch.distributed and megatron's model-parallel state are initialised (every rank calls
it); rank 0 alone touches the directory outside megatron's save.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist

from megarl.checkpoint.files import (
    FORMAT,
    META,
    CheckpointError,
    copy_tokenizer_files,
    looks_like_checkpoint,
)
from megarl.checkpoint.keys import has_value_head, rename_te_keys
from megarl.distributed.writer_queue import fork_write_results_queue
from megarl.errors import OutputExistsError
from megarl.models.builder import unwrap
from megarl.models.hf_config import ModelArch


def save_model_checkpoint(
    chunks: list[torch.nn.Module],
    out_dir: str | os.PathLike,
    *,
    arch: ModelArch,
    extra_meta: dict | None = None,
    tokenizer_dir: str | os.PathLike | None = None,
    overwrite: bool = False,
) -> str:
    """Save this rank's chunks into a layout-independent `torch_dist` checkpoint (collective).

    Written into a hidden temporary sibling and renamed onto `out_dir` by rank 0 after a barrier:
    an interrupted save never leaves a directory that looks complete. An `out_dir` that already
    holds files is refused unless `overwrite`. Returns the absolute `out_dir`."""
    from megatron.core import dist_checkpointing

    out = os.path.abspath(os.fspath(out_dir))
    parent, base = os.path.split(out)
    tmp = os.path.join(parent, f".{base}.tmp-megarl")

    def prepare():
        if os.path.exists(out) and os.listdir(out) and not overwrite:
            what = "a checkpoint" if looks_like_checkpoint(out) else "files"
            raise OutputExistsError(
                f"{out} already holds {what}; pass overwrite=True to replace it"
            )
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)

    _rank0_check(prepare)
    dist.barrier()
    sd = _sharded_state_dict(chunks, arch)
    fork_write_results_queue()
    try:
        dist_checkpointing.save(sd, tmp)
    except BaseException:
        if dist.get_rank() == 0:  # best effort: peers may still be writing into it
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    model = unwrap(chunks[0])
    meta = {
        "format": FORMAT,
        "family": arch.family,
        "hf_config": arch.hf_config,
        "dtype": _dtype_name(chunks),
        "vocab_size": arch.vocab_size,
        "value_head": has_value_head(model),
        "saved_layout": _layout(),
        **(extra_meta or {}),
    }

    def finish():
        with open(os.path.join(tmp, META), "w") as f:
            json.dump(meta, f, indent=2, sort_keys=True)
        if tokenizer_dir is not None:
            copy_tokenizer_files(tokenizer_dir, tmp)
        old = None
        if os.path.exists(out):
            old = tmp + ".old"
            os.rename(out, old)
        os.rename(tmp, out)
        if old:
            shutil.rmtree(old, ignore_errors=True)

    dist.barrier()
    _rank0_check(finish)
    return out


def _sharded_state_dict(chunks, arch: ModelArch, *, with_value_head: bool = True) -> dict:
    out = {}
    for k, chunk in enumerate(chunks):
        model = unwrap(chunk)
        sd = model.sharded_state_dict()
        if has_value_head(model) and not with_value_head:
            sd = {n: v for n, v in sd.items() if not n.startswith("output_layer.")}
        rename_te_keys(sd, arch)
        out[f"chunk{k}"] = sd
    return out


def _layout() -> dict:
    from megatron.core import parallel_state as ps

    return {
        "tensor_parallel": ps.get_tensor_model_parallel_world_size(),
        "pipeline_parallel": ps.get_pipeline_model_parallel_world_size(),
        "virtual_pipeline_parallel": ps.get_virtual_pipeline_model_parallel_world_size(),
        "expert_parallel": ps.get_expert_model_parallel_world_size(),
        "world_size": dist.get_world_size(),
    }


def _dtype_name(chunks) -> str:
    dt = next(unwrap(chunks[0]).parameters()).dtype
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dt]


def _rank0_check(fn) -> None:
    """Run `fn()` on rank 0 and raise its error on every rank (no rank hangs in a barrier)."""
    err = [None]
    if dist.get_rank() == 0:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            err[0] = f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(err, src=0)
    if err[0] is not None:
        raise CheckpointError(err[0])
