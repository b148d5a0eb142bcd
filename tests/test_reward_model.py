"""Reward models are exact: where the score is read, the score itself against transformers'
`AutoModelForSequenceClassification` (<= 1e-4 fp32) at one rank, TP2 with sequence parallelism,
PP2 and DP2 (real gloo ranks), the Bradley-Terry step (loss and metrics abs <= 1e-5, every
gradient relative <= 1e-5, against transformers with the formula written out) at every layout
and micro-batch split, with and without margins, and the converter's round trip of a
sequence classifier (bit-exact)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from megarl.distributed.launch import spawn
from megarl.rewards.model import score_positions
from tests import rm_worker as rw

SCORE_TOL = 1e-4
LOSS_TOL = 1e-5
GRAD_TOL = 1e-5


def test_score_positions_follow_transformers():
    """The last non-pad token (pad == eos skips trailing EOS), 0 for all-pad, the last token
    without a pad id; equal to transformers' formula on a right- or left-padded batch."""
    seqs = [[5, 6, 2], [5, 2, 6, 2, 2], [2, 2], [7], [3, 4, 0, 2]]
    assert score_positions(seqs, 2) == [1, 2, 0, 0, 2]
    assert score_positions(seqs, 0) == [2, 4, 1, 0, 3]
    assert score_positions(seqs, None) == [2, 4, 1, 0, 3]
    for pad in (0, 2):
        width = max(map(len, seqs)) + 2
        for left in (False, True):
            ids = torch.full((len(seqs), width), pad)
            shift = []
            for b, s in enumerate(seqs):
                start = width - len(s) if left else 0
                ids[b, start : start + len(s)] = torch.tensor(s)
                shift.append(start)
            # transformers 5.x GenericForSequenceClassification.forward
            hf = (torch.arange(width) * (ids != pad).int()).argmax(-1).tolist()
            ours = [p + o for p, o in zip(score_positions(seqs, pad), shift, strict=True)]
            for s, a, b in zip(seqs, hf, ours, strict=True):
                if all(t == pad for t in s):  # only pad: position 0 of the row, padded or not
                    assert a == 0 and score_positions([s], pad) == [0]
                else:
                    assert a == b, (pad, left, s)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    dirs = rw.write_models(str(tmp_path_factory.mktemp("rm_models")))
    scores = {n: rw.hf_scores(d, rw.MODELS[n]) for n, d in dirs.items()}
    steps = {
        (n, m): rw.hf_bradley_terry(d, rw.MODELS[n], m) for n, d in dirs.items() for m in (0, 1)
    }
    return dirs, scores, steps


def _grad_rel(ref: dict, got: dict, pad: int | None = None) -> float:
    """Largest relative gradient error; `pad`: the embedding row of the config's pad token is
    left out (transformers' `nn.Embedding(padding_idx=pad)` gives it no gradient; megarl trains
    every row the loss reaches, as it does for a policy)."""
    assert set(got) == set(ref), sorted(set(got) ^ set(ref))
    rel = 0.0
    for name, g in ref.items():
        if pad is not None and name == "model.embed_tokens.weight":
            keep = torch.arange(g.shape[0]) != pad
            g, got = g[keep], {**got, name: got[name][keep]}
        scale = max(g.abs().max().item(), 1e-12)
        rel = max(rel, (got[name] - g).abs().max().item() / scale)
    return rel


LAYOUTS = [
    pytest.param([{}], 1, [64, 2], id="1rank"),
    pytest.param(
        [{"tensor_parallel": 2, "sequence_parallel": True}, {"pipeline_parallel": 2}, {}],
        2,
        [2],
        id="tp2sp-pp2-dp2",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("layouts,world,sizes", LAYOUTS)
def test_scores_and_bradley_terry_match_transformers(reference, layouts, world, sizes):
    dirs, ref_scores, ref_steps = reference
    results = spawn(rw.megarl_layouts, world, dirs, layouts, sizes, timeout=900)
    for li, layout in enumerate(layouts):
        for name in dirs:
            for r in results:  # every rank holds its samples' scores
                err = (r[li, name, "scores"] - ref_scores[name]).abs().max().item()
                print(f"score {name} {layout or 'dp' if world > 1 else '1 rank'}: {err:.2e}")
                assert err <= SCORE_TOL, (layout, name, err)
            for margin in (False, True):
                ref = ref_steps[name, int(margin)]
                for mbs in sizes:
                    got = results[0][li, name, margin, mbs]
                    m = got["metrics"]
                    for r in results[1:]:
                        assert r[li, name, margin, mbs]["metrics"]["loss"] == m["loss"]
                    errs = {
                        "loss": abs(m["loss"] - ref["loss"]),
                        "metrics": max(abs(m[k] - v) for k, v in ref["metrics"].items()),
                        "grads_rel": _grad_rel(ref["grads"], got["grads"], rw.MODELS[name]),
                    }
                    print(f"bt {name} {layout} margin={margin} mbs={mbs}: {errs}")
                    assert errs["loss"] <= LOSS_TOL and errs["metrics"] <= LOSS_TOL, errs
                    assert errs["grads_rel"] <= GRAD_TOL, errs


def test_the_comparison_can_fail(reference):
    """A perturbed score or gradient is caught."""
    _, scores, steps = reference
    s = scores["own_pad"]
    assert (s + 2e-4 - s).abs().max() > SCORE_TOL
    g = {k: v.clone() for k, v in steps["own_pad", 0]["grads"].items()}
    name = next(iter(g))
    g[name].view(-1)[0] += 1e-3 * g[name].abs().max()
    assert _grad_rel(steps["own_pad", 0]["grads"], g) >= 5e-4


def roundtrip_worker(rank, world, dirs: dict, out: str):
    from megarl.checkpoint.reader import open_checkpoint
    from megarl.convert.pipeline import hf_to_mcore, mcore_to_hf

    roles = {}
    for name, hf in dirs.items():
        ckpt, back = os.path.join(out, name, "mcore"), os.path.join(out, name, "hf")
        hf_to_mcore(hf, ckpt, progress=False)
        roles[name] = open_checkpoint(ckpt).roles
        mcore_to_hf(ckpt, back, progress=False)
    return roles


@pytest.mark.slow
def test_converter_round_trip_of_a_sequence_classifier_is_bit_exact(reference, tmp_path):
    from safetensors.torch import load_file

    dirs, scores, _ = reference
    roles = spawn(roundtrip_worker, 1, dirs, str(tmp_path))[0]
    for name, src in dirs.items():
        assert roles[name] == ("reward", "critic")
        back = tmp_path / name / "hf"
        a = load_file(os.path.join(src, "model.safetensors"))
        b = {}
        for f in os.listdir(back):
            if f.endswith(".safetensors"):
                b.update(load_file(str(back / f)))
        assert sorted(a) == sorted(b) and "score.weight" in b, name
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), (name, k)
        cfg = json.load(open(back / "config.json"))
        assert cfg["architectures"] == ["LlamaForSequenceClassification"]
        assert cfg["num_labels"] == 1 and cfg["pad_token_id"] == rw.MODELS[name]
        # transformers scores the exported directory exactly as the original
        assert torch.equal(rw.hf_scores(str(back), rw.MODELS[name]), scores[name])


def test_a_causal_lm_is_refused_as_a_reward_model(tmp_path):
    from megarl.config import ConfigError
    from megarl.rewards.model import open_scalar_model
    from tests.distill_teacher import write_teacher

    lm = write_teacher(str(tmp_path / "lm"))
    with pytest.raises(ConfigError, match="is a LlamaForCausalLM, without a scalar score head"):
        open_scalar_model(lm, "reward.model")
