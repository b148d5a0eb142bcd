"""Megatron-core distributed checkpoints (`torch_dist`) of megarl models, loadable at any layout.

A checkpoint directory holds megatron's `dist_checkpointing` files plus `megarl_model.json`
(format tag, the original HF config, dtype, vocab padding and the layout it was written from,
for information only). megatron's sharded state dict names every tensor by its *global* key
(layers stacked on a leading axis, experts by global index, TP shards by offset), so the files do
not depend on TP / PP / VPP / EP; padded vocab rows are `allow_shape_mismatch` tensors, so a
different padding at load time is zero-filled or cut.

Local spec vs Transformer-Engine spec: megatron's local spec already names the fused norms as TE
does (`input_layernorm` -> `self_attention.linear_qkv.layer_norm_weight`, `pre_mlp_layernorm`
-> `mlp.linear_fc1.layer_norm_weight`). For MoE layers the TE spec keeps a standalone
`pre_mlp_layernorm`, while megatron-core 0.16's local spec still maps it onto the (absent) fused
fc1; `_te_keys` renames that key, so CPU-written MoE checkpoints carry the TE name. TE-only
`_extra_state` objects (FP8 metadata) are optional in both directions.

Untrusted directories: torch.distributed.checkpoint reads a checkpoint's `.metadata` with plain
`pickle.load` (torch 2.13), so loading a checkpoint from elsewhere could run code.
`check_dcp_metadata` unpickles it first with an unpickler that resolves only what that file
holds (torch.distributed.checkpoint's dataclasses and enums, torch.Size, dtypes, layouts) and
refuses anything else; every load here calls it before megatron reads the directory. The tensor
files and megatron's `common.pt` are read with `torch.load(weights_only=True)` by torch and
megatron-core themselves.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import json
import logging
import os
import pickle
import shutil

import torch
import torch.distributed as dist

from megarl.errors import OutputExistsError, UserError
from megarl.models.builder import unwrap
from megarl.models.hf_config import ModelArch

log = logging.getLogger(__name__)

META = "megarl_model.json"
FORMAT = "megarl-mcore/1"
_MOE_LOCAL_NORM = "decoder.layers.mlp.linear_fc1.layer_norm_weight"
_MOE_TE_NORM = "decoder.layers.pre_mlp_layernorm.weight"


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be written or loaded; the message names the file or key."""


class IncompleteCheckpoint(CheckpointError):
    """A checkpoint with a missing, truncated or unreadable file (a save cut short, a damaged
    disk): a resume skips it for the one before (`megarl.trainer.checkpoint`)."""


def read_checkpoint_meta(ckpt_dir: str | os.PathLike) -> dict:
    path = os.path.join(os.fspath(ckpt_dir), META)
    if not os.path.exists(path):
        raise CheckpointError(
            f"{ckpt_dir}: no {META}; not a megarl megatron checkpoint (write one with "
            "`tools/convert.py hf-to-mcore` or the trainer)"
        )
    try:
        with open(path) as f:
            meta = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not a JSON object ({e})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(meta).__name__}")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {meta.get('format')!r}; expected {FORMAT!r}")
    if not os.path.exists(os.path.join(os.fspath(ckpt_dir), "metadata.json")):
        raise CheckpointError(f"{ckpt_dir}: megatron's metadata.json is missing (incomplete save)")
    return meta


_DCP_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.planner",
    "torch.distributed.checkpoint.filesystem",
)


