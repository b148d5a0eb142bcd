"""Hugging Face checkpoint directories, written atomically and sharded as transformers does.

`write_hf_files` buffers one shard (at most `max_shard_bytes`), writes it with safetensors, and
names the shards as transformers does (`model-00001-of-00003.safetensors` + index; a single shard
is `model.safetensors`). When every name, shape and dtype is known in advance,
`StreamingShardWriter` instead writes each shard's header first and then appends the tensors one
at a time (nothing buffered). Everything is written into a hidden temporary sibling directory
(`AtomicDir`) that is renamed onto `out_dir` at the end, so an interrupted write never leaves a
directory that looks complete.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import uuid
from collections.abc import Iterable

import torch

from megarl.checkpoint.files import HF_INDEX as INDEX
from megarl.checkpoint.files import copy_tokenizer_files, looks_like_checkpoint
from megarl.convert.hf_io import SAFETENSORS_DTYPES, HFCheckpointError
from megarl.errors import OutputExistsError

log = logging.getLogger(__name__)


class AtomicDir:
    """Write into a hidden temporary sibling of `out_dir`; `commit()` renames it into place.

    Refuses an `out_dir` that already holds a checkpoint unless `overwrite`; any non-empty
    directory is refused too (its files would be lost)."""

    def __init__(self, out_dir: str | os.PathLike, *, overwrite: bool = False):
        self.out = os.path.abspath(os.fspath(out_dir))
        if os.path.exists(self.out):
            if not os.path.isdir(self.out):
                raise OutputExistsError(f"{self.out} exists and is not a directory")
            if os.listdir(self.out) and not overwrite:
                what = "a checkpoint" if looks_like_checkpoint(self.out) else "files"
                raise OutputExistsError(
                    f"{self.out} already holds {what}; pass --overwrite (overwrite=True) to "
                    "replace it"
                )
        parent, base = os.path.split(self.out)
        os.makedirs(parent, exist_ok=True)
        self.tmp = os.path.join(parent, f".{base}.tmp-{uuid.uuid4().hex[:8]}")
        os.makedirs(self.tmp)

    def commit(self) -> str:
        old = None
        if os.path.exists(self.out):
            old = self.tmp + ".old"
            os.rename(self.out, old)
        os.rename(self.tmp, self.out)
        if old:
            shutil.rmtree(old, ignore_errors=True)
        return self.out

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> AtomicDir:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def write_hf_files(
    directory: str,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    max_shard_bytes: int = 2 * 2**30,
    progress=None,
) -> dict:
    """Write `tensors` as safetensors shards (+ index) into an existing `directory`.

    Returns the weight map. `progress(nbytes)` is called after each tensor."""
    from safetensors.torch import save_file

    shards: list[list[str]] = []
    weight_map: dict[str, str] = {}
    buf: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush():
        nonlocal buf, size
        if buf:
            name = f"model-{len(shards) + 1:05d}.safetensors"
            save_file(buf, os.path.join(directory, name), metadata={"format": "pt"})
            shards.append(list(buf))
            buf, size = {}, 0

    for name, t in tensors:
        if name in buf or name in weight_map:
            raise HFCheckpointError(f"tensor {name!r} written twice")
        n = t.numel() * t.element_size()
        if buf and size + n > max_shard_bytes:
            flush()
        # safetensors needs contiguous, non-shared storage
        buf[name] = t.detach().contiguous()
        weight_map[name] = ""
        size += n
        total += n
        if progress is not None:
            progress(n)
    flush()
    final = {}
    for k, names in enumerate(shards):
        src = os.path.join(directory, f"model-{k + 1:05d}.safetensors")
        dst = (
            "model.safetensors"
            if len(shards) == 1
            else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        os.rename(src, os.path.join(directory, dst))
        for n in names:
            final[n] = dst
    if len(shards) > 1:
        with open(os.path.join(directory, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": final}, f, indent=2)
    return final


_DTYPE_TAGS = {v: k for k, v in SAFETENSORS_DTYPES.items()}


class StreamingShardWriter:
    """Safetensors shards written tensor by tensor, for tensors whose names, shapes and dtypes
    are known before the first byte (`specs`, in writing order).

    A safetensors header lists every tensor's byte range, so with the specs up front each shard's
    header is written first and each tensor's bytes are appended as it arrives: nothing is
    buffered (peak: the tensor passed to `write`). Shards are cut in order at `max_shard_bytes`
    and named as transformers does; `close()` checks that every spec was written and writes the
    index when there is more than one shard. Tensors are not padded for alignment (safetensors
    forbids gaps), so mixed-dtype specs can leave a tensor at an odd offset; one dtype cannot."""

    def __init__(
        self,
        directory: str,
        specs: list[tuple[str, tuple[int, ...], torch.dtype]],
        *,
        max_shard_bytes: int = 2 * 2**30,
    ):
        self.dir = directory
        self.specs = specs
        groups: list[list[int]] = []
        size = 0
        for k, (name, shape, dtype) in enumerate(specs):
            if dtype not in _DTYPE_TAGS:
                raise HFCheckpointError(f"tensor {name!r}: dtype {dtype} cannot be written")
            n = _nbytes(shape, dtype)
            if not groups or (size + n > max_shard_bytes and groups[-1]):
                groups.append([])
                size = 0
            groups[-1].append(k)
            size += n
        if len(set(n for n, _, _ in specs)) != len(specs):
            raise HFCheckpointError("tensor names in the writing plan are not unique")
        self.files = [
            "model.safetensors"
            if len(groups) == 1
            else f"model-{g + 1:05d}-of-{len(groups):05d}.safetensors"
            for g in range(len(groups))
        ]
        self.file_of = {specs[k][0]: self.files[g] for g, ks in enumerate(groups) for k in ks}
        self._groups = groups
        self._next = 0  # index into specs
        self._file = None
        self._left = 0  # tensors still to write into the open file

    def _open(self, g: int) -> None:
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for k in self._groups[g]:
            name, shape, dtype = self.specs[k]
            n = _nbytes(shape, dtype)
            header[name] = {
                "dtype": _DTYPE_TAGS[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + n],
            }
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # as safetensors pads: the data starts 8-byte aligned
        self._file = open(os.path.join(self.dir, self.files[g]), "wb")
        self._file.write(struct.pack("<Q", len(raw)) + raw)
        self._left = len(self._groups[g])

    def write(self, name: str, t: torch.Tensor) -> None:
        """Append the next tensor of the plan (its name, shape and dtype must match)."""
        if self._next >= len(self.specs):
            raise HFCheckpointError(f"tensor {name!r} given after all {len(self.specs)} planned")
        want, shape, dtype = self.specs[self._next]
        if name != want or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise HFCheckpointError(
                f"tensor #{self._next} is {name!r} {tuple(t.shape)} {t.dtype}; the plan expects "
                f"{want!r} {tuple(shape)} {dtype}"
            )
        if self._file is None:
            self._open(next(g for g, ks in enumerate(self._groups) if self._next in ks))
        t = t.detach().contiguous().cpu()
        if t.numel():
            self._file.write(memoryview(t.view(-1).view(torch.uint8).numpy()))
        self._next += 1
        self._left -= 1
        if self._left == 0:
            self._file.close()
            self._file = None

    def close(self) -> dict[str, str]:
        """Finish; returns the weight map (name -> file)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._next != len(self.specs):
            raise HFCheckpointError(
                f"only {self._next} of {len(self.specs)} planned tensors were written (next: "
                f"{self.specs[self._next][0]!r})"
            )
        if len(self.files) > 1:
            total = sum(_nbytes(s, d) for _, s, d in self.specs)
            with open(os.path.join(self.dir, INDEX), "w") as f:
                json.dump(
                    {"metadata": {"total_size": total}, "weight_map": self.file_of}, f, indent=2
                )
        return dict(self.file_of)

    def abort(self) -> None:
        """Close the open file (the caller discards the directory)."""
        if self._file is not None:
            self._file.close()
            self._file = None


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def save_hf_dir(
    out_dir: str | os.PathLike,
    hf_config: dict,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    tokenizer_dir: str | os.PathLike | None = None,
    max_shard_bytes: int = 2 * 2**30,
    overwrite: bool = False,
    progress=None,
) -> str:
    """Write an HF model directory (config.json, sharded safetensors, tokenizer files)
    atomically; returns `out_dir`. `tensors` is consumed lazily (peak: one shard buffered)."""
    with AtomicDir(out_dir, overwrite=overwrite) as d:
        write_hf_files(d.tmp, tensors, max_shard_bytes=max_shard_bytes, progress=progress)
        with open(os.path.join(d.tmp, "config.json"), "w") as f:
            json.dump(hf_config, f, indent=2, sort_keys=True)
        if tokenizer_dir is not None:
            copy_tokenizer_files(tokenizer_dir, d.tmp)
    return d.out
