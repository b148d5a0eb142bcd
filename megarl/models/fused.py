"""Megatron's fused layouts, as pure tensor transforms: `linear_qkv` (q, k and v of each query
group together) and `linear_fc1` ([gate; up]), to and from the separate HF tensors.

They also apply to a TP shard, given that shard's head counts: a `linear_qkv` shard holds
kv_heads / TP whole query groups, a `linear_fc1` shard is `[gate_r; up_r]`.
"""

from __future__ import annotations

import torch


def qkv_to_megatron(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, kv_heads: int, head_dim: int
) -> torch.Tensor:
    """q [heads*hd, ...], k/v [kv_heads*hd, ...] -> linear_qkv [(heads + 2 kv_heads)*hd, ...]."""
    rest = q.shape[1:]
    per = heads // kv_heads
    qg = q.reshape(kv_heads, per * head_dim, *rest)
    kg = k.reshape(kv_heads, head_dim, *rest)
    vg = v.reshape(kv_heads, head_dim, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest)


def qkv_from_megatron(
    qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `qkv_to_megatron`: linear_qkv -> (q, k, v), each contiguous."""
    rest = qkv.shape[1:]
    per = heads // kv_heads
    g = qkv.reshape(kv_heads, (per + 2) * head_dim, *rest)
    q, k, v = g.split([per * head_dim, head_dim, head_dim], dim=1)
    return (
        q.reshape(heads * head_dim, *rest).contiguous(),
        k.reshape(kv_heads * head_dim, *rest).contiguous(),
        v.reshape(kv_heads * head_dim, *rest).contiguous(),
    )


def gate_up_to_megatron(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate [ffn, h], up [ffn, h] -> linear_fc1 [2 ffn, h] = [gate; up]."""
    return torch.cat([gate, up], dim=0)


def gate_up_from_megatron(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """linear_fc1 [2 ffn, h] (or a TP shard [gate_r; up_r]) -> (gate, up), each contiguous."""
    gate, up = fc1.chunk(2, dim=0)
    return gate.contiguous(), up.contiguous()


def interleaved_to_megatron(x: torch.Tensor) -> torch.Tensor:
    """gpt-oss's gate / up interleaved along dim 0 (gate j at 2j, up j at 2j + 1), [2 ffn, ...]
    -> [gate; up] [2 ffn, ...]."""
    return torch.cat([x[0::2], x[1::2]], dim=0)


def interleaved_from_megatron(fc1: torch.Tensor) -> torch.Tensor:
    """Inverse of `interleaved_to_megatron`, contiguous."""
    gate, up = fc1.chunk(2, dim=0)
    return torch.stack([gate, up], dim=1).reshape(fc1.shape).contiguous()
