"""Megatron's fused layouts, as pure tensor transforms: `linear_qkv` (q, k and v of each query
group together; with an output gate, the gate rows after the group's q), `linear_fc1`
([gate; up]) and the Gated DeltaNet's `in_proj` ([q; k; v; z; b; a]), to and from the HF tensors.

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


def qkv_gated_to_megatron(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, kv_heads: int, head_dim: int
) -> torch.Tensor:
    """Gated attention (Qwen3-Next): q_proj [heads*2*hd, ...] (each head's [q; gate]), k / v
    [kv_heads*hd, ...] -> linear_qkv [(2 heads + 2 kv_heads)*hd, ...], per query group
    [q heads; gate heads; k; v] (megatron's attention.py:1387-1443)."""
    rest = q.shape[1:]
    per = heads // kv_heads
    qg = q.reshape(kv_heads, per, 2, head_dim, *rest)
    kg = k.reshape(kv_heads, head_dim, *rest)
    vg = v.reshape(kv_heads, head_dim, *rest)
    parts = [qg[:, :, 0], qg[:, :, 1]]
    parts = [x.reshape(kv_heads, per * head_dim, *rest) for x in parts]
    return torch.cat([*parts, kg, vg], dim=1).reshape(-1, *rest)


def qkv_gated_from_megatron(
    qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `qkv_gated_to_megatron`: linear_qkv -> (q_proj, k, v), each contiguous."""
    rest = qkv.shape[1:]
    per = heads // kv_heads
    g = qkv.reshape(kv_heads, (2 * per + 2) * head_dim, *rest)
    q, gate, k, v = g.split([per * head_dim, per * head_dim, head_dim, head_dim], dim=1)
    q = q.reshape(kv_heads, per, 1, head_dim, *rest)
    gate = gate.reshape(kv_heads, per, 1, head_dim, *rest)
    return (
        torch.cat([q, gate], dim=2).reshape(2 * heads * head_dim, *rest).contiguous(),
        k.reshape(kv_heads * head_dim, *rest).contiguous(),
        v.reshape(kv_heads * head_dim, *rest).contiguous(),
    )


def gdn_in_to_megatron(qkvz: torch.Tensor, ba: torch.Tensor, shape) -> torch.Tensor:
    """Qwen3-Next's in_proj_qkvz [kh (2 dk + 2 r dv), h] and in_proj_ba [kh 2 r, h], grouped per
    key head (r = value heads per key head), -> megatron's in_proj
    [kh dk (q); kh dk (k); vh dv (v); vh dv (z); vh (b); vh (a)] (gated_delta_net.py:313-322).
    `shape`: the `GDNShape`."""
    kh, dk, dv = shape.key_heads, shape.key_dim, shape.value_dim
    r = shape.value_heads // kh
    rest = qkvz.shape[1:]
    q, k, v, z = qkvz.reshape(kh, 2 * dk + 2 * r * dv, *rest).split([dk, dk, r * dv, r * dv], 1)
    b, a = ba.reshape(kh, 2 * r, *rest).split([r, r], 1)
    return torch.cat([x.reshape(-1, *rest) for x in (q, k, v, z, b, a)], dim=0)


def gdn_in_split_to_megatron(
    qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor
) -> torch.Tensor:
    """Qwen3.5's in_proj_qkv [q; k; v] (heads contiguous), in_proj_z, in_proj_b, in_proj_a ->
    megatron's in_proj [q; k; v; z; b; a]: already its order, joined."""
    return torch.cat([qkv, z, b, a], dim=0)


def gdn_in_split_from_megatron(in_proj: torch.Tensor, shape) -> tuple[torch.Tensor, ...]:
    """Inverse of `gdn_in_split_to_megatron`: (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a)."""
    vh = shape.value_heads
    qkv = 2 * shape.key_heads * shape.key_dim + vh * shape.value_dim
    parts = in_proj.split([qkv, vh * shape.value_dim, vh, vh], dim=0)
    return tuple(p.contiguous() for p in parts)


def gdn_in_from_megatron(in_proj: torch.Tensor, shape) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `gdn_in_to_megatron`: in_proj -> (in_proj_qkvz, in_proj_ba), contiguous."""
    kh, vh, dk, dv = shape.key_heads, shape.value_heads, shape.key_dim, shape.value_dim
    r = vh // kh
    rest = in_proj.shape[1:]
    q, k, v, z, b, a = in_proj.split([kh * dk, kh * dk, vh * dv, vh * dv, vh, vh], dim=0)
    per_group = [x.reshape(kh, -1, *rest) for x in (q, k, v, z)]
    qkvz = torch.cat(per_group, dim=1).reshape(-1, *rest)
    ba = torch.cat([b.reshape(kh, r, *rest), a.reshape(kh, r, *rest)], dim=1).reshape(-1, *rest)
    return qkvz.contiguous(), ba.contiguous()


def gdn_tp_parts(arch, name: str) -> tuple[int, ...] | None:
    """The components, in global rows, of a Gated DeltaNet tensor whose TP shards hold a slice
    of each (megatron splits each over TP, gated_delta_net.py:313-345): `in_proj`
    [q; k; v; z; b; a] and `conv1d` [q; k; v]; None for any other tensor."""
    g = arch.gdn
    if g is None:
        return None
    qk, v = g.key_heads * g.key_dim, g.value_heads * g.value_dim
    if name.endswith("self_attention.in_proj.weight"):
        return (qk, qk, v, v, g.value_heads, g.value_heads)
    if name.endswith("self_attention.conv1d.weight"):
        return (qk, qk, v)
    return None
