"""SFT and DPO (every variant) through megarl's offline stages equal transformers, at every layout.

For a tiny random LlamaForCausalLM (and, for DPO, a perturbed copy as the reference) loaded into
megatron with the sharded HF loader, one step's loss (abs <= 1e-5), its metrics and the
gradients of every parameter (relative <= 1e-5, mapped back to HF names) must equal a
computation with transformers' model in fp32 written from the formulas, at one rank with one
micro-batch and with a micro-batch per pair / row pair, at TP2, PP2 and DP2 (real gloo ranks).
"""

from __future__ import annotations

import pytest

from megarl.distributed.launch import spawn
from tests import offline_worker as ow

LOSS_TOL = 1e-5
GRAD_TOL = 1e-5
VARIANTS = list(ow.VARIANTS)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    dirs = ow.write_models(str(tmp_path_factory.mktemp("offline_models")))
    return dirs, {v: ow.hf_reference(dirs, v) for v in VARIANTS}


def _errors(ref: dict, got: dict) -> dict[str, float]:
    m = got["metrics"]
    errs = {"loss": abs(m["loss"] - ref["loss"])}
    # perplexity exp(loss) ~ the vocabulary size here: compare it relatively
    errs["metrics"] = max(
        abs(m[k] - v) / (abs(v) if k == "ppl" else 1.0) for k, v in ref["metrics"].items()
    )
    assert set(got["grads"]) == set(ref["grads"])
    rel = 0.0
    for name, g in ref["grads"].items():
        scale = max(g.abs().max().item(), 1e-12)
        rel = max(rel, (got["grads"][name] - g).abs().max().item() / scale)
    errs["grads_rel"] = rel
    return errs


# micro_batch_size 64: the whole step in one micro-batch; 2: one pair (two rows) per micro-batch
LAYOUTS = [
    pytest.param({}, 1, [64, 2], id="1rank"),
    pytest.param({"tensor_parallel": 2}, 2, [2], id="tp2"),
    pytest.param({"pipeline_parallel": 2}, 2, [2], id="pp2"),
    pytest.param({}, 2, [64], id="dp2"),
]


@pytest.mark.slow
@pytest.mark.parametrize("layout,world,sizes", LAYOUTS)
def test_offline_losses_match_transformers(reference, layout, world, sizes):
    dirs, refs = reference
    results = spawn(ow.megarl_step, world, dirs, layout, VARIANTS, sizes, timeout=900)
    for v, mbs in [(v, m) for v in VARIANTS for m in sizes]:
        got = {"metrics": results[0][v, mbs]["metrics"], "grads": results[0][v, mbs]["grads"]}
        for r in results[1:]:  # every rank logs the same step
            assert r[v, mbs]["metrics"]["loss"] == got["metrics"]["loss"]
        errs = _errors(refs[v], got)
        print(f"{v} {layout} world={world} micro_batch_size={mbs}: {errs}")
        assert errs["loss"] <= LOSS_TOL, (v, errs)
        assert errs["metrics"] <= LOSS_TOL, (v, errs)
        assert errs["grads_rel"] <= GRAD_TOL, (v, errs)


def test_the_comparison_can_fail(reference):
    """A perturbed gradient or loss is caught."""
    _, refs = reference
    ref = refs["dpo-sigmoid"]
    bad = {k: g.clone() for k, g in ref["grads"].items()}
    name = next(iter(bad))
    bad[name].view(-1)[0] += 1e-3 * bad[name].abs().max()
    errs = _errors(ref, {"metrics": {**ref["metrics"], "loss": ref["loss"] + 1e-4}, "grads": bad})
    assert errs["grads_rel"] >= 5e-4 and errs["loss"] >= 5e-5
