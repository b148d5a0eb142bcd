"""Hugging Face checkpoint directories, read lazily (writing them: `megarl.convert.hf_write`).

Reading parses the safetensors header (8-byte little-endian length + JSON) and reads each tensor
with one `readinto` into a fresh tensor: no mmap, so the resident set holds only the tensors a
caller keeps (an mmap'ed file would count its touched pages in RSS). Names, dtypes and shapes
come from the headers without reading data; `model.safetensors.index.json` is honoured when
present, otherwise every `*.safetensors` file in the directory is read. Block-FP8 weights and
gpt-oss's stacked (MXFP4) experts read as the bf16 tensors they stand for
(`megarl.convert.fp8_blocks`, `megarl.convert.stacked`).
"""

from __future__ import annotations

import json
import logging
import os
import struct
from collections.abc import Iterator

import torch

from megarl.checkpoint.files import HF_INDEX as INDEX
from megarl.convert import fp8_blocks, stacked
from megarl.errors import UserError

log = logging.getLogger(__name__)

# safetensors dtype tags -> torch
SAFETENSORS_DTYPES = {
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
                if meta["dtype"] not in SAFETENSORS_DTYPES:
                    raise HFCheckpointError(
                        f"{path}: tensor {name!r} has dtype {meta['dtype']}; accepted: "
                        f"{sorted(SAFETENSORS_DTYPES)}"
                    )
                self._entries[name] = (path, start, meta)
        self._scales, self._block = fp8_blocks.pair_scales(
            self.dir, {n: m for n, (_, _, m) in self._entries.items()}, HFCheckpointError
        )
        # gpt-oss's stacked experts, read per expert (megarl.convert.stacked)
        self._experts = stacked.ExpertSlices(
            {n: tuple(m["shape"]) for n, (_, _, m) in self._entries.items()}
        )
        self._hidden = set(self._scales.values()) | self._experts.hidden

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
            out += self._experts.expanded.get(n, [] if n in self._hidden else [n])
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, name: object) -> bool:
        return name in self._experts.of or (
            name in self._entries
            and name not in self._hidden
            and name not in self._experts.expanded
        )

    def _entry(self, name: str):
        try:
            return self._entries[self._experts.of.get(name, (name,))[0]]
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
        return self._experts.shape(name, shape) if name in self._experts.of else shape

    def dtype(self, name: str) -> torch.dtype:
        if name in self._scales:
            return torch.bfloat16
        stored = SAFETENSORS_DTYPES[self._entry(name)[2]["dtype"]]
        return self._experts.dtype(name, stored) if name in self._experts.of else stored

    def nbytes(self, name: str) -> int:
        """Bytes of the tensor as read (a block-FP8 or MXFP4 weight: its bf16 size)."""
        if name in self._experts.of:
            n = self.dtype(name).itemsize
            for d in self.shape(name):
                n *= d
            return n
        begin, end = self._entry(name)[2]["data_offsets"]
        return (end - begin) * (2 if name in self._scales else 1)

    def total_bytes(self) -> int:
        return sum(self.nbytes(n) for n in self.names)

    def get(self, name: str) -> torch.Tensor:
        if name in self._experts.of:
            return self._experts.read(name, self._read_raw)
        meta = self._entry(name)[2]
        return self._read(name, 0, meta["shape"][0] if meta["shape"] else 1)

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows `start:stop` of a tensor (dim 0), reading only their bytes: a row range of a
        row-major tensor is one contiguous byte range of the file (an expert of a stacked
        tensor: read whole, then cut)."""
        if name in self._experts.of:
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
        dtype = SAFETENSORS_DTYPES[meta["dtype"]]
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
