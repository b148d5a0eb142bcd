"""Layout invariance of the real megatron-core model on CPU (gloo, 2 and 4 processes).

For a tiny Llama (GQA, padded vocab) and a tiny Qwen3 (q/k norm, head_dim != hidden/heads, tied
embeddings) with the same canonical weights, every layout must reproduce the single-rank run:
full-vocabulary logits (<= 1e-5), parameter gradients (<= 1e-6) and the parameters after one
DistributedOptimizer Adam step. A tiny Mixtral does the same at EP=2; a tiny GLM-4.5 and
DeepSeek-V3 (dense first layer, shared expert, sigmoid routing with an expert bias; multi-latent
attention, whose latent norms run sequence-sharded under SP) and gpt-oss (sinks, windows, biases)
at EP=2, TP=2 with SP and PP=2, and Qwen3-Next (Gated DeltaNet layers split over TP by
component, their output norm's per-head grads summed over TP under SP; gated attention).
"""

from __future__ import annotations

import pytest
import torch

from megarl.distributed.launch import spawn
from tests import parity_worker as pw
from tests.test_convert_common import DEEPSEEK_V3, GLM4_MOE, GPT_OSS, QWEN3_NEXT
from tests.tiny import TINY_LLAMA, TINY_MIXTRAL, TINY_QWEN3

ARCHS = {"llama": TINY_LLAMA, "qwen3": TINY_QWEN3}
MOE = {
    "mixtral": TINY_MIXTRAL,
    "glm4_moe": GLM4_MOE,
    "deepseek_v3": DEEPSEEK_V3,
    "gpt_oss": GPT_OSS,
    "qwen3_next": QWEN3_NEXT,
}
B, S = 8, 12
LOGIT_TOL = 1e-5
GRAD_TOL = 1e-6
# Adam normalises each element by sqrt(v) + eps: with eps=1e-4 (set in the worker) a grad
# round-off of 1e-8 moves a parameter by ~lr * 1e-4, far below this tolerance
PARAM_TOL = 1e-5
NORM_TOL = 1e-6  # relative


def _batch() -> dict:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 250, (B, S + 1), generator=g)
    mask = torch.ones(B, S)
    mask[0, 8:] = 0  # ragged sequences
    mask[3, 5:] = 0
    return dict(tokens=tokens[:, :-1], targets=tokens[:, 1:], mask=mask)


@pytest.fixture(scope="module")
def reference():
    states = spawn(pw.make_states, 1, {**ARCHS, **MOE}, 0)[0]
    ref = spawn(pw.parity, 1, {**ARCHS, **MOE}, states, {}, _batch(), 1)[0]
    return states, ref


def _compare(ref: dict, results: list[dict], name: str) -> dict[str, float]:
    r0 = ref[name]
    logits = {}
    for r in results:
        logits.update(r[name]["logits"])
    assert sorted(logits) == list(range(B)), "every sample's logits must come back exactly once"
    errs = {
        "logits": max((logits[i] - r0["logits"][i]).abs().max().item() for i in range(B)),
        "grads": 0.0,
        "params": 0.0,
    }
    g1, p1 = results[0][name]["grads"], results[0][name]["params"]
    assert set(g1) == set(r0["grads"]) and set(p1) == set(r0["params"])
    for k in r0["grads"]:
        errs["grads"] = max(errs["grads"], (g1[k] - r0["grads"][k]).abs().max().item())
        errs["params"] = max(errs["params"], (p1[k] - r0["params"][k]).abs().max().item())
    assert results[0][name]["update_ok"]
    # the clipping norm: every parameter counted once (gpt-oss's expert biases at TP 2 x EP 2
    # were counted on TP rank 0 only)
    errs["grad_norm"] = abs(results[0][name]["grad_norm"] - r0["grad_norm"]) / r0["grad_norm"]
    return errs


LAYOUTS = [
    pytest.param(dict(tensor_parallel=2), 2, id="tp2"),
    pytest.param(dict(tensor_parallel=2, sequence_parallel=True), 2, id="tp2-sp"),
    pytest.param(dict(pipeline_parallel=2), 2, id="pp2-1f1b"),
    pytest.param(dict(pipeline_parallel=2, virtual_pipeline_parallel=2), 2, id="pp2-vpp2"),
    pytest.param(dict(), 2, id="dp2"),
    pytest.param(dict(tensor_parallel=2, pipeline_parallel=2), 4, id="tp2xpp2"),
]


