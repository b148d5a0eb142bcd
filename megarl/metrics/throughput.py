"""Model FLOPs per token, MFU, and a small table of accelerator peak throughput.

FLOPs of a causal decoder per token (matrix multiplies only; norms, activations, softmax, rotary
and the embedding lookup are ignored — a few percent at these sizes):

    matmul params per layer  P_layer = P_attn + P_mlp
      P_attn = h * (n_q * d)          # q projection
             + 2 * h * (n_kv * d)     # k, v projections (grouped-query attention)
             + (n_q * d) * h          # output projection
      P_mlp  = m * h * f              # dense: m = 3 for a gated MLP (SwiGLU), 2 otherwise
             = h * E + k * m * h * f_moe + m * h * f_shared    # MoE: router + top-k experts
                                                                #      + shared expert, if any
    forward = 2 * (L * P_layer + h * V)           # 2 FLOPs per multiply-add; h * V: LM head
            + 4 * L * n_q * d * s                 # attention scores q k^T and probs @ v
    training = 3 * forward                        # backward = 2 x forward

with h hidden size, L layers, n_q / n_kv query / key-value heads of dim d, f the MLP width, V the
vocabulary, s the sequence length. The attention term counts the full s x s score matrix (the
PaLM / Megatron convention, so MFU figures are comparable with published ones); pass
`causal=True` to count only the causal half. MoE: every layer is taken to be an MoE layer.

MFU = achieved model FLOPs / peak FLOPs, with training FLOPs (tokens/s x training FLOPs per
token). Peaks are dense (no sparsity) figures from NVIDIA's data sheets.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

# Accepted names per quantity: ours, Hugging Face config, Megatron TransformerConfig.
_ALIASES = {
    "hidden_size": ("hidden_size",),
    "num_layers": ("num_layers", "num_hidden_layers"),
    "num_attention_heads": ("num_attention_heads",),
    "num_key_value_heads": ("num_key_value_heads", "num_query_groups"),
    "head_dim": ("head_dim", "kv_channels"),
    "intermediate_size": ("intermediate_size", "ffn_hidden_size"),
    "vocab_size": ("vocab_size", "padded_vocab_size"),
    "num_experts": ("num_experts", "num_local_experts", "num_moe_experts"),
    "moe_topk": ("moe_topk", "num_experts_per_tok", "moe_router_topk"),
    "moe_intermediate_size": ("moe_intermediate_size", "moe_ffn_hidden_size"),
    "shared_expert_intermediate_size": (
        "shared_expert_intermediate_size",
        "moe_shared_expert_intermediate_size",
    ),
    "gated_mlp": ("gated_mlp", "gated_linear_unit"),
}


def _get(arch: Any, key: str, default: Any = None, *, required: bool = False) -> Any:
    for name in _ALIASES[key]:
        value = arch.get(name) if isinstance(arch, Mapping) else getattr(arch, name, None)
        if value is not None:
            return value
    if required:
        raise ValueError(
            f"flops_per_token: the architecture has no {key!r} (accepted names: "
            f"{list(_ALIASES[key])})"
        )
    return default


def flops_per_token(
    arch: Any, *, seq_len: int, training: bool = False, causal: bool = False
) -> float:
    """Model FLOPs per token for a forward pass (x3 with `training`), formula in the module doc.

    arch: a dict or an object (HF config, Megatron TransformerConfig, ...) with hidden_size,
    num_layers, num_attention_heads, vocab_size, intermediate_size (not needed for MoE when
    moe_intermediate_size is given), and optionally num_key_value_heads (default: the heads),
    head_dim (default hidden / heads), num_experts + moe_topk (+ moe_intermediate_size,
    shared_expert_intermediate_size) for MoE, gated_mlp (default True).
    seq_len: tokens per sequence, for the attention term.
    """
    h = _get(arch, "hidden_size", required=True)
    layers = _get(arch, "num_layers", required=True)
    heads = _get(arch, "num_attention_heads", required=True)
    kv_heads = _get(arch, "num_key_value_heads", heads)
    head_dim = _get(arch, "head_dim", h // heads)
    vocab = _get(arch, "vocab_size", required=True)
    m = 3 if _get(arch, "gated_mlp", True) else 2

    attn = h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h
    experts = _get(arch, "num_experts")
    if experts:
        topk = _get(arch, "moe_topk", required=True)
        f_moe = _get(arch, "moe_intermediate_size") or _get(
            arch, "intermediate_size", required=True
        )
        f_shared = _get(arch, "shared_expert_intermediate_size", 0)
        mlp = h * experts + topk * m * h * f_moe + m * h * f_shared
    else:
        mlp = m * h * _get(arch, "intermediate_size", required=True)

    matmul = 2 * (layers * (attn + mlp) + h * vocab)
    scores = 4 * layers * heads * head_dim * seq_len * (0.5 if causal else 1.0)
    forward = float(matmul + scores)
    return 3.0 * forward if training else forward


def mfu(
    tokens_per_s: float,
    flops_per_token_train: float,
    peak_flops_per_s: float,
    *,
    num_devices: int = 1,
) -> float:
    """Model FLOPs utilisation in [0, 1]: tokens_per_s over `num_devices` devices together."""
    if peak_flops_per_s <= 0 or num_devices < 1:
        raise ValueError(
            f"mfu: need peak > 0 and num_devices >= 1, got {peak_flops_per_s}, {num_devices}"
        )
    return tokens_per_s * flops_per_token_train / (peak_flops_per_s * num_devices)


# Dense tensor-core peaks per device in FLOP/s; matched in order on the lower-cased device name
# (torch.cuda.get_device_name(), e.g. "NVIDIA H100 80GB HBM3"). fp16 peaks equal bf16 ones.
_PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    ("h200", {"bf16": 989e12, "fp8": 1979e12}),
    ("h100 pcie", {"bf16": 756e12, "fp8": 1513e12}),
    ("h100 nvl", {"bf16": 835e12, "fp8": 1671e12}),
    ("h100", {"bf16": 989e12, "fp8": 1979e12}),  # SXM
    ("a100", {"bf16": 312e12}),
)


def _dtype_key(dtype: Any) -> str | None:
    if isinstance(dtype, torch.dtype):
        if dtype in (torch.bfloat16, torch.float16):
            return "bf16"
        return "fp8" if "float8" in str(dtype) else None
    name = str(dtype).lower()
    if name in ("bf16", "bfloat16", "fp16", "float16", "half"):
        return "bf16"
    if name in ("fp8", "float8", "e4m3", "hybrid"):
        return "fp8"
    return None


def peak_flops(device_name: str, dtype: Any) -> float | None:
    """Peak dense FLOP/s of one device for `dtype` (torch dtype or "bf16"/"fp16"/"fp8"), or None
    when unknown: CPUs, devices not in the table, fp32, fp8 on A100."""
    key = _dtype_key(dtype)
    name = device_name.lower()
    if key is None:
        return None
    for pattern, peaks in _PEAKS:
        if pattern in name:
            return peaks.get(key)
    return None


def precision_mfu(
    device_name: str, dtype: Any, fp8: bool, achieved_flops_per_s: float, num_devices: int
) -> dict[str, float]:
    """MFU against the peak of the precision the GEMMs run in: `mfu` (the FP8 peak when `fp8`,
    else `dtype`'s) and, in FP8 runs, `mfu_bf16` against the BF16 peak (the figure comparable
    with BF16 runs). Keys whose peak is unknown (CPUs, devices not in the table) are omitted."""
    peaks = {"mfu": peak_flops(device_name, "fp8" if fp8 else dtype)}
    if fp8:
        peaks["mfu_bf16"] = peak_flops(device_name, "bf16")
    return {k: achieved_flops_per_s / (p * num_devices) for k, p in peaks.items() if p}
