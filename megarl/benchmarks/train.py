"""`--suite train`: megatron forward+backward throughput of the actor on this machine.

Builds a Llama-shaped model (about 110M parameters; `--quick`: about 20M) at TP=PP=1, runs
`get_forward_backward_func` (through `megarl.models.forward.forward_backward`) with the
policy-gradient loss shape (vocab-parallel logprobs, masked mean), and reports tokens/s and
achieved model FLOP/s with the floor measured in the same run: the machine's dense fp32 GEMM
FLOP/s (a large `torch.mm`).
"""

from __future__ import annotations

import time

import torch

from megarl.benchmarks import median_time, record, register_suite
from megarl.distributed import ParallelConfig, Topology
from megarl.distributed.launch import spawn
from megarl.metrics.throughput import flops_per_token
from megarl.models import forward, vocab
from megarl.models.builder import build_model
from megarl.models.hf_config import PrecisionConfig, arch_from_hf
from megarl.models.optim import wire_grad_finalization, zero_grads

ARCH = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=32000,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=8,
    num_attention_heads=12,
    num_key_value_heads=4,
    max_position_embeddings=2048,
)
QUICK = dict(
    ARCH,
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=8192,
)


def gemm_flops(n: int = 2048, repeats: int = 5) -> float:
    """Dense fp32 matmul FLOP/s of this process (the compute floor for CPU training)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    t = median_time(lambda: torch.mm(a, b), repeats=repeats)
    return 2 * n**3 / t


def _worker(rank, world, hf: dict, batch: int, seq: int, steps: int):
    arch = arch_from_hf(hf)
    par = ParallelConfig()
    groups = Topology.create(par, world).initialize(seed=0)
    model = build_model(arch, par, PrecisionConfig(), role="actor")
    wire_grad_finalization(model)
    tokens = torch.randint(0, arch.vocab_size, (batch, seq + 1))
    mb = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "mask": torch.ones(batch, seq)}

    def loss_fn(m, logits):
        lp = vocab.token_logprobs(
            logits, m["targets"], vocab_size=arch.vocab_size, tp_group=groups.tp
        )
        return -(lp * m["mask"]).sum() / m["mask"].sum(), {}

    def step():
        zero_grads(model)
        forward.forward_backward(model, [mb], loss_fn, forward_only=False, dp_size=1)

    t = median_time(step, repeats=steps, warmup=1)
    n_params = sum(p.numel() for p in model[0].parameters())
    fpt = flops_per_token(arch, seq_len=seq, training=True, causal=True)
    return {
        "seconds": t,
        "tokens": batch * seq,
        "params": n_params,
        "flops_per_token": fpt,
        "gemm": gemm_flops(),
    }


@register_suite("train")
def suite(args) -> list[dict]:
    hf = QUICK if args.quick else ARCH
    batch, seq = (4, 256) if args.quick else (8, 512)
    t0 = time.perf_counter()
    r = spawn(_worker, 1, hf, batch, seq, 3)[0]
    tps = r["tokens"] / r["seconds"]
    achieved = tps * r["flops_per_token"]
    common = dict(
        params=r["params"],
        batch=batch,
        seq_len=seq,
        dtype="fp32",
        layout="TP1 PP1",
        wall_s=time.perf_counter() - t0,
    )
    return [
        record("train_fwd_bwd_tokens_per_s", tps, "tokens/s", **common),
        record(
            "train_model_flops",
            achieved,
            "FLOP/s",
            floor=r["gemm"],
            floor_unit="FLOP/s",
            floor_name="dense fp32 GEMM (torch.mm 2048^3) in the same process",
            **common,
        ),
    ]
