"""Sequence packing: the sequences of a micro-batch concatenated into one row, so that no forward
or backward multiplies padding.

One packed micro-batch of n sequences (here a: 3 tokens, b: 2) in a row of T tokens:

    row position    0   1   2   3   4   5   6        T = 7, a multiple of pad_to (here 7)
    token           a0  a1  a2  b0  b1  .   .        `.`: tail padding (token id 0)
    cu_seqlens      [0, 3, 5, 7]                     the tail is a segment of its own
    RoPE position   0   1   2   0   1   0   1        restarts in every segment

The model runs on `[1, T]` with megatron's THD format (`PackedSeqParams`): attention is causal
within each segment and never crosses one, and rotary positions restart in each, so every token's
output equals the unpacked forward's. The micro-batch keeps its per-token fields in the padded
`[n, S]` layout of `megarl.data.batch` (what the losses read); `pack` takes such a field to the
row, `unpack` takes a per-token model output back (zeros on padding positions).

Micro-batches are formed by first-fit decreasing over the sequences' real lengths under a token
budget (`first_fit_decreasing`), so a step's passes run on few, dense rows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedRows:
    """Where each sequence of a micro-batch sits in its packed row (see the module docstring).

    Positions `[0, real)` of the row hold the micro-batch's real tokens, row by row in the
    micro-batch's order; `[real, length)` is tail padding."""

    rows: torch.Tensor
    """[real] long: the micro-batch row of each real packed position."""
    cols: torch.Tensor
    """[real] long: its column (position in its sequence)."""
    cu_seqlens: torch.Tensor
    """[segments + 1] int32: segment boundaries in the row (the tail padding, when there is
    any, is the last segment)."""
    max_seqlen: int
    """Longest segment."""
    length: int
    """T, the row's length (a multiple of the micro-batching's pad_to)."""

    @property
    def real(self) -> int:
        """Real (non-padding) tokens in the row."""
        return self.rows.numel()

    @classmethod
    def of(cls, seq_len: torch.Tensor, pad_to: int = 1, length: int | None = None) -> PackedRows:
        """The packing of sequences of lengths `seq_len` [n] in row order, in a row of
        `length` tokens (default: their sum rounded up to a multiple of `pad_to`)."""
        lengths = [int(x) for x in seq_len]
        real = sum(lengths)
        if length is None:
            length = -(-real // pad_to) * pad_to
        if length < real:
            raise ValueError(f"PackedRows: {real} tokens do not fit a row of {length}")
        rows = torch.cat([torch.full((n,), r, dtype=torch.long) for r, n in enumerate(lengths)])
        cols = torch.cat([torch.arange(n) for n in lengths])
        segments = [n for n in lengths if n] + ([length - real] if length > real else [])
        bounds = torch.tensor([0, *segments], dtype=torch.int64).cumsum(0).to(torch.int32)
        return cls(rows, cols, bounds, max(segments, default=0), length)

    def padded_to(self, length: int) -> PackedRows:
        """The same packing in a longer row (pipeline stages exchange one fixed shape)."""
        if length == self.length:
            return self
        return PackedRows.of(torch.bincount(self.rows), length=length)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """A field of the micro-batch's `[n, S, ...]` layout as the row: `[1, T, ...]` (zeros on
        the tail padding)."""
        real = x[self.rows.to(x.device), self.cols.to(x.device)]
        tail = real.new_zeros(self.length - self.real, *real.shape[1:])
        return torch.cat([real, tail]).unsqueeze(0)

    def unpack(self, y: torch.Tensor, rows: int, width: int) -> torch.Tensor:
        """A per-token model output `[1, T, ...]` in the micro-batch's `[rows, width, ...]`
        layout (zeros where no real token is; differentiable with respect to `y`)."""
        out = y.new_zeros(rows, width, *y.shape[2:])
        index = (self.rows.to(y.device), self.cols.to(y.device))
        return out.index_put(index, y[0, : self.real])

    def to(self, device) -> PackedRows:
        """On `device` (megatron's THD attention reads `cu_seqlens` there)."""
        return dataclasses.replace(self, cu_seqlens=self.cu_seqlens.to(device))

    def seq_params(self):
        """megatron's `PackedSeqParams` (THD) of this row."""
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_kv=self.cu_seqlens,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
        )


def first_fit_decreasing(sizes: list[int], budget: int) -> list[list[int]]:
    """Bins of item indices, each holding at most `budget` in total size (an item larger than the
    budget gets a bin of its own): items taken largest first (ties in index order), each into
    the first bin with room, bins in the order they were opened. Uses at most 11/9 OPT + 1 bins."""
    if budget < 1:
        raise ValueError(f"first_fit_decreasing: budget must be >= 1, got {budget}")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        j = next((j for j, r in enumerate(room) if sizes[i] <= r), None)
        if j is None:
            bins.append([i])
            room.append(budget - sizes[i])
        else:
            bins[j].append(i)
            room[j] -= sizes[i]
    return bins


def model_layout(mb: dict, x: torch.Tensor) -> torch.Tensor:
    """A micro-batch field `[n, S, ...]` in the layout the model sees: the packed row `[1, T,
    ...]` when `mb` is packed, `x` itself otherwise."""
    packing = mb.get("packing")
    return x if packing is None else packing.pack(x)
