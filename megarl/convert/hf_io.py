"""Hugging Face checkpoint directories: lazy safetensors reading, atomic sharded writing.

Reading parses the safetensors header (8-byte little-endian length + JSON) and reads each tensor
with one `readinto` into a fresh tensor: no mmap, so the resident set holds only the tensors a
caller keeps (an mmap'ed file would count its touched pages in RSS). Names, dtypes and shapes
come from the headers without reading data; `model.safetensors.index.json` is honoured when
present, otherwise every `*.safetensors` file in the directory is read.

Writing (`write_hf_files`) buffers one shard (at most `max_shard_bytes`), writes it with
safetensors, and names the shards as transformers does (`model-00001-of-00003.safetensors` +
index; a single shard is `model.safetensors`). When every name, shape and dtype is known in
advance, `StreamingShardWriter` instead writes each shard's header first and then appends the
tensors one at a time (nothing buffered). Everything is written into a hidden temporary sibling
directory (`AtomicDir`) that is renamed onto `out_dir` at the end, so an interrupted write never
leaves a directory that looks complete.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import uuid
from collections.abc import Iterable, Iterator

import torch

from megarl.checkpoint.files import HF_INDEX as INDEX
from megarl.checkpoint.files import copy_tokenizer_files, looks_like_checkpoint
from megarl.convert import fp8_blocks, stacked
from megarl.errors import OutputExistsError, UserError

log = logging.getLogger(__name__)

# safetensors dtype tags -> torch
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class HFCheckpointError(UserError, ValueError):
    """An HF directory megarl cannot read or write; the message names the file."""


def read_safetensors_header(path: str) -> tuple[dict, int]:
    """(header dict without `__metadata__`, byte offset where the data starts)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise HFCheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 * 2**20:
            raise HFCheckpointError(f"{path}: not a safetensors file (header length {n})")
        raw = f.read(n)
    if len(raw) != n:
        raise HFCheckpointError(
            f"{path}: not a safetensors file (header of {n} bytes announced, {len(raw)} present)"
        )
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFCheckpointError(
            f"{path}: not a safetensors file (its header is not JSON: {e}); the file is corrupt "
            "or was not written by safetensors: download or save it again"
        ) from None
    if not isinstance(header, dict) or not all(
        isinstance(m, dict) and {"dtype", "shape", "data_offsets"} <= m.keys()
        for k, m in header.items()
        if k != "__metadata__"
    ):
        raise HFCheckpointError(
            f"{path}: not a safetensors file (its header is not a map of name -> "
            "{dtype, shape, data_offsets})"
        )
    header.pop("__metadata__", None)
    return header, 8 + n