_PLAIN_GLOBALS = {
    ("torch.serialization", "_get_layout"),  # a dict lookup of torch.strided & co. by name
    ("collections", "OrderedDict"),
    # StorageMeta.checkpoint_id may be a path object (constructing one touches no file)
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


class _RefusedGlobal(pickle.UnpicklingError):
    """The pickle names a global outside what a `.metadata` file holds."""


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the globals a torch.distributed.checkpoint `.metadata` file needs: classes
    whose construction runs no caller-chosen code (DCP's dataclasses and enums, torch.Size, path
    objects), dtypes, and `_PLAIN_GLOBALS`."""

    def find_class(self, module: str, name: str):
        if module in _DCP_MODULES:
            obj = getattr(importlib.import_module(module), name, None)
            if isinstance(obj, type) and (
                dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)
            ):
                return obj
        elif module == "torch" and (
            name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return getattr(torch, name)
        elif (module, name) in _PLAIN_GLOBALS:
            return super().find_class(module, name)
        raise _RefusedGlobal(f"global '{module}.{name}' is not allowed")


def check_dcp_metadata(ckpt_dir: str | os.PathLike):
    """The `.metadata` record of a torch_dist checkpoint, unpickled safely. Refuses
    (`CheckpointError`) one that refers to anything but torch.distributed.checkpoint's metadata
    types (plain `pickle.load` of it would run code); a missing or cut file raises
    `IncompleteCheckpoint`."""
    path = os.path.join(os.fspath(ckpt_dir), ".metadata")
    if not os.path.exists(path):
        raise IncompleteCheckpoint(
            f"{ckpt_dir}: no .metadata (not a complete torch_dist checkpoint)"
        )
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f).load()
    except _RefusedGlobal as e:
        raise CheckpointError(
            f"{path}: refusing to load this checkpoint: its metadata is not a plain "
            f"torch.distributed.checkpoint record ({e}); unpickling it could run code. Use a "
            "checkpoint written by megarl / megatron-core, or one you trust, re-saved"
        ) from None
    except Exception as e:  # noqa: BLE001 - whatever the bytes are, the file is not usable
        raise IncompleteCheckpoint(
            f"{path}: unreadable ({type(e).__name__}: {e}); the file is cut or damaged"
        ) from None


def check_dcp_complete(ckpt_dir: str | os.PathLike) -> None:
    """Raise `IncompleteCheckpoint` naming the file when a torch_dist checkpoint lacks megatron's
    `metadata.json` / `common.pt` or a tensor file its `.metadata` refers to, or when such a
    file is shorter than the bytes recorded for it. Reads only `.metadata` and file sizes."""
    ckpt_dir = os.fspath(ckpt_dir)
    meta = check_dcp_metadata(ckpt_dir)
    for name in ("metadata.json", "common.pt"):
        if not os.path.exists(os.path.join(ckpt_dir, name)):
            raise IncompleteCheckpoint(f"{ckpt_dir}: megatron's {name} is missing")
    needed: dict[str, int] = {}
    for info in (getattr(meta, "storage_data", None) or {}).values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        path = os.path.join(ckpt_dir, name)
        if not os.path.exists(path):
            raise IncompleteCheckpoint(f"{path} is missing (its .metadata records {size} bytes)")
        have = os.path.getsize(path)
        if have < size:
            raise IncompleteCheckpoint(
                f"{path} is truncated: {have} bytes, its .metadata records {size}"
            )


def read_checkpoint_arch(ckpt_dir: str | os.PathLike) -> ModelArch:
    """The `ModelArch` a checkpoint (converter or trainer, see `megarl.convert.source`) was
    written for."""
    from megarl.convert.source import open_checkpoint

    return open_checkpoint(ckpt_dir).arch


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


def _has_value_head(model) -> bool:
    """Whether `model` (one chunk) belongs to a model with a scalar head (a critic, a reward
    model), also on a pipeline stage that holds no output layer."""
    from megarl.models.builder import SCALAR_ROLES

    head = getattr(model, "output_layer", None)
    if getattr(model, "megarl_role", None) in SCALAR_ROLES:
        return True
    return head is not None and type(head).__name__ == "ValueHead"


# --------------------------------------------------------------------------- sharded dicts
def _te_keys(sd: dict, arch: ModelArch) -> None:
    """Rename local-spec keys that differ from the TE spec (see the module docstring)."""
    if not arch.is_moe:
        return
    for v in sd.values():
        if getattr(v, "key", None) == _MOE_LOCAL_NORM:
            v.key = _MOE_TE_NORM


def _sharded_state_dict(chunks, arch: ModelArch, *, with_value_head: bool = True) -> dict:
    out = {}
    for k, chunk in enumerate(chunks):
        model = unwrap(chunk)
        sd = model.sharded_state_dict()
        if _has_value_head(model) and not with_value_head:
            sd = {n: v for n, v in sd.items() if not n.startswith("output_layer.")}
        _te_keys(sd, arch)
        out[f"chunk{k}"] = sd
    return out


def _check_arch(chunks, arch: ModelArch, where: str) -> None:
    """Raise naming each field where the chunks' model differs from the checkpoint's arch."""
    model = unwrap(chunks[0])
    c = model.config
    have = {
        "num_hidden_layers": c.num_layers,
        "hidden_size": c.hidden_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_query_groups or c.num_attention_heads,
        "head_dim": c.kv_channels,
        "vocab_size": getattr(model, "megarl_vocab_size", arch.vocab_size),
        "qkv_bias": bool(c.add_qkv_bias),
        "qk_norm": bool(c.qk_layernorm),
        "num_experts": c.num_moe_experts,
    }
    want = {
        "num_hidden_layers": arch.num_layers,
        "hidden_size": arch.hidden_size,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_key_value_heads,
        "head_dim": arch.head_dim,
        "vocab_size": arch.vocab_size,
        "qkv_bias": arch.qkv_bias,
        "qk_norm": arch.qk_norm,
        "num_experts": arch.num_experts,
    }
    if arch.is_moe:
        have["moe_intermediate_size"] = c.moe_ffn_hidden_size
        want["moe_intermediate_size"] = arch.moe_intermediate_size
    else:
        have["intermediate_size"] = c.ffn_hidden_size
        want["intermediate_size"] = arch.intermediate_size
    if not _has_value_head(model):
        have["tie_word_embeddings"] = bool(model.share_embeddings_and_output_weights)
        want["tie_word_embeddings"] = arch.tie_word_embeddings
    diff = [f"{k}: checkpoint {want[k]} vs model {have[k]}" for k in want if want[k] != have[k]]
    if diff:
        raise CheckpointError(f"{where} was written for a different model: " + "; ".join(diff))


# --------------------------------------------------------------------------- save / load
def _serve_for_parent() -> None:
    """The forked manager's initializer: the default stop signals (not the rank's handlers),
    and an exit as soon as the process that forked it is gone. A rank that ends without its
    atexit hooks (SIGKILL, the hang watchdog's `os._exit`) cannot shut its manager down, and a
    forked manager left behind would keep the rank's memory."""
    import signal
    import threading
    import time

    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="megarl-parent-watch", daemon=True).start()


