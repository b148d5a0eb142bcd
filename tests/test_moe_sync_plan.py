"""The MoE weight-sync plan without vLLM or processes: the fused-expert layout rule, coverage
errors, index maps, sync groups under expert parallelism and a plan at EP2."""

from __future__ import annotations

import pytest
import torch

from megarl.convert.mapping import canonical_shapes_for, canonical_to_hf, hf_shapes_for
from megarl.models.hf_config import arch_from_hf
from megarl.rollout.engine.moe_layout import expert_pieces
from megarl.rollout.engine.pieces import PlanError, VllmDescription
from megarl.rollout.engine.vllm_layout import check_coverage
from megarl.rollout.sync.plan import RankMeta, SourceParam, build_plan, hf_index_maps, sync_groups
from tests.sync_moe_worker import MIXTRAL, QWEN3_MOE
from tests.vllm_targets import fake_vllm

ARCHS = {"qwen3_moe": arch_from_hf(QWEN3_MOE), "mixtral": arch_from_hf(MIXTRAL)}


def test_expert_pieces_follow_vllms_w13_and_w2_layout():
    attrs = dict(
        slots=[-1, -1, 0, 1],
        tp_rank=1,
        tp_size=2,
        intermediate=64,
        hidden=128,
        names=("gate_proj", "up_proj", "down_proj"),
    )
    m = "model.layers.3.mlp.experts.routed_experts"
    gate, up, *rest = expert_pieces(m, "w13_weight", attrs)
    assert gate.hf == "model.layers.3.mlp.experts.2.gate_proj.weight" and gate.index == (0,)
    assert (gate.dim, gate.hf_start, gate.length, gate.offset) == (0, 32, 32, 0)
    assert up.hf.endswith("experts.2.up_proj.weight") and (up.offset, up.index) == (32, (0,))
    assert [p.index for p in rest] == [(1,), (1,)]  # expert 3 in slot 1; experts 0, 1 absent
    (down, _) = expert_pieces(m, "w2_weight", attrs)
    assert (down.dim, down.hf_start, down.length, down.hf_shape) == (1, 32, 32, (128, 64))
    with pytest.raises(PlanError, match="'w13_bias'"):
        expert_pieces(m, "w13_bias", attrs)


@pytest.mark.parametrize("family", list(ARCHS))
@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (2, 2)])
def test_fake_vllm_moe_layouts_are_fully_covered(family, tp, ep):
    arch = ARCHS[family]
    for rank in range(tp):
        desc = fake_vllm(arch, tp, rank, ep=ep)
        check_coverage(desc, hf_shapes_for(arch), tied=arch.tie_word_embeddings)


def test_a_missing_expert_slot_is_refused_naming_the_parameter():
    arch = ARCHS["qwen3_moe"]
    desc = fake_vllm(arch, 1, 0)
    pieces = tuple(p for p in desc.pieces if not (p.index == (2,) and "layers.1." in p.param))
    bad = VllmDescription(desc.params, pieces, 0, 1, "float32", "Fake", "sim")
    with pytest.raises(PlanError) as e:
        check_coverage(bad, hf_shapes_for(arch), tied=False)
    assert "'model.layers.1.mlp.experts.routed_experts.w13_weight' shape (4, 128, 128)" in str(
        e.value
    )
    assert "fill 3 of its 4 sub-tensors" in str(e.value)


@pytest.mark.parametrize("family", list(ARCHS))
def test_index_maps_reproduce_the_moe_hf_mapping(family):
    arch = ARCHS[family]
    dims = {
        n: 1 if n.endswith("linear_fc2.weight") or "linear_proj" in n else 0
        for n in canonical_shapes_for(arch)
    }
    maps = hf_index_maps(arch, dims)
    g = torch.Generator().manual_seed(0)
    state = {n: torch.randn(s, generator=g) for n, s in canonical_shapes_for(arch).items()}
    for name, t in canonical_to_hf(arch, state.items()):
        canonical, d, idx = maps[name]
        assert torch.equal(state[canonical].index_select(d, idx), t), name


def _dim(name: str) -> int:
    """Megatron's TP partition dim per canonical tensor (-1: replicated: norms, router)."""
    if "norm" in name or "layernorm" in name or name.endswith("router.weight"):
        return -1
    return 1 if name.endswith(("linear_proj.weight", "linear_fc2.weight")) else 0