class LazyHFTensors:
    """Mapping-like view of an HF model directory's safetensors tensors, read on demand.

    `names` (a list), `shape(name)`, `dtype(name)` and `nbytes(name)` read only headers; `get(name)`
    reads one tensor into memory (the caller owns it)."""

    def __init__(self, directory: str | os.PathLike):
        self.dir = os.fspath(directory)
        self._entries: dict[str, tuple[str, int, dict]] = {}  # name -> (file, data start, meta)
        for path in self._files():
            header, start = read_safetensors_header(path)
            for name, meta in header.items():
                if name in self._entries:
                    raise HFCheckpointError(
                        f"tensor {name!r} appears in both {self._entries[name][0]} and {path}"
                    )
                if meta["dtype"] not in _DTYPES:
                    raise HFCheckpointError(
                        f"{path}: tensor {name!r} has dtype {meta['dtype']}; accepted: "
                        f"{sorted(_DTYPES)}"
                    )
                self._entries[name] = (path, start, meta)
        self._scales, self._block = fp8_blocks.pair_scales(
            self.dir, {n: m for n, (_, _, m) in self._entries.items()}, HFCheckpointError
        )
        # gpt-oss's stacked experts, read per expert (megarl.convert.stacked)
        self._slices: dict[str, tuple[str, int]] = {}
        self._stacked: dict[str, list[str]] = {}
        for n, (_, _, meta) in self._entries.items():
            for v, whole, e in stacked.slices(n, tuple(meta["shape"])):
                self._slices[v] = (whole, e)
                self._stacked.setdefault(whole, []).append(v)
        mx = [n.removesuffix("_blocks") + "_scales" for n in self._stacked if n.endswith("_blocks")]
        self._hidden = set(self._scales.values()) | set(mx)

    def _files(self) -> list[str]:
        if not os.path.isdir(self.dir):
            raise HFCheckpointError(f"{self.dir}: not a directory")
        index = os.path.join(self.dir, INDEX)
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f).get("weight_map")
            except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
                raise HFCheckpointError(f"{index}: not a JSON object ({e})") from None
            if not isinstance(weight_map, dict):
                raise HFCheckpointError(f"{index}: no 'weight_map' object")
            files = sorted(set(weight_map.values()))
            for name in files:
                if not os.path.exists(os.path.join(self.dir, name)):
                    raise HFCheckpointError(f"{index} lists {name!r}, which is not in {self.dir}")
            return [os.path.join(self.dir, n) for n in files]
        files = sorted(n for n in os.listdir(self.dir) if n.endswith(".safetensors"))
        if not files:
            other = [n for n in os.listdir(self.dir) if n.endswith((".bin", ".pt", ".pth"))]
            hint = f" (found {other[:3]}: re-save with safe_serialization=True)" if other else ""
            raise HFCheckpointError(f"{self.dir}: no *.safetensors files{hint}")
        return [os.path.join(self.dir, n) for n in files]

    @property
    def names(self) -> list[str]:
        """All tensor names, in file order (block-FP8 and MXFP4 scales are not tensors of the
        model; stacked experts are named per expert)."""
        out = []
        for n in self._entries:
            if n in self._stacked:
                out += self._stacked[n]
            elif n not in self._hidden:
                out.append(n)
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, name: object) -> bool:
        return name in self._slices or (
            name in self._entries and name not in self._hidden and name not in self._stacked
        )

    def _entry(self, name: str):
        try:
            return self._entries[self._slices[name][0] if name in self._slices else name]
        except KeyError:
            raise KeyError(f"{self.dir}: no tensor named {name!r}") from None

    @property
    def fp8_blocks(self) -> int:
        """How many weights are stored as block-scaled FP8 (read as bf16)."""
        return len(self._scales)

    def file_of(self, name: str) -> str:
        return self._entry(name)[0]

    def shape(self, name: str) -> tuple[int, ...]:
        shape = tuple(self._entry(name)[2]["shape"])
        if name in self._slices:
            return stacked.slice_shape(self._slices[name][0], shape)
        return shape

    def dtype(self, name: str) -> torch.dtype:
        if name in self._scales or self._slices.get(name, ("",))[0].endswith("_blocks"):
            return torch.bfloat16
        return _DTYPES[self._entry(name)[2]["dtype"]]

    def nbytes(self, name: str) -> int:
        """Bytes of the tensor as read (a block-FP8 or MXFP4 weight: its bf16 size)."""
        if name in self._slices:
            n = self.dtype(name).itemsize
            for d in self.shape(name):
                n *= d
            return n
        begin, end = self._entry(name)[2]["data_offsets"]
        return (end - begin) * (2 if name in self._scales else 1)

    def total_bytes(self) -> int:
        return sum(self.nbytes(n) for n in self.names)

    def get(self, name: str) -> torch.Tensor:
        if name in self._slices:
            return stacked.read_slice(*self._slices[name], self._read_raw)
        meta = self._entry(name)[2]
        return self._read(name, 0, meta["shape"][0] if meta["shape"] else 1)

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows `start:stop` of a tensor (dim 0), reading only their bytes: a row range of a
        row-major tensor is one contiguous byte range of the file (an expert of a stacked
        tensor: read whole, then cut)."""
        if name in self._slices:
            return self.get(name)[start:stop]
        shape = self._entry(name)[2]["shape"]
        if not shape or not 0 <= start <= stop <= shape[0]:
            raise HFCheckpointError(
                f"{self.file_of(name)}: rows {start}:{stop} of {name!r} (shape {shape}) do not "
                "exist"
            )
        return self._read(name, start, stop)

    def _read(self, name: str, start: int, stop: int) -> torch.Tensor:
        if name in self._scales:
            scale = self._read_raw(self._scales[name], 0, self.shape(self._scales[name])[0])
            raw = self._read_raw(name, start, stop)
            return fp8_blocks.dequantize(raw, scale, self._block, start)
        return self._read_raw(name, start, stop)

    def _read_raw(self, name: str, start: int, stop: int) -> torch.Tensor:
        path, data_start, meta = self._entry(name)
        begin, end = meta["data_offsets"]
        shape = list(meta["shape"])
        dtype = _DTYPES[meta["dtype"]]
        full = 1
        for d in shape:
            full *= d
        if full * dtype.itemsize != end - begin:
            raise HFCheckpointError(
                f"{path}: tensor {name!r} has {end - begin} bytes for shape {shape} "
                f"{meta['dtype']} ({full * dtype.itemsize} expected)"
            )
        row = (end - begin) // shape[0] if shape and shape[0] else 0
        t = torch.empty([stop - start, *shape[1:]] if shape else [], dtype=dtype)
        if not t.numel():
            return t
        view = memoryview(t.view(-1).view(torch.uint8).numpy())
        with open(path, "rb", buffering=0) as f:
            f.seek(data_start + begin + start * row)
            got = 0
            while got < len(view):
                n = f.readinto(view[got:])
                if not n:
                    raise HFCheckpointError(f"{path}: truncated while reading {name!r}")
                got += n
        return t

    __getitem__ = get


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


_DTYPE_TAGS = {v: k for k, v in _DTYPES.items()}


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