def fork_write_results_queue() -> None:
    """The queue on which megatron-core's checkpoint writer processes report
    (`filesystem_async`) is served by a multiprocessing manager that megatron starts with
    "spawn" at the first `dist_checkpointing.save` (a CUDA context does not survive a fork): a
    fresh interpreter that imports torch to unpickle the first results, 2-3 s of every run's
    first save on CPU. Without CUDA it is forked here instead: the same queue for the same
    writers (which megatron forks anyway), with the default signal handlers and ending when the
    rank is gone (`_serve_for_parent`). The trainer calls this in `init_distributed`, before any
    model exists: a manager forked later would keep a copy-on-write snapshot of every page the
    run writes afterwards (its weights, optimizer states). The converter calls it before its one
    save, at its end. Nothing changes with CUDA initialised, or with a megatron-core that has no
    such queue."""
    if torch.cuda.is_initialized():
        return
    import multiprocessing as mp
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is not None:
        return  # made already (by megatron or here), or not this megatron-core
    manager = SyncManager(ctx=mp.get_context("fork"))
    manager.start(initializer=_serve_for_parent)
    filesystem_async._results_queue = manager.Queue()  # the proxy keeps the manager alive


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

    from megarl.convert.hf_io import copy_tokenizer_files, looks_like_checkpoint

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
        "value_head": _has_value_head(model),
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


def load_model_checkpoint(
    chunks: list[torch.nn.Module], ckpt_dir: str | os.PathLike, role: str | None = None
) -> None:
    """Load a checkpoint (converter or trainer: `megarl.convert.source`, which does the work)
    into chunks built at any TP / PP / VPP / EP layout (collective).

    Raises `CheckpointError` if the checkpoint was written for a different model, or if a model
    tensor is absent from it. A critic's value head is loaded only from a critic. (A
    DistributedOptimizer keeps its own fp32 copies: reload them from the model params after
    this.)"""
    from megarl.convert.source import load_into, open_checkpoint

    load_into(chunks, open_checkpoint(ckpt_dir, role))
