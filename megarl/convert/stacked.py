"""gpt-oss's experts as its files hold them, and megarl's per-expert names for them.

transformers stores each layer's experts stacked on dim 0: `model.layers.{i}.mlp.experts.
gate_up_proj` [experts, hidden, 2 ffn] (and `gate_up_proj_bias`, `down_proj`, `down_proj_bias`);
the released checkpoints hold the two weights as MXFP4 (`<name>_blocks` [experts, out, in / 32,
16] uint8, two 4-bit values a byte, and `<name>_scales` [experts, out, in / 32], a power-of-two
exponent + 127 per 32 values), which read as bf16 [in, out] per expert, as transformers'
`convert_moe_packed_tensors` dequantizes them. megarl's HF names are per expert
(`...experts.{e}.gate_up_proj`): `slices` lists them for a file's stacked tensors, `read_slice`
reads one, `stack` joins them back for writing.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

import torch

_LEAVES = "gate_up_proj|gate_up_proj_bias|down_proj|down_proj_bias"
_STACKED = re.compile(rf"^(model\.layers\.\d+\.mlp\.experts)\.({_LEAVES})(_blocks|_scales)?$")
_SLICE = re.compile(rf"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.({_LEAVES})$")
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_VALUES += tuple(-v for v in FP4_VALUES)  # (sign bit 8)


class ExpertSlices:
    """A file's stacked expert tensors, named per expert: `of[name]` = (stacked name, expert);
    `expanded[stacked]` = its per-expert names; `hidden`: MXFP4 scales (read with their
    blocks)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        self.of: dict[str, tuple[str, int]] = {}
        self.expanded: dict[str, list[str]] = {}
        for n, shape in shapes.items():
            for v, whole, e in slices(n, shape):
                self.of[v] = (whole, e)
                self.expanded.setdefault(whole, []).append(v)
        self.hidden = {
            n.removesuffix("_blocks") + "_scales" for n in self.expanded if n.endswith("_blocks")
        }

    def shape(self, name: str, stacked_shape: tuple[int, ...]) -> tuple[int, ...]:
        return slice_shape(self.of[name][0], stacked_shape)

    def dtype(self, name: str, stored: torch.dtype) -> torch.dtype:
        return torch.bfloat16 if self.of[name][0].endswith("_blocks") else stored

    def read(self, name: str, read_rows: Callable[[str, int, int], torch.Tensor]):
        return read_slice(*self.of[name], read_rows)


def slices(name: str, shape: tuple[int, ...]) -> list[tuple[str, str, int]]:
    """For a stacked tensor of a file: `(per-expert name, stacked name, expert)` of each expert;
    [] for any other tensor and for MXFP4 scales (read with their blocks)."""
    m = _STACKED.match(name)
    if m is None or m.group(3) == "_scales" or not shape:
        return []
    return [(f"{m.group(1)}.{e}.{m.group(2)}", name, e) for e in range(shape[0])]


def slice_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """One expert's shape as read: MXFP4 blocks [E, out, G, 16] read as [G x 32, out]."""
    if name.endswith("_blocks"):
        return (shape[2] * shape[3] * 2, shape[1])
    return tuple(shape[1:])


def read_slice(
    name: str, e: int, read_rows: Callable[[str, int, int], torch.Tensor]
) -> torch.Tensor:
    """Expert `e` of stacked tensor `name`; `read_rows(name, start, stop)` reads rows of dim 0
    of a tensor of the file."""
    if not name.endswith("_blocks"):
        return read_rows(name, e, e + 1)[0]
    scales = read_rows(name.removesuffix("_blocks") + "_scales", e, e + 1)[0]
    return dequantize_mxfp4(read_rows(name, e, e + 1)[0], scales)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [out, G, 16] uint8 (low nibble first), scales [out, G] uint8 -> bf16 [G x 32, out]
    (the weight as [in, out], as transformers stores the dequantized experts)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.bfloat16)
    out = torch.empty(*blocks.shape[:-1], 32, dtype=torch.bfloat16)
    out[..., 0::2] = lut[(blocks & 0x0F).long()]
    out[..., 1::2] = lut[(blocks >> 4).long()]
    out = torch.ldexp(out, (scales.to(torch.int32) - 127).unsqueeze(-1)).to(torch.bfloat16)
    return out.reshape(blocks.shape[0], -1).t().contiguous()


def stacked_name(name: str) -> tuple[str, int] | None:
    """`(stacked name, expert)` of a per-expert name, or None."""
    m = _SLICE.match(name)
    return None if m is None else (f"{m.group(1)}.{m.group(3)}", int(m.group(2)))


def stacked_shapes(shapes: dict[str, tuple[int, ...]], experts: int) -> dict[str, tuple[int, ...]]:
    """Per-expert name -> shape as the files hold them: each stacked tensor once, where its
    expert 0 stood."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        s = stacked_name(name)
        if s is None:
            out[name] = shape
        elif s[1] == 0:
            out[s[0]] = (experts, *shape)
    return out


def stack(items: Iterable[tuple[str, torch.Tensor]], experts: int, error) -> Iterator:
    """`(name, tensor)` with per-expert tensors joined into their stacked tensor (yielded once
    its last expert arrives); other tensors pass through in order."""
    held: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in items:
        s = stacked_name(name)
        if s is None:
            yield name, t
            continue
        parts = held.setdefault(s[0], {})
        parts[s[1]] = t
        if len(parts) == experts:
            del held[s[0]]
            yield s[0], torch.stack([parts[e] for e in range(experts)])
    if held:
        name, parts = next(iter(held.items()))
        raise error(f"{name}: experts {sorted(set(range(experts)) - set(parts))} never written")
