"""`--suite passes` (opt-in): where the time of the reference and train passes goes, against
their GEMM floor, on the real-model peer workload's shape.

The workload: SmolLM2-135M-Instruct (fetched once, as `megarl fetch-model` does), 64 sequences
of random tokens with the peer workload's lengths (prompts 40-60 tokens, responses 1-48),
packed into micro-batches of 16 sequences (`algorithm.pack_sequences`). `--quick`: a random
2-layer Llama, 16 sequences, one timed run, no fetch. Passes: the reference pass (forward-only
logprobs of every token, `megarl.trainer.experience.forward_logprobs`) and the train pass
(forward + backward of the mean token logprob through `megarl.models.forward.forward_backward`),
in fp32 and, on a CPU with bf16 instructions, in bf16.

Per pass and precision: the median wall time of `REPEATS` runs after a warm-up, then one run
under `torch.profiler` whose operators' self times are split into GEMMs (`aten::mm`, `addmm`,
`bmm`), attention (the SDPA kernels) and everything else (norms, rotary, activations, the
vocabulary's softmax, casts, copies, Python); the shares of that run apply to the median. The
floor is the pass's model FLOPs on its real tokens at the GEMM rate measured in the same process
(`megarl.benchmarks.peer.gemm_flops`, the peer suite's floor). Beside the pass's own % of the
floor, the suite reports two ceilings: the % the pass would reach if only its GEMMs took time,
and if only its GEMMs and attention did.
CPU only: on a GPU the profiler's CPU self times do not measure the kernels.
"""

from __future__ import annotations

import json
import os
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from megarl.benchmarks import median_time, peer_smollm2, record, register_suite
from megarl.benchmarks.peer import DTYPES, gemm_flops
from megarl.convert.fetch import fetch_gguf
from megarl.convert.gguf import cached_hf_dir
from megarl.convert.sharded import load_hf_sharded
from megarl.data.batch import MicroBatching, collate, pad_share, split_micro_batches
from megarl.distributed import ParallelConfig, Topology, device
from megarl.distributed.launch import spawn
from megarl.metrics.throughput import flops_per_token
from megarl.models import forward
from megarl.models.builder import build_model
from megarl.models.hf_config import PrecisionConfig, arch_from_hf
from megarl.models.optim import wire_grad_finalization, zero_grads
from megarl.trainer.experience import forward_logprobs

SEQUENCES, MICRO_BATCH, REPEATS, SEED = 64, 16, 3, 0
QUICK_SEQUENCES, QUICK_REPEATS = 16, 1
PROMPT_LEN, RESPONSE_LEN = (40, 60), (1, 48)
QUICK_ARCH = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=4096,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=True,
)
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
ATTENTION_PREFIX = "aten::_scaled_dot_product"


def split_self_times(events) -> dict[str, float]:
    """Seconds of operator self time by kind ("gemm", "attention", "other", "total") from
    `torch.profiler`'s `key_averages()` (CPU self times; nested operators counted once)."""
    out = {"gemm": 0.0, "attention": 0.0, "total": 0.0}
    for e in events:
        s = e.self_cpu_time_total / 1e6
        out["total"] += s
        if e.key in GEMM_OPS:
            out["gemm"] += s
        elif e.key.startswith(ATTENTION_PREFIX):
            out["attention"] += s
    out["other"] = out["total"] - out["gemm"] - out["attention"]
    return out


def workload(vocab_size: int, sequences: int = SEQUENCES, seed: int = SEED):
    """(prompts, responses): token-id lists of the peer workload's lengths, random tokens."""
    g = torch.Generator().manual_seed(seed)
    draw = lambda lo, hi: [int(x) for x in torch.randint(lo, hi + 1, (sequences,), generator=g)]  # noqa: E731
    tokens = lambda n: torch.randint(3, vocab_size, (n,), generator=g).tolist()  # noqa: E731
    return [tokens(n) for n in draw(*PROMPT_LEN)], [tokens(n) for n in draw(*RESPONSE_LEN)]


def _worker(rank, world, hf: dict, model_dir: str | None, dtype: str, sequences: int, repeats: int):
    arch = arch_from_hf(hf)
    par = ParallelConfig()
    groups = Topology.create(par, world).initialize(seed=SEED)
    model = build_model(arch, par, PrecisionConfig(dtype=dtype), role="actor")
    if model_dir is not None:
        load_hf_sharded(model, arch, model_dir)
    wire_grad_finalization(model)
    batch = collate(*workload(arch.vocab_size, sequences), pad_id=0)
    how = MicroBatching(size=MICRO_BATCH, pack=True)
    micro = split_micro_batches(batch, how)
    real, computed = pad_share(micro)

    def reference():
        forward_logprobs(
            model, batch, micro=how, vocab_size=arch.vocab_size, groups=groups, temperature=1.0
        )

    def loss_fn(mb, logits):
        lp = forward.token_logprobs(mb, logits, vocab_size=arch.vocab_size, tp_group=groups.tp)
        return -(lp * mb["loss_mask"]).sum() / real, {}

    def train():
        zero_grads(model)
        forward.forward_backward(model, micro, loss_fn, forward_only=False, dp_size=1)

    seq_len = statistics.mean(int(n) for n in batch["seq_len"])
    fpt = flops_per_token(arch, seq_len=seq_len, causal=True)
    out = {"real_tokens": real, "computed_tokens": computed, "gemm_rate": gemm_flops(DTYPES[dtype])}
    for name, fn, flops in (("reference", reference, fpt * real), ("train", train, 3 * fpt * real)):
        seconds = median_time(fn, repeats=repeats, warmup=1)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        out[name] = {
            "seconds": seconds,
            "repeats": repeats,
            "flops": flops,
            **split_self_times(prof.key_averages()),
        }
    return out


