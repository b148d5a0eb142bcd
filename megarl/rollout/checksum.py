"""Checksums of a weight sync, one per tensor family, computed on both sides of a transfer.

A family is an HF tensor name with its layer index replaced (`model.layers.N.mlp.down_proj.weight`
sums every layer's `down_proj`), so a mismatch says which kind of tensor went wrong while the
comparison stays a few dozen numbers. Each tensor contributes two sums over its bytes read as
integers (int16 for 2-byte dtypes, int32 for 4-byte ones), modulo 2^64: the plain sum, and a
position-weighted one. For the second the bytes are laid out as rows of 1024: the sum over rows
of (row index + 1) x the row's sum, plus 2^32 x the sum over columns of (column index + 1) x
the column's sum (and the tail past the last whole row weighted by position), so moving a value
to another row or column changes it. Integer sums do not depend on the order or the threads
that add them, so both sides agree exactly on equal bytes, and a changed bit, a swapped pair or
a skipped tensor changes them. Cost: about three passes over the tensor's bytes, in blocks.
"""

from __future__ import annotations

import re

import torch

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MOD = 2**64
_ROW = 1024
_BLOCK = 4096  # rows per int64 block: 32 MiB
_LAYER = re.compile(r"\.\d+\.")


def family(hf_name: str) -> str:
    """`hf_name` with every layer / expert index replaced by N."""
    return _LAYER.sub(".N.", hf_name)


def tensor_sums(t: torch.Tensor) -> tuple[int, int]:
    """(plain, position-weighted) integer sums of `t`'s bytes, modulo 2^64 (module doc)."""
    flat = t.detach().contiguous().reshape(-1)
    flat = flat.view(_INT_VIEW[flat.element_size()])
    rows = flat.numel() // _ROW
    by_row, by_col = 0, torch.zeros(_ROW, dtype=torch.int64)
    for start in range(0, rows, _BLOCK):  # int64 blocks: torch reduces those fastest
        block = flat[start * _ROW : min(rows, start + _BLOCK) * _ROW].view(-1, _ROW)
        block = block.to(torch.int64)
        at = torch.arange(start + 1, start + 1 + block.shape[0], dtype=torch.int64)
        by_row += int((block.sum(1) * at).sum())
        by_col += block.sum(0)
    tail = flat[rows * _ROW :].to(torch.int64)
    at = torch.arange(rows + 1, rows + 1 + tail.numel(), dtype=torch.int64)
    plain = int(by_col.sum()) + int(tail.sum())
    cols = int((by_col * torch.arange(1, _ROW + 1, dtype=torch.int64)).sum())
    weighted = by_row + (cols << 32) + int((tail * at).sum())
    return plain % _MOD, weighted % _MOD


class FamilySums:
    """Running checksums per family; `add` each tensor as it is sent or received."""

    def __init__(self):
        self.sums: dict[str, list[int]] = {}
        self.tensors: dict[str, int] = {}

    def add(self, hf_name: str, t: torch.Tensor) -> None:
        plain, weighted = tensor_sums(t)
        key = family(hf_name)
        s = self.sums.setdefault(key, [0, 0])
        s[0], s[1] = (s[0] + plain) % _MOD, (s[1] + weighted) % _MOD
        self.tensors[key] = self.tensors.get(key, 0) + 1

    def state(self) -> dict[str, tuple[int, int, int]]:
        """{family: (plain, weighted, tensors)}: what the other side compares against."""
        return {k: (*v, self.tensors[k]) for k, v in self.sums.items()}


def mismatched(sent: dict, received: dict) -> list[str]:
    """The families whose checksums (or tensor counts) differ, or that only one side has."""
    return sorted(k for k in set(sent) | set(received) if sent.get(k) != received.get(k))
