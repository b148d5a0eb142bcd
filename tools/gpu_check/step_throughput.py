"""Step 4: training throughput and MFU of megarl's policy update, bf16, one GPU, TP = PP = 1.

One model per process (`--model`), so that the next one starts with an empty GPU:
- llama_1b: Llama-3.2-1B shape (16 layers, hidden 2048, 128k vocab, tied embeddings), seq 2048.
- llama_7b: Llama-2-7B shape, seq 1024, if it fits in the GPU with its DistributedOptimizer
  (bf16 params + fp32 grads + fp32 main params + Adam moments: about 18 bytes per parameter,
  ~113 GiB for 6.7B); a model or step that does not fit is a SKIP with the figures, not a FAIL.
For micro-batch sizes 1, 2, 4, ... until one runs out of memory: a GRPO `train_policy` step over
two micro-batches (rows = 2 x mbs sequences of full length) after one warm-up, median of three
steps, plus one `forward_logprobs` pass. tokens/s = rows x seq / step time; MFU = tokens/s x
`flops_per_token(arch, seq_len, training=True, causal=True)` / `peak_flops(device, bf16)`, the
figures the trainer logs. megatron-core's local layers (no TE: no fused attention, no FP8) set
this number; it is the floor the TE path must beat.
Each micro-batch size also records `plan_gib`, `megarl plan`'s estimate of the same step (its
formulas at TP = PP = DP = 1), beside the measured `peak_gib`.
`--device cpu --tiny` runs one small micro-batch sweep on CPU (no MFU there).
"""

from __future__ import annotations

import gc
import time

import common

SETUPS = {
    "llama_1b": dict(seq=2048, mbs=(1, 2, 4, 8, 16)),
    "llama_7b": dict(seq=1024, mbs=(1, 2, 4, 8)),
    "tiny": dict(seq=32, mbs=(1, 2)),
}


def _is_oom(e: BaseException) -> bool:
    import torch

    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


def measure(fig, name: str, device: str, rec) -> None:
    import torch

    from megarl.config import AlgorithmConfig
    from megarl.data.batch import MicroBatching
    from megarl.metrics.throughput import flops_per_token, peak_flops
    from megarl.models.optim import OptimConfig, build_optimizer
    from megarl.rollout.config import SamplingConfig
    from megarl.trainer.experience import forward_logprobs
    from megarl.trainer.update import train_policy

    a = common.arch(name)
    setup = SETUPS[name]
    seq = setup["seq"]
    dtype = "bf16" if device == "cuda" else "fp32"
    par, groups = common.init_megatron(a)
    t0 = time.perf_counter()
    try:
        actor = common.build(a, par, dtype, "actor", device)
        opt, sched = build_optimizer(actor, OptimConfig(lr=1e-6), dtype=dtype, total_steps=100)
    except Exception as e:  # noqa: BLE001 - only an OOM is a verdict here
        if not _is_oom(e):
            raise
        fig["peak_gib"] = common.peak_gib(device)
        raise common.Skip(f"{name} with its optimizer does not fit: {str(e)[:200]}") from None
    fig.update(
        params=common.param_count(actor), seq=seq, dtype=dtype, build_s=time.perf_counter() - t0
    )
    peak = peak_flops(torch.cuda.get_device_name(), torch.bfloat16) if device == "cuda" else None
    fpt = flops_per_token(a, seq_len=seq, training=True, causal=True)
    fig["train_flops_per_token"] = fpt
    per_mbs = {}
    for mbs in setup["mbs"]:
        if rec.remaining() < 25:
            fig["stopped"] = f"time budget: {rec.remaining():.0f} s left before mbs={mbs}"
            break
        rows = 2 * mbs
        batch = common.random_batch(
            a, prompt_len=seq // 8, resp_lens=[seq - seq // 8] * rows, seed=mbs
        )
        alg = AlgorithmConfig(name="grpo", micro_batch_size=mbs, kl_coef=0.0)
        sampling = SamplingConfig(n=rows, max_tokens=seq, temperature=1.0)
        common.reset_peak(device)
        oom = False
        try:
            t0 = time.perf_counter()
            old = forward_logprobs(
                actor,
                batch.fields(),
                micro=MicroBatching.of(alg, pad_to=1),
                vocab_size=a.vocab_size,
                groups=groups,
                temperature=1.0,
            )
            common.sync(device)
            fwd_s = time.perf_counter() - t0
            adv = torch.linspace(-1, 1, rows)[:, None] * batch.loss_mask
            batch.old_logprobs, batch.advantages = old, adv

            def step(batch=batch, alg=alg, sampling=sampling):
                train_policy(
                    actor,
                    opt,
                    sched,
                    batch,
                    alg=alg,
                    sampling=sampling,
                    vocab_size=a.vocab_size,
                    groups=groups,
                    seed=0,
                )

            secs = common.median_time(step, device, repeats=3, warmup=1)
        except Exception as e:  # noqa: BLE001 - OOM ends the sweep; anything else is a FAIL
            if not _is_oom(e):
                raise
            oom = True
        if oom:  # freed only here, once the exception (and the frames it holds) is gone
            per_mbs[mbs] = f"OOM (peak {common.peak_gib(device) or 0:.1f} GiB)"
            batch = old = None
            _free(device)
            break
        tokens = rows * seq
        tps = tokens / secs
        per_mbs[mbs] = dict(
            tokens_per_s=round(tps),
            step_s=secs,
            fwd_tokens_per_s=tokens / fwd_s,
            peak_gib=common.peak_gib(device),
            plan_gib=_planned_gib(a, fig["params"], dtype, mbs, seq),
            mfu=None if peak is None else tps * fpt / peak,
        )
        fig.update(mbs=mbs, tokens_per_s=tps, step_s=secs, peak_gib=common.peak_gib(device))
        if peak is not None:
            fig.update(mfu=tps * fpt / peak, achieved_tflops=tps * fpt / 1e12)
    fig["per_mbs"] = per_mbs
    if "mbs" not in fig:
        raise common.Skip(
            f"{name}: not even micro-batch 1 x seq {seq} fits next to the optimizer ({per_mbs})"
        )


def _planned_gib(a, params: int, dtype: str, mbs: int, seq: int) -> float:
    """`megarl plan`'s figure for this step (its train-phase rows at TP = PP = DP = 1, local
    layers), recorded beside the measured peak so the planner can be checked on a GPU."""
    from megarl.dtypes import BYTES
    from megarl.plan import formulas as fm

    e = BYTES[dtype]
    per, _ = fm.optimizer_bytes_per_param(dtype)
    impl = "local" if dtype == "fp32" or device_is_cuda() else "local-fp32"
    layer, _ = fm.layer_activation_bytes_per_token(
        a, elem=e, tp=1, sequence_parallel=False, impl=impl
    )
    loss, _ = fm.logits_bytes_per_token(a.padded_vocab_size(128, 1), tp=1, elem=e, packed=True)
    tokens = mbs * seq
    return (params * (e + 4 + per) + tokens * (a.num_layers * layer + loss)) / fm.GiB


def device_is_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def body(rec: common.Recorder, args, device: str) -> None:
    name = "tiny" if args.tiny else args.model
    rec.run(name, measure, name, device, rec)


if __name__ == "__main__":
    common.main(
        "throughput",
        body,
        lambda args: ["tiny" if args.tiny else args.model],
        extra=lambda p: p.add_argument(
            "--model", choices=("llama_1b", "llama_7b"), default="llama_1b"
        ),
    )
