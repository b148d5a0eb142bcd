"""Step 3: the weight-sync writer into vLLM-layout tensors on the device, bitwise, at 7B shapes.

megarl's sync normally describes a live vLLM model (`vllm_layout.describe_model`). vLLM cannot be
installed on a GPU machine without network, so the description of a vLLM TP=1 Llama (qkv_proj,
gate_up_proj, o_proj, down_proj, norms, embed_tokens, lm_head with vLLM's vocab padding to a
multiple of 64) is built here from `vllm_layout.pieces_for_module`, the same rule `describe_model`
applies to live modules, and the vLLM parameters are plain device tensors (NaN-filled, as dummy
weights).
- plan: a megatron model (the frozen-reference builder, bf16, local spec) of a 7B Llama shape
  with grouped-query attention (Mistral-7B: 32 heads, 8 KV heads), `check_coverage`, the sources
  published the way `ColocatedWeights.__init__` does (`sync.colocated.trainer_sources`, one
  `RankMeta`), `plan.build_plan`, `TensorTarget` over the vLLM tensors, `Reshard`.
- writer: `Reshard.exchange()` fills the vLLM tensors in place; they must equal, BITWISE, a naive
  reference built independently: canonical tensors -> `mapping.canonical_to_hf` -> vLLM's fusion
  rule written out by hand (qkv = [q; k; v], gate_up = [gate; up], real vocab rows at the top).
  Seconds per sync (median of 5) next to the floor: the same bytes at this device's copy rate.
`--device cpu --tiny` runs it on CPU in fp32 with a tiny GQA Llama (vocab 250 -> 256 padding).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import common

CHECKS = ["plan", "writer"]
VLLM_VOCAB_PAD = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


def vllm_description(a, dtype: str):
    """What `describe_model` publishes for a vLLM TP=1 Llama of arch `a` (untied or tied)."""
    from megarl.rollout.engine.pieces import VllmDescription, VllmParam
    from megarl.rollout.engine.vllm_layout import pieces_for_module

    h, hd = a.hidden_size, a.head_dim
    q, ffn, kv = a.num_attention_heads * hd, a.intermediate_size, a.num_key_value_heads
    rows = -(-a.vocab_size // VLLM_VOCAB_PAD) * VLLM_VOCAB_PAD
    vocab = dict(org_start=0, org_end=a.vocab_size, org_vocab=a.vocab_size, hidden=h)
    qkv = dict(
        head_size=hd,
        num_heads=a.num_attention_heads,
        num_kv_heads=kv,
        total_kv_heads=kv,
        kv_replicas=1,
        tp_rank=0,
        tp_size=1,
        hidden=h,
    )
    mods = [("model.embed_tokens", "vocab", "VocabParallelEmbedding", vocab, None, (rows, h))]
    for i in range(a.num_layers):
        p = f"model.layers.{i}."
        mods += [
            (p + "input_layernorm", "full", "RMSNorm", {}, None, (h,)),
            (
                p + "self_attn.qkv_proj",
                "qkv",
                "QKVParallelLinear",
                qkv,
                ["q_proj", "k_proj", "v_proj"],
                (q + 2 * kv * hd, h),
            ),
            (
                p + "self_attn.o_proj",
                "row",
                "RowParallelLinear",
                dict(input_size=q, output_size=h, tp_rank=0, tp_size=1),
                None,
                (h, q),
            ),
            (p + "post_attention_layernorm", "full", "RMSNorm", {}, None, (h,)),
            (
                p + "mlp.gate_up_proj",
                "merged",
                "MergedColumnParallelLinear",
                dict(output_sizes=[ffn, ffn], tp_rank=0, tp_size=1, hidden=h),
                ["gate_proj", "up_proj"],
                (2 * ffn, h),
            ),
            (
                p + "mlp.down_proj",
                "row",
                "RowParallelLinear",
                dict(input_size=ffn, output_size=h, tp_rank=0, tp_size=1),
                None,
                (h, ffn),
            ),
        ]
    mods.append(("model.norm", "full", "RMSNorm", {}, None, (h,)))
    if not a.tie_word_embeddings:
        mods.append(("lm_head", "vocab", "ParallelLMHead", vocab, None, (rows, h)))
    params, pieces = [], []
    for name, kind, cls, attrs, packed, shape in mods:
        params.append(VllmParam(f"{name}.weight", shape, cls))
        pieces += pieces_for_module(kind, name, "weight", dict(attrs, shape=shape), packed)
    return VllmDescription(tuple(params), tuple(pieces), 0, 1, dtype, "LlamaForCausalLM", "none")


def naive_vllm(a, chunks, desc, dtype, device) -> dict:
    """The reference: canonical tensors -> HF tensors (megarl's mapping) -> vLLM's fusion rule
    written out by hand, into fresh NaN-filled tensors; vocab padding rows zero, as vLLM's
    loader leaves them."""
    import torch

    from megarl.convert.layout import local_params
    from megarl.convert.mapping import canonical_to_hf

    vocab = ("embedding.word_embeddings.weight", "output_layer.weight")
    canonical = (
        (c, p.data[: a.vocab_size] if c in vocab else p.data) for c, _, p in local_params(chunks)
    )
    hf = dict(canonical_to_hf(a, canonical))
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    out = {}
    for vp in desc.params:
        t = torch.full(vp.shape, float("nan"), dtype=dtype, device=device)
        prefix, _, leaf = vp.name.rpartition(".")
        module, _, last = prefix.rpartition(".")
        if last in fused:
            src = torch.cat([hf[f"{module}.{part}.{leaf}"] for part in fused[last]])
        else:
            src = hf[vp.name]
        t[: src.shape[0]].copy_(src)
        t[src.shape[0] :].zero_()
        out[vp.name] = t
    return out


def plan(fig, st) -> None:
    import torch
    import torch.distributed as dist

    from megarl.convert.mapping import hf_shapes_for
    from megarl.rollout.engine.vllm_layout import check_coverage
    from megarl.rollout.sync.colocated import trainer_sources
    from megarl.rollout.sync.plan import RankMeta, build_plan
    from megarl.rollout.sync.reshard import Reshard, TensorTarget

    st.par, st.groups = common.init_megatron(st.a)
    t0 = time.perf_counter()
    st.chunks = common.build(st.a, st.par, st.dtype, "reference", st.device)
    common.sync(st.device)
    fig["build_s"] = time.perf_counter() - t0
    st.torch_dtype = getattr(torch, {"bf16": "bfloat16", "fp32": "float32"}[st.dtype])
    st.desc = vllm_description(st.a, str(st.torch_dtype).removeprefix("torch."))
    check_coverage(st.desc, hf_shapes_for(st.a), tied=st.a.tie_word_embeddings)
    t0 = time.perf_counter()
    sources, params = trainer_sources(st.chunks)
    g = st.groups
    cp_rank = dist.get_rank(g.cp) if g.cp is not None else 0
    meta = RankMeta(
        dist.get_rank(),
        (g.dp_rank, cp_rank),
        g.pp_rank,
        g.tp_rank,
        g.tp_size,
        tuple(sources),
        st.desc,
    )
    st.plan = build_plan(st.a, [meta], 0)
    fig["plan_s"] = time.perf_counter() - t0
    st.vllm = {
        vp.name: torch.full(vp.shape, float("nan"), dtype=st.torch_dtype, device=st.device)
        for vp in st.desc.params
    }
    st.reshard = Reshard(st.plan, params, None, TensorTarget(st.vllm, st.plan))
    segs = sum(len(b.local) for b in st.plan.buckets)
    fig.update(
        arch=st.arch_name,
        params=common.param_count(st.chunks),
        mode=st.plan.mode,
        pieces=len(st.plan.pieces),
        buckets=len(st.plan.buckets),
        segments=segs,
        bytes=st.plan.bytes_total,
        src_dtype=st.plan.src_dtype,
        dst_dtype=st.plan.dst_dtype,
        param_device=str(params[0].device),
    )
    if params[0].device.type != st.device:
        raise common.Fail(f"megatron parameters are on {params[0].device}, expected {st.device}")


def writer(fig, st) -> None:
    import torch

    st.reshard.exchange()  # first sync (also the warm-up)
    common.sync(st.device)
    secs = common.median_time(st.reshard.exchange, st.device, repeats=5, warmup=0)
    nbytes = st.plan.bytes_total
    rate = common.copy_rate(st.device, max(64 * 2**20, min(nbytes, 2 * 2**30)))
    t0 = time.perf_counter()
    ref = naive_vllm(st.a, st.chunks, st.desc, st.torch_dtype, st.device)
    common.sync(st.device)
    naive_s = time.perf_counter() - t0
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[st.torch_dtype.itemsize]
    bad = [n for n, t in st.vllm.items() if not torch.equal(t.view(bits), ref[n].view(bits))]
    pad_rows = sum(
        t.shape[0] - st.a.vocab_size
        for n, t in st.vllm.items()
        if n.endswith(("embed_tokens.weight", "lm_head.weight"))
    )
    nan = sum(int(torch.isnan(t).sum()) for t in st.vllm.values())
    floor = nbytes / rate
    fig.update(
        bytes=nbytes,
        tensors=len(st.vllm),
        bitwise_equal=len(st.vllm) - len(bad),
        mismatched=bad[:5],
        nan_left=nan,
        padding_elements=pad_rows * st.a.hidden_size,  # zeros in the reference, compared above
        sync_s=secs,
        naive_s=naive_s,
        copy_GBps=rate / 1e9,
        floor_s=floor,
        x_floor=secs / floor,
        sync_GBps=nbytes / secs / 1e9,
        peak_gib=common.peak_gib(st.device),
    )
    if bad:
        raise common.Fail(
            f"{len(bad)} of {len(st.vllm)} vLLM tensors differ bitwise from the "
            f"naive copy, e.g. {bad[:3]}"
        )
    if nan:
        raise common.Fail(
            f"{nan} NaN left in the vLLM tensors: the sync writes every element, the "
            f"{pad_rows * st.a.hidden_size} vocab-padding ones as zeros"
        )


def body(rec: common.Recorder, args, device: str) -> None:
    name = "tiny" if args.tiny else "llama_7b_gqa"
    dtype = "bf16" if device == "cuda" else "fp32"
    st = SimpleNamespace(device=device, dtype=dtype, arch_name=name, a=common.arch(name))
    rec.run("plan", plan, st, min_s=30 if device == "cuda" and not args.tiny else 5)
    rec.run("writer", writer, st, needs=["plan"])


if __name__ == "__main__":
    common.main("sync", body, CHECKS)
