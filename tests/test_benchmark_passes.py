"""`--suite passes`: the operator split of a real profile, the records against the floor, and one
quick pass pair through megatron (fp32, a random 2-layer Llama)."""

import argparse

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from megarl.benchmarks import passes


def test_the_split_sorts_a_real_profile_into_gemm_attention_and_the_rest():
    a, q = torch.randn(256, 256), torch.randn(2, 4, 32, 16)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.mm(a, a)
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
        torch.exp(a)
    events = prof.key_averages()
    split = passes.split_self_times(events)
    own = {e.key: e.self_cpu_time_total / 1e6 for e in events}
    assert split["gemm"] == pytest.approx(own["aten::mm"])
    assert split["attention"] == pytest.approx(
        sum(s for k, s in own.items() if k.startswith("aten::_scaled_dot_product"))
    )
    assert split["attention"] > 0 and own["aten::exp"] > 0
    assert split["other"] >= own["aten::exp"]
    assert split["gemm"] + split["attention"] + split["other"] == pytest.approx(split["total"])
    assert split["total"] == pytest.approx(sum(own.values()))


def test_the_workload_has_the_peer_lengths():
    prompts, responses = passes.workload(vocab_size=100, sequences=64)
    assert len(prompts) == len(responses) == 64
    assert {len(p) for p in prompts} <= set(range(40, 61))
    assert {len(r) for r in responses} <= set(range(1, 49))
    assert all(3 <= t < 100 for p in prompts for t in p)
    assert passes.workload(100, 64) == (prompts, responses)  # seeded


def test_records_put_each_time_against_the_floor():
    res = {"real_tokens": 1000, "computed_tokens": 1000, "gemm_rate": 1e9}
    for name, flops in (("reference", 2e9), ("train", 6e9)):
        # a profiled run slower than the timed ones: its shares apply to the median
        res[name] = {
            "seconds": 4.5,
            "repeats": 3,
            "flops": flops,
            "gemm": 6.0,
            "attention": 1.5,
            "other": 1.5,
            "total": 9.0,
        }
    recs = {r["name"]: r for r in passes._records(res, "bf16", "m", 64)}
    assert recs["reference_pass_bf16"]["value"] == 4.5
    assert recs["reference_pass_bf16"]["floor"] == 2.0  # 2e9 FLOPs at 1e9 FLOP/s
    assert recs["reference_pass_bf16"]["ratio_to_floor"] == pytest.approx(2.0 / 4.5)
    assert recs["train_gemm_only_bf16"]["value"] == pytest.approx(3.0)  # 4.5 x 6 / 9
    assert recs["train_gemm_only_bf16"]["ratio_to_floor"] == pytest.approx(6.0 / 3.0)
    assert recs["train_gemm_and_attention_bf16"]["value"] == pytest.approx(3.75)
    table = passes.summary(list(recs.values()))
    assert "| reference | bf16 | 4.50 | 2.00 | 44% | 67% / 17% / 17% | 67% / 53% |" in table
    assert "| train | bf16 | 4.50 | 6.00 | 133% |" in table


@pytest.fixture(scope="module")
def quick_suite():
    """`--suite passes --quick` for real, with bf16 reported as emulated: the fp32 pass pair runs
    through megatron in a child; bf16 is a SKIP record. Returns the records and each child's
    (dtype, result)."""
    runs, real = [], passes.spawn

    def keep(fn, n, *args, **kwargs):
        out = real(fn, n, *args, **kwargs)
        runs.append((args[2], out[0]))
        return out

    mp = pytest.MonkeyPatch()
    mp.setattr(passes, "spawn", keep)
    mp.setattr(passes.device, "cpu_half_precision_note", lambda d: "emulated here")
    try:
        return passes.suite(argparse.Namespace(quick=True)), runs
    finally:
        mp.undo()


def test_emulated_bf16_is_a_skip_record_with_its_reason(quick_suite):
    recs, runs = quick_suite
    assert [dtype for dtype, _ in runs] == ["fp32"]  # bf16 is not run
    skips = [r for r in recs if r["params"].get("status") == "SKIP"]
    assert [(r["name"], r["params"]["reason"]) for r in skips] == [
        ("reference_pass_bf16", "emulated here"),
        ("train_pass_bf16", "emulated here"),
    ]
    table = passes.summary(recs)
    assert "| train | bf16 | SKIP: emulated here |" in table
    res = runs[0][1]
    train = res["train"]
    seconds = train["seconds"]
    floor = train["flops"] / res["gemm_rate"]
    split = " / ".join(f"{100 * train[k] / train['total']:.0f}%"
                       for k in ("gemm", "attention", "other"))  # fmt: skip
    row = f"| train | fp32 | {seconds:.2f} | {floor:.2f} | {100 * floor / seconds:.0f}% | {split} |"
    assert row in table, table


def test_a_quick_pass_pair_through_megatron(quick_suite):
    res = quick_suite[1][0][1]
    assert res["real_tokens"] == res["computed_tokens"] > passes.QUICK_SEQUENCES * 41  # packed
    ref, train = res["reference"], res["train"]
    assert train["flops"] == pytest.approx(3 * ref["flops"])
    for r in (ref, train):
        assert r["repeats"] == passes.QUICK_REPEATS and r["seconds"] > 0
        assert r["gemm"] > 0 and r["attention"] > 0 and r["other"] > 0  # each kind ran
    assert res["gemm_rate"] > 0
