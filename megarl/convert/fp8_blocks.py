"""Block-scaled FP8 checkpoints (DeepSeek-V3, Kimi-K2 as published): each `X.weight` stored as
float8_e4m3 with `X.weight_scale_inv` [ceil(rows / b), ceil(cols / b)] holding one scale per
b x b block (`quantization_config: {quant_method: fp8, weight_block_size: [b, b]}`).

megarl reads such a file as the bf16 model it stands for: weight = fp8 x scale of its block, in
fp32, rounded to bf16 (DeepSeek's `fp8_cast_bf16.py` and transformers' dequantisation compute the
same); the scales are not tensors of the model. Writing back is bf16 (no re-quantisation).
"""

from __future__ import annotations

import json
import os

import torch

SCALE_SUFFIX = "_scale_inv"


def block_size(hf_config: dict | None) -> tuple[int, int] | None:
    """The (rows, cols) block of a block-FP8 HF config, None for any other checkpoint."""
    q = (hf_config or {}).get("quantization_config") or {}
    if q.get("quant_method") != "fp8" or not q.get("weight_block_size"):
        return None
    rows, cols = q["weight_block_size"]
    return int(rows), int(cols)


def pair_scales(
    directory: str, metas: dict[str, dict], error
) -> tuple[dict[str, str], tuple[int, int] | None]:
    """{FP8 weight name: its block-scale tensor's name} of a directory's safetensors (`metas`:
    name -> header entry) and the block from its config.json; `error` names what is wrong."""
    scales = {n[: -len(SCALE_SUFFIX)]: n for n in metas if n.endswith(SCALE_SUFFIX)}
    if not scales:
        return {}, None
    cfg_path = os.path.join(directory, "config.json")
    cfg = json.load(open(cfg_path)) if os.path.exists(cfg_path) else {}
    block = block_size(cfg)
    first = next(iter(scales.values()))
    if block is None:
        raise error(
            f"{directory}: {len(scales)} block-scale tensors ({first!r}, ...) but {cfg_path} "
            "has no quantization_config with quant_method 'fp8' and weight_block_size; "
            "accepted: a block-FP8 checkpoint as published (DeepSeek-V3, Kimi-K2) or one "
            "without *_scale_inv tensors"
        )
    for w, sc in scales.items():
        meta = metas.get(w, {})
        if meta.get("dtype") != "F8_E4M3" or len(meta.get("shape", ())) != 2:
            raise error(
                f"{directory}: {sc!r} scales {w!r}, which is not a 2-d F8_E4M3 tensor "
                f"({meta.get('dtype')}, shape {meta.get('shape')})"
            )
    return scales, block


def dequantize(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], row_start: int = 0
) -> torch.Tensor:
    """bf16 of FP8 `weight` [r, cols] (rows `row_start` .. of the whole tensor) with the block
    scales `scale_inv` [ceil(R / b0), ceil(cols / b1)] of the whole tensor."""
    b0, b1 = block
    rows = torch.arange(row_start, row_start + weight.shape[0]) // b0
    cols = torch.arange(weight.shape[1]) // b1
    scale = scale_inv.float()[rows][:, cols]
    return (weight.float() * scale).to(torch.bfloat16)


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, scale_inv) of a 2-d weight, one scale per block (amax / 448): how the
    published checkpoints were made; the tests write such files with it."""
    b0, b1 = block
    r, c = weight.shape
    pad = torch.zeros(-(-r // b0) * b0, -(-c // b1) * b1)
    pad[:r, :c] = weight.float()
    blocks = pad.view(pad.shape[0] // b0, b0, pad.shape[1] // b1, b1)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / torch.finfo(torch.float8_e4m3fn).max
    q = (blocks / scale_inv[:, None, :, None]).view_as(pad)[:r, :c]
    return q.to(torch.float8_e4m3fn), scale_inv