def _records(res: dict, dtype: str, model: str, sequences: int) -> list[dict]:
    rate = res["gemm_rate"]
    out = []
    for name in ("reference", "train"):
        r = res[name]
        wall = r["seconds"]
        floor = r["flops"] / rate
        # the profiled run can be slower than the timed ones (the profiler's own work, a noisy
        # host): its shares, not its seconds, are applied to the median wall time
        share = {k: r[k] / r["total"] for k in ("gemm", "attention", "other")}
        common = dict(
            stage=name,
            model=model,
            dtype=dtype,
            sequences=sequences,
            micro_batch=MICRO_BATCH,
            real_tokens=res["real_tokens"],
            computed_tokens=res["computed_tokens"],
            repeats=r["repeats"],
            gemm_rate_flops=rate,
            profiled_s=r["total"],
            **{f"{k}_share": v for k, v in share.items()},
        )
        floor_kw = dict(floor=floor, floor_unit="s", higher_is_better=False)
        out += [
            record(f"{name}_pass_{dtype}", wall, "s", **floor_kw, **common, figure="pass"),
            # what the pass would reach if only its GEMMs, or its GEMMs and attention, took time
            record(
                f"{name}_gemm_only_{dtype}",
                wall * share["gemm"],
                "s",
                **floor_kw,
                **common,
                figure="gemm_only",
            ),
            record(
                f"{name}_gemm_and_attention_{dtype}",
                wall * (share["gemm"] + share["attention"]),
                "s",
                **floor_kw,
                **common,
                figure="gemm_and_attention",
            ),
        ]
    return out


def summary(records: list[dict]) -> str:
    """A markdown table: per pass and precision, wall time, the floor and the split."""
    rows = [
        "| pass | precision | wall s | floor s | % of floor | GEMM / attention / other "
        "(share of the time) | ceiling: GEMM only / GEMM + attention |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    ceiling = {
        (r["params"]["stage"], r["params"]["dtype"], r["params"]["figure"]): r["ratio_to_floor"]
        for r in records
        if "floor" in r
    }
    for r in records:
        p = r["params"]
        if p.get("status") == "SKIP":
            rows.append(f"| {p['stage']} | {p['dtype']} | SKIP: {p['reason']} |")
            continue
        if p["figure"] != "pass":
            continue
        name, dtype = p["stage"], p["dtype"]
        g, ga = ceiling[name, dtype, "gemm_only"], ceiling[name, dtype, "gemm_and_attention"]
        split = " / ".join(f"{100 * p[k + '_share']:.0f}%" for k in ("gemm", "attention", "other"))
        rows.append(
            f"| {name} | {dtype} | {r['value']:.2f} | {r['floor']:.2f} | "
            f"{100 * r['ratio_to_floor']:.0f}% | {split} | {100 * g:.0f}% / {100 * ga:.0f}% |"
        )
    return "\n".join(rows)


@register_suite("passes", summary=summary)
def suite(args) -> list[dict]:
    if torch.cuda.is_available():
        raise peer_smollm2.WorkloadError(
            "--suite passes measures the passes on the CPU (it splits CPU operator times); "
            "run it with CUDA_VISIBLE_DEVICES='' or on a machine without a GPU"
        )
    quick = bool(getattr(args, "quick", False))
    sequences, repeats = (QUICK_SEQUENCES, QUICK_REPEATS) if quick else (SEQUENCES, REPEATS)
    if quick:
        hf, model_dir, model = QUICK_ARCH, None, "random 2-layer Llama (--quick)"
    else:
        model_dir = cached_hf_dir(fetch_gguf(peer_smollm2.MODEL_NAME))
        with open(os.path.join(model_dir, "config.json")) as f:
            hf = json.load(f)
        model = "SmolLM2-135M-Instruct"
    records = []
    for dtype in ("fp32", "bf16"):
        emulated = dtype == "bf16" and device.cpu_half_precision_note("bf16")
        if emulated:  # hours per pass, and no figure worth comparing
            records += [
                record(f"{name}_pass_{dtype}", float("nan"), "s", stage=name, dtype=dtype,
                       figure="pass", status="SKIP", reason=emulated)
                for name in ("reference", "train")
            ]  # fmt: skip
            continue
        res = spawn(_worker, 1, hf, model_dir, dtype, sequences, repeats, timeout=3600)[0]
        records += _records(res, dtype, model, sequences)
    return records
