"""Checksums of a weight sync, one per tensor family, computed on both sides of a transfer.

A family is an HF tensor name with its layer index replaced (`model.layers.N.mlp.down_proj.weight`
sums every layer's `down_proj`), so a mismatch says which kind of tensor went wrong while the
comparison stays a few dozen numbers. Each tensor contributes two sums over its bytes read as
64-bit integer words (the last 0-7 bytes one by one), modulo 2^64: the plain sum, and a
position-weighted one. For the second the words are laid out as rows of 512 (4 KiB): the sum
over rows of (row index + 1) x the row's sum, plus an odd constant x the sum over columns of
(column index + 1) x the column's sum (odd: a bijection modulo 2^64, so no bit of the columns'
sum is lost), and the words and bytes past the last whole row weighted by position; so
moving a word to another row or column changes it, and a value moved within a word changes the
word. Integer sums modulo 2^64 do not depend on the order or the threads that add them, so both
sides agree exactly on equal bytes, and a changed bit, a swapped pair or a skipped tensor
changes them. Cost: two passes over the tensor's bytes, which torch reduces as int64 without
widening each value first.
"""

from __future__ import annotations

import re

import torch

_MOD = 2**64
_ROW = 512  # words per row: 4 KiB
_BLOCK = 8192  # rows per block: 32 MiB
_COLUMNS = 0x9E3779B97F4A7C15  # odd (2^64 / the golden ratio)
_LAYER = re.compile(r"\.\d+\.")


def family(hf_name: str) -> str:
    """`hf_name` with every layer / expert index replaced by N."""
    return _LAYER.sub(".N.", hf_name)


def tensor_sums(t: torch.Tensor) -> tuple[int, int]:
    """(plain, position-weighted) integer sums of `t`'s bytes, modulo 2^64 (module doc)."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8)
    whole = data.numel() // 8 * 8
    try:
        words = data[:whole].view(torch.int64)
    except RuntimeError:  # a view that starts off an 8-byte boundary: an aligned copy
        words = data[:whole].clone().view(torch.int64)
    rows = words.numel() // _ROW
    by_row, by_col = 0, torch.zeros(_ROW, dtype=torch.int64)
    for start in range(0, rows, _BLOCK):
        block = words[start * _ROW : min(rows, start + _BLOCK) * _ROW].view(-1, _ROW)
        at = torch.arange(start + 1, start + 1 + block.shape[0], dtype=torch.int64)
        by_row += int((block.sum(1) * at).sum())  # int64 arithmetic wraps: modulo 2^64
        by_col += block.sum(0)
    tail = torch.cat([words[rows * _ROW :], data[whole:].to(torch.int64)])
    at = torch.arange(rows * _ROW + 1, rows * _ROW + 1 + tail.numel(), dtype=torch.int64)
    plain = int(by_col.sum()) + int(tail.sum())
    cols = int((by_col * torch.arange(1, _ROW + 1, dtype=torch.int64)).sum())
    weighted = by_row + _COLUMNS * cols + int((tail * at).sum())
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


def merged(states: list[dict]) -> dict[str, tuple[int, int, int]]:
    """The `FamilySums.state()` of all the tensors of `states` (several senders' shares of one
    sync): the sums add modulo 2^64, so the order of the senders does not matter."""
    out: dict[str, list[int]] = {}
    for state in states:
        for key, (plain, weighted, count) in state.items():
            s = out.setdefault(key, [0, 0, 0])
            s[0], s[1], s[2] = (s[0] + plain) % _MOD, (s[1] + weighted) % _MOD, s[2] + count
    return {k: tuple(v) for k, v in out.items()}


def mismatched(sent: dict, received: dict) -> list[str]:
    """The families whose checksums (or tensor counts) differ, or that only one side has."""
    return sorted(k for k in set(sent) | set(received) if sent.get(k) != received.get(k))