@pytest.mark.slow
@pytest.mark.parametrize("layout,world", LAYOUTS)
def test_layout_matches_single_rank(reference, layout, world):
    states, ref = reference
    results = spawn(pw.parity, world, ARCHS, states, layout, _batch(), 2)
    for name in ARCHS:
        errs = _compare(ref, results, name)
        print(f"{name} {layout}: {errs}")
        assert errs["logits"] <= LOGIT_TOL, (name, errs)
        assert errs["grads"] <= GRAD_TOL, (name, errs)
        assert errs["params"] <= PARAM_TOL and errs["grad_norm"] <= NORM_TOL, (name, errs)


@pytest.mark.slow
def test_moe_expert_parallel_matches_single_rank(reference):
    states, ref = reference
    results = spawn(
        pw.parity, 2, {"mixtral": TINY_MIXTRAL}, states, dict(expert_parallel=2), _batch(), 2
    )
    errs = _compare(ref, results, "mixtral")
    print(f"mixtral ep2: {errs}")
    assert errs["logits"] <= LOGIT_TOL and errs["grads"] <= GRAD_TOL, errs
    assert errs["params"] <= PARAM_TOL and errs["grad_norm"] <= NORM_TOL, errs


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(dict(expert_parallel=2), id="ep2"),
        pytest.param(dict(tensor_parallel=2, sequence_parallel=True), id="tp2-sp"),
        pytest.param(dict(pipeline_parallel=2), id="pp2"),
    ],
)
def test_2026_moe_families_match_single_rank(reference, layout):
    states, ref = reference
    archs = {k: MOE[k] for k in ("glm4_moe", "deepseek_v3", "qwen3_next")}
    results = spawn(pw.parity, 2, archs, states, layout, _batch(), 2)
    # gpt-oss (sinks split over TP with the heads, windows, biased router and experts): its
    # biased experts need expert-TP 1, so TP 2 comes with EP 2
    oss = dict(layout)
    if "tensor_parallel" in layout:
        oss.update(expert_parallel=2, expert_tensor_parallel=1)
    more = spawn(pw.parity, 2, {"gpt_oss": GPT_OSS}, states, oss, _batch(), 2)
    results = [{**a, **b} for a, b in zip(results, more, strict=True)]
    for name in (*archs, "gpt_oss"):
        errs = _compare(ref, results, name)
        print(f"{name} {layout}: {errs}")
        assert errs["logits"] <= LOGIT_TOL and errs["grads"] <= GRAD_TOL, (name, errs)
        assert errs["params"] <= PARAM_TOL and errs["grad_norm"] <= NORM_TOL, (name, errs)


@pytest.mark.slow
def test_expert_bias_is_frozen_by_default_and_moves_by_the_rate_alike_at_ep2(reference):
    """`model.expert_bias_update_rate`: 0 keeps the bias as loaded (it is what vLLM routes
    with); 1e-3 runs DeepSeek's aux-loss-free update, each expert's bias moving by exactly
    +-1e-3 (or 0 at the mean load) from the step's global counts, the same at EP2 as at 1 rank."""
    states, _ = reference
    hf, state = MOE["deepseek_v3"], states["deepseek_v3"]
    loaded = {k: v for k, v in state.items() if k.endswith("router.expert_bias")}
    frozen = spawn(pw.expert_bias_after_step, 1, hf, state, {}, _batch(), 0.0)[0]
    assert loaded and all(torch.equal(frozen[k], loaded[k]) for k in loaded)
    one = spawn(pw.expert_bias_after_step, 1, hf, state, {}, _batch(), 1e-3)[0]
    ep2 = spawn(pw.expert_bias_after_step, 2, hf, state, dict(expert_parallel=2), _batch(), 1e-3)
    for k in loaded:
        step = (one[k] - loaded[k]).abs()
        assert bool(((step - 1e-3).abs() < 1e-7).any()), (k, step)
        assert bool((((step - 1e-3).abs() < 1e-7) | (step < 1e-9)).all()), (k, step)
        assert torch.equal(ep2[0][k], one[k]), k


def test_gradient_check_can_fail(reference):
    """The comparison itself must detect a wrong layout: perturb one canonical tensor."""
    states, ref = reference
    bad = {k: v.clone() for k, v in ref["llama"]["grads"].items()}
    bad["decoder.layers.1.mlp.linear_fc1.weight"][0, 0] += 1e-3
    fake = [{"llama": {**ref["llama"], "grads": bad}}]
    assert _compare(ref, fake, "llama")["grads"] >= 1e-3