def _meta(rank, dp, pp, tp_rank, tp, expert_key, params=(), vllm=None):
    return RankMeta(rank, (dp, 0), pp, tp_rank, tp, tuple(params), vllm, expert_key)


def test_sync_groups_join_the_dense_replicas_an_expert_block_spans():
    # world 2, EP2: two dense DP replicas, one expert block -> one group of both
    g = sync_groups([_meta(0, 0, 0, 0, 1, (0, 0)), _meta(1, 1, 0, 0, 1, (0, 0))])
    assert [[m.rank for m in x] for x in g] == [[0, 1]]
    # dense DP2 (no experts): two groups of one
    g = sync_groups([_meta(0, 0, 0, 0, 1, ()), _meta(1, 1, 0, 0, 1, ())])
    assert [[m.rank for m in x] for x in g] == [[0], [1]]
    # world 8, TP2 x EP2 (ETP2), DP4: expert blocks of 4 ranks join two TP pairs each
    metas = [_meta(r, r // 2, 0, r % 2, 2, (0, r // 4)) for r in range(8)]
    assert [[m.rank for m in x] for x in sync_groups(metas)] == [[0, 2, 1, 3], [4, 6, 5, 7]]


def test_plan_at_ep2_covers_every_piece_and_spreads_the_dense_sends():
    """Rank r holds experts 2r, 2r+1 and a whole dense copy: each dense tensor is sent by one
    of the two replicas, each expert by its owner; every piece is covered once."""
    arch = ARCHS["qwen3_moe"]
    shapes = canonical_shapes_for(arch)

    def sources(r):
        out = []
        for name, shape in shapes.items():
            if ".local_experts." in name:
                e = int(name.split(".local_experts.")[1].split(".")[0])
                if e // 2 != r:
                    continue
                out.append(SourceParam(name, shape, _dim(name), "float32", 0, 1, expert=True))
            else:
                if name.startswith(("embedding", "output_layer")):
                    shape = (arch.padded_vocab_size(128, 1), *shape[1:])
                out.append(SourceParam(name, shape, _dim(name), "float32"))
        return out

    desc = fake_vllm(arch, 1, 0)
    metas = [_meta(r, r, 0, 0, 1, (0, 0), sources(r), desc) for r in range(2)]
    (group,) = sync_groups(metas)
    plans = [build_plan(arch, group, me, bucket_bytes=200_000) for me in range(2)]
    assert {p.mode for p in plans} == {"broadcast"}
    for me, plan in enumerate(plans):
        covered = [0] * len(plan.pieces)
        for b in plan.buckets:
            for s in b.local + b.recv[1 - me]:
                covered[s.piece] += s.length
        assert covered == [p.length for p in plan.pieces]
        sent = sum(b.send_numel() for b in plan.buckets)
        assert sent > 0.3 * sum(p.numel for p in plan.pieces)  # both replicas send


def test_mla_and_sigmoid_router_pieces():
    """DeepSeek's fused q_a / kv_a projection is replicated over vLLM TP (rank 1 takes every
    row), the router's expert bias is whole, and a model with parameters vLLM derives at load
    (MLA's absorbed projections) never takes the repack-without-reload write."""
    from megarl.rollout.engine import cpu_repack
    from megarl.rollout.engine.pieces import VllmDescription, VllmParam
    from megarl.rollout.engine.vllm_layout import pieces_for_module

    attrs = dict(output_sizes=[64, 576], tp_rank=0, tp_size=1, hidden=128, shape=(640, 128))
    p = pieces_for_module(
        "merged", "model.layers.0.self_attn.fused_qkv_a_proj", "weight", attrs,
        ["q_a_proj", "kv_a_proj_with_mqa"],
    )  # fmt: skip
    assert [(x.hf.rsplit(".", 2)[-2], x.hf_start, x.length, x.offset) for x in p] == [
        ("q_a_proj", 0, 64, 0),
        ("kv_a_proj_with_mqa", 0, 576, 64),
    ]
    bias = pieces_for_module(
        "replicated", "model.layers.1.mlp.gate", "e_score_correction_bias",
        dict(output_size=4, input_size=128, shape=(4,)), None,
    )  # fmt: skip
    assert [(b.hf, b.length, b.hf_shape) for b in bias] == [
        ("model.layers.1.mlp.gate.e_score_correction_bias", 4, (4,))
    ]
    params = (VllmParam("a.weight", (8, 8), "ColumnParallelLinear", repacked=True),)
    plain = VllmDescription(params, (), 0, 1, "float32", "M", "0.32")
    assert cpu_repack.applies(plain)
    mla = VllmDescription(params, (), 0, 1, "float32", "M", "0.32", derived=("x.W_UV",))
    assert not cpu_repack.applies(mla)


def test_gpt_oss_expert_pieces_write_what_vllms_own_loader_writes():
    """gpt-oss's experts in vLLM's GPU layouts (vLLM TP 2 splitting each expert's interleaved
    intermediate axis; expert parallelism, two experts a rank), filled from megarl's per-expert
    HF tensors through its (transposed) pieces: equal to what vLLM 0.32's
    `GptOssRoutedExperts` loaders make of the same tensors. w2_bias at experts' TP 2 (which vLLM
    zeroes on rank 1) is refused at plan time."""
    from types import SimpleNamespace

    from vllm.model_executor.models.gpt_oss import GptOssRoutedExperts

    from megarl.convert.mapping import transposed_hf
    from tests.tiny import TINY_GPT_OSS

    arch = arch_from_hf(TINY_GPT_OSS)
    g = torch.Generator().manual_seed(0)
    state = {n: torch.randn(s, generator=g) for n, s in canonical_shapes_for(arch).items()}
    hf = dict(canonical_to_hf(arch, state.items()))
    flipped = transposed_hf(arch)
    assert "model.layers.1.mlp.experts.3.gate_up_proj" in flipped
    e_all, inter, h = 4, 64, 128
    loaders = {
        "w13_weight": ("gate_up_proj", "gpt_oss_w13", "_load_unquantized_expert"),
        "w2_weight": ("down_proj", "gpt_oss_w2", "_load_unquantized_expert"),
        "w13_bias": ("gate_up_proj_bias", "gpt_oss_w13", "_load_expert_bias"),
        "w2_bias": ("down_proj_bias", "gpt_oss_w2", "_load_expert_bias"),
    }
    m = "model.layers.1.mlp.experts.routed_experts"
    cases = [(2, r, [0, 1, 2, 3]) for r in range(2)]  # vLLM TP 2
    cases += [(1, 0, [0, 1, -1, -1]), (1, 0, [-1, -1, 0, 1])]  # expert parallel, two ranks
    for tp, r, slots in cases:
        local = [e for e in range(e_all) if slots[e] >= 0]
        attrs = dict(slots=slots, tp_rank=r, tp_size=tp, intermediate=inter, hidden=h)
        attrs.update(names=("", "", ""), gpt_oss=True)
        shapes = {
            "w13_weight": (len(local), 2 * inter // tp, h),
            "w2_weight": (len(local), h, inter // tp),
            "w13_bias": (len(local), 2 * inter // tp),
            "w2_bias": (len(local), h),
        }
        config = SimpleNamespace(moe_parallel_config=SimpleNamespace(tp_rank=r))
        stub = type(
            "Loader",
            (),
            {
                "moe_config": config,
                "_narrow_for_rank": staticmethod(GptOssRoutedExperts._narrow_for_rank),
                "_copy_to_expert": staticmethod(GptOssRoutedExperts._copy_to_expert),
            },
        )()
        for leaf, (hf_leaf, shard, loader) in loaders.items():
            if leaf == "w2_bias" and tp > 1:
                with pytest.raises(PlanError, match="experts' TP 1"):
                    expert_pieces(m, leaf, attrs)
                continue
            ours = torch.full(shapes[leaf], float("nan"))
            for pc in expert_pieces(m, leaf, attrs):
                src = hf[pc.hf].t() if pc.transposed else hf[pc.hf]
                assert pc.transposed == (pc.hf in flipped) and src.shape == pc.hf_shape
                ours[pc.index].narrow(pc.dim, pc.offset, pc.length).copy_(
                    src.narrow(pc.dim, pc.hf_start, pc.length)
                )
            theirs = torch.full(shapes[leaf], float("nan"))
            for e in local:
                name = f"model.layers.1.mlp.experts.{e}.{hf_leaf}"
                getattr(GptOssRoutedExperts, loader)(stub, theirs[slots[e]], hf[name], shard)
            assert not ours.isnan().any() and torch.equal(ours, theirs), (tp, r, leaf)
