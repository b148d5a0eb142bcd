"""`--suite passes`: the operator split of a real profile, the records against the floor, and one
quick pass pair through megatron (fp32, a random 2-layer Llama)."""

import argparse

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from megarl.benchmarks import passes
from megarl.distributed.launch import spawn


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


def test_emulated_bf16_is_a_skip_record_with_its_reason(monkeypatch):
    # the bookkeeping only: the fp32 worker's result is canned, bf16 is not run
    canned = {"real_tokens": 10, "computed_tokens": 10, "gemm_rate": 1e9}
    for name in ("reference", "train"):
        canned[name] = {"seconds": 2.0, "repeats": 1, "flops": 1e9, "gemm": 1.0,
                        "attention": 0.5, "other": 0.5, "total": 2.0}  # fmt: skip
    runs = []
    monkeypatch.setattr(passes, "spawn", lambda fn, n, *a, **kw: runs.append(a[2]) or [canned])
    monkeypatch.setattr(passes.device, "cpu_half_precision_note", lambda d: "emulated here")
    recs = passes.suite(argparse.Namespace(quick=True))
    assert runs == ["fp32"]
    skips = [r for r in recs if r["params"].get("status") == "SKIP"]
    assert [(r["name"], r["params"]["reason"]) for r in skips] == [
        ("reference_pass_bf16", "emulated here"),
        ("train_pass_bf16", "emulated here"),
    ]
    table = passes.summary(recs)
    assert "| train | bf16 | SKIP: emulated here |" in table
    assert "| train | fp32 | 2.00 | 1.00 | 50% | 50% / 25% / 25% | 100% / 67% |" in table


def test_a_quick_pass_pair_through_megatron():
    res = spawn(passes._worker, 1, passes.QUICK_ARCH, None, "fp32", 8, 1)[0]
    assert res["real_tokens"] == res["computed_tokens"] > 8 * 41  # packed: no padding
    ref, train = res["reference"], res["train"]
    assert train["flops"] == pytest.approx(3 * ref["flops"])
    for r in (ref, train):
        assert r["repeats"] == 1 and r["seconds"] > 0
        assert r["gemm"] > 0 and r["attention"] > 0 and r["other"] > 0
    assert train["gemm"] > ref["gemm"]  # the backward's two GEMMs per forward GEMM
    assert res["gemm_rate"] > 1e9
