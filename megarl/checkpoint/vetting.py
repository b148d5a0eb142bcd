"""What is checked before megatron-core reads a checkpoint directory, and the newest complete
checkpoint of a run.

Untrusted directories: a checkpoint may come from elsewhere, and reading it must not run code.
torch.distributed.checkpoint reads a checkpoint's `.metadata` with plain `pickle.load`
(torch 2.13), so `check_dcp_metadata` unpickles it first with an unpickler that resolves only
what that file holds (torch.distributed.checkpoint's dataclasses and enums, torch.Size, dtypes,
layouts) and refuses anything else; every load calls it before megatron reads the directory.
The tensor files and megatron's `common.pt` are read with `torch.load(weights_only=True)` by
torch and megatron-core themselves; the trainer state is JSON (`files`).

Damaged checkpoints: `resumable` walks a run's checkpoints newest first and skips one whose
trainer state cannot be read or whose tensor files are missing or shorter than its `.metadata`
records (`check_dcp_complete`: file sizes only, no tensor is read), with a warning naming it and
the one resumed from. A skipped checkpoint is never deleted: rank 0 renames it
`step_N.unreadable`, out of the way of pruning and of the run's next save of step N.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import logging
import os
import pickle

import torch
import torch.distributed as dist

from megarl.checkpoint.files import (
    CheckpointError,
    IncompleteCheckpoint,
    list_checkpoints,
    read_trainer_state,
)

log = logging.getLogger(__name__)

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


def resumable(run_dir: str, check=None) -> tuple[str, dict] | None:
    """Collective (every rank, before the models exist). The newest checkpoint of `run_dir`
    that is complete, as (directory, trainer state), or None when there is none.

    A checkpoint that raises `IncompleteCheckpoint` (unreadable trainer state, a tensor file
    missing or cut) is skipped with a warning and renamed aside, never deleted (module doc).
    `check(path, state)` adds the caller's checks; what it raises (a checkpoint of another
    model, say) stops the run as before: such a checkpoint is whole, just not this run's."""
    skipped, found = [], None
    for _, path in reversed(list_checkpoints(run_dir)):
        try:
            state = read_trainer_state(path)
            check_dcp_complete(path)
        except IncompleteCheckpoint as e:
            skipped.append((path, str(e)))
            continue
        if check is not None:
            check(path, state)
        found = (path, state)
        break
    if not skipped:
        return found
    dist.barrier()  # every rank has read what it needs from the skipped directories
    newest = f"resuming from {found[0]}" if found else "no complete checkpoint left: step 0"
    for path, why in skipped:
        aside = _aside(path)
        if dist.get_rank() == 0:
            os.replace(path, aside)
            log.warning("skipped checkpoint %s (%s); kept as %s; %s", path, why, aside, newest)
    dist.barrier()
    return found


def _aside(path: str) -> str:
    """`step_N.unreadable` (`.unreadable.2`, ... when taken): where a skipped checkpoint goes."""
    aside, k = f"{path}.unreadable", 1
    while os.path.exists(aside):
        k += 1
        aside = f"{path}.unreadable.{k}"
    return aside
