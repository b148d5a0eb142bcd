"""megarl's core attention (`specs.SDPAttention`, torch's fused SDPA) computes what megatron's
`DotProductAttention` computes: outputs and input gradients, causal, grouped-query heads, fp32
(and bf16 within bf16 tolerance), at TP=1 and inside a TP=2 layer (heads split); and a packed
row (THD) attends within each of its sequences exactly as each sequence alone would."""

from __future__ import annotations

import pytest
import torch

from megarl.distributed.launch import spawn


def job(rank: int, world: int, dtype: str) -> dict:
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megarl.distributed import ParallelConfig, Topology
    from megarl.models.forward import causal_mask
    from megarl.models.hf_config import PrecisionConfig, arch_from_hf
    from megarl.models.mcore_config import transformer_config
    from megarl.models.specs import sdpa_attention_class
    from tests.tiny import TINY_LLAMA

    hf = {**TINY_LLAMA, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 256}
    arch = arch_from_hf(hf)
    par = ParallelConfig(tensor_parallel=world)
    Topology.for_model(par, world, arch).initialize(seed=0)
    cfg = transformer_config(arch, par, PrecisionConfig(dtype=dtype), gpu=False)
    ours = sdpa_attention_class()(cfg, 1, AttnMaskType.causal, "self")
    ref = DotProductAttention(cfg, 1, AttnMaskType.causal, "self")
    s, b, hn = 37, 3, arch.head_dim
    nq, ng = ours.num_attention_heads_per_partition, ours.num_query_groups_per_partition
    g = torch.Generator().manual_seed(rank)
    dt = getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[dtype])
    q0 = torch.randn(s, b, nq, hn, generator=g).to(dt)
    k0 = torch.randn(s, b, ng, hn, generator=g).to(dt)
    v0 = torch.randn(s, b, ng, hn, generator=g).to(dt)
    mask = causal_mask(s, "cpu")
    out = {}
    for name, mod in (("ours", ours), ("ref", ref)):
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        o = mod(q, k, v, mask)
        (o.float() * torch.linspace(-1, 1, o.numel()).view_as(o)).sum().backward()
        out[name] = [o.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()]
    pairs = list(zip(out["ours"], out["ref"], strict=True))
    return {
        "shape": list(out["ours"][0].shape),
        "max_abs": [float((a - r).abs().max()) for a, r in pairs],
        "rel": [float((a - r).abs().max() / r.abs().max()) for a, r in pairs],
    }


# tolerance on max |diff| / max |reference| (bf16 keeps 8 mantissa bits: ~4e-3 per rounding)
@pytest.mark.parametrize("world,dtype,tol", [(1, "fp32", 1e-6), (2, "fp32", 1e-6),
                                             (1, "bf16", 1.6e-2)])
def test_sdpa_attention_matches_megatrons_dot_product_attention(world, dtype, tol):
    for r in spawn(job, world, dtype, timeout=300):
        print(f"TP{world} {dtype}: out / dq / dk / dv max |diff| {r['max_abs']}, rel {r['rel']}")
        assert r["shape"] == [37, 3, 8 // world * 32]
        assert max(r["rel"]) <= tol


def packed_job(rank: int, world: int, dtype: str) -> dict:
    """A packed row of segments of very different lengths (several buckets, a 1-token segment)
    through SDPAttention's THD path against each segment attended on its own."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megarl.distributed import ParallelConfig, Topology
    from megarl.models.forward import causal_mask
    from megarl.models.hf_config import PrecisionConfig, arch_from_hf
    from megarl.models.mcore_config import transformer_config
    from megarl.models.specs import sdpa_attention_class
    from tests.tiny import TINY_LLAMA

    hf = {**TINY_LLAMA, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 256}
    arch = arch_from_hf(hf)
    par = ParallelConfig()
    Topology.for_model(par, 1, arch).initialize(seed=0)
    cfg = transformer_config(arch, par, PrecisionConfig(dtype=dtype), gpu=False)
    attn = sdpa_attention_class()(cfg, 1, AttnMaskType.causal, "self")
    lengths = [40, 3, 1, 17, 38, 2, 9]
    bounds = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    t, nq, ng, hn = sum(lengths), 8, 2, arch.head_dim
    g = torch.Generator().manual_seed(1)
    dt = getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[dtype])
    q0, k0, v0 = (torch.randn(t, h, hn, generator=g).to(dt) for h in (nq, ng, ng))
    weights = torch.linspace(-1, 1, t * nq * hn).view(t, nq * hn)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds,
                             max_seqlen_q=40, max_seqlen_kv=40)
    q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
    out = attn(q, k, v, None, packed_seq_params=params)
    (out.float() * weights).sum().backward()
    ours = [out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()]
    q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
    pieces = []
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        s = b - a  # one segment as a batch of one: [s, 1, heads, hn]
        o = attn(*(x[a:b].unsqueeze(1) for x in (q, k, v)), causal_mask(s, "cpu"))
        pieces.append(o[:, 0])
    ref_out = torch.cat(pieces)
    (ref_out.float() * weights).sum().backward()
    ref = [ref_out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()]
    rel = [float((a - r).abs().max() / r.abs().max()) for a, r in zip(ours, ref, strict=True)]
    return {"rel": rel, "shape": list(out.shape)}


@pytest.mark.parametrize("dtype,tol", [("fp32", 1e-6), ("bf16", 1.6e-2)])
def test_packed_rows_attend_within_each_sequence(dtype, tol):
    r = spawn(packed_job, 1, dtype, timeout=300)[0]
    print(f"packed {dtype}: out / dq / dk / dv rel {r['rel']}")
    assert r["shape"] == [110, 8 * 32]
    assert max(r["rel"]) <= tol
