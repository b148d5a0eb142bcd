"""Measured resident-set growth of each thing `megarl plan` estimates, on one gloo rank.

Components are built and run in the order a run builds them, each inside `PeakRSS` (glibc's
mmap threshold pinned by the caller, see tests/test_memory_bounds.py): the reference's weights,
the actor (weights + megatron DDP's fp32 grad buffer), the policy loss over `micros`
micro-batches through megatron's schedule (activations + the loss over the vocabulary: the
peak), a forward pass without grad (the logprob pass), then the optimizer's construction and
first step (Adam's state: fp32 master copies of 16-bit weights, m and v, all made when
`build_optimizer` builds it).
"""

from __future__ import annotations

import torch

from megarl.distributed import ParallelConfig, Topology
from tests.weights_worker import PeakRSS, rss


def measure(
    rank,
    world,
    hf: dict,
    layout: dict,
    dtype: str,
    seq: int,
    mbs: int,
    micros: int,
    entropy: float,
    critic: bool = False,
) -> dict:
    """Bytes: `<part>` the peak growth over its block, `<part>_held` what stays resident."""
    from megarl.config import AlgorithmConfig
    from megarl.data.packing import PackedRows
    from megarl.models import forward
    from megarl.models.builder import build_model
    from megarl.models.hf_config import PrecisionConfig, arch_from_hf
    from megarl.models.optim import OptimConfig, build_optimizer, zero_grads
    from megarl.rollout.config import SamplingConfig
    from megarl.trainer.update import _policy_loss_fn

    arch = arch_from_hf(hf)
    par = ParallelConfig(**layout)
    groups = Topology.create(par, world).initialize(seed=0)
    prec = PrecisionConfig(dtype=dtype)
    out = {}
    with PeakRSS() as m:
        reference = build_model(arch, par, prec, role="reference")
    out["reference"] = m.growth
    out["reference_held"] = rss() - m.base
    with PeakRSS() as m:
        actor = build_model(arch, par, prec, role="actor")
    out["actor"] = m.growth
    out["actor_held"] = rss() - m.base

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, arch.vocab_size, (mbs, seq + 1), generator=g)
    micro = {
        "tokens": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "loss_mask": torch.ones(mbs, seq),
        "advantages": torch.randn(mbs, seq, generator=g),
        "old_logprobs": torch.full((mbs, seq), -7.0),
        "sampler_logprobs": None,
        "ref_logprobs": None,
        "index": torch.arange(mbs),
        "seq_len": torch.full((mbs,), seq),
    }
    micro["packing"] = PackedRows.of(micro["seq_len"])  # packed, as the trainer runs them
    alg = AlgorithmConfig(entropy_coef=entropy)
    loss_fn = _policy_loss_fn(
        alg, SamplingConfig(temperature=0.9), arch.vocab_size, groups, float(mbs * seq), float(mbs)
    )
    micro_batches = [dict(micro) for _ in range(micros)]
    run = dict(forward_only=False, dp_size=1)
    forward.forward_backward(
        actor, micro_batches, loss_fn, **run
    )  # warm-up: lazy buffers, allocator
    zero_grads(actor)
    with PeakRSS() as m:
        forward.forward_backward(actor, micro_batches, loss_fn, **run)
    out["train"] = m.growth
    out["train_held"] = rss() - m.base

    def logprobs(_micro, logits):
        lp = forward.token_logprobs(_micro, logits, vocab_size=arch.vocab_size, tp_group=groups.tp)
        return lp.sum(), {}

    with torch.no_grad():
        forward.forward_backward(
            reference, micro_batches[:1], logprobs, forward_only=True, dp_size=1
        )
        with PeakRSS() as m:
            forward.forward_backward(
                reference, micro_batches[:1], logprobs, forward_only=True, dp_size=1
            )
    out["logprobs"] = m.growth
    out["logprobs_held"] = rss() - m.base
    with PeakRSS() as m:  # Adam's state: masters, m and v, made by build_optimizer
        optimizer, _ = build_optimizer(actor, OptimConfig(lr=1e-5), dtype=dtype)
        optimizer.step()
    out["optimizer"] = m.growth
    out["optimizer_held"] = rss() - m.base
    if critic:  # PPO's critic: weights, grad buffer and Adam state (after a step)
        with PeakRSS() as m:
            value = build_model(arch, par, prec, role="critic")
            value_opt, _ = build_optimizer(value, OptimConfig(lr=1e-5), dtype=dtype)
            value_opt.step()
        out["critic"] = m.growth
        out["critic_held"] = rss() - m.base
    return out


def measure_vllm(rank, world, hf: dict, kv_bytes: int) -> dict:
    """Resident-set growth of building the colocated vLLM engine (weights + KV cache)."""
    import json
    import tempfile

    import vllm  # noqa: F401 - imported before the measurement: its import is not the engine

    from megarl.models.hf_config import arch_from_hf
    from megarl.rollout.config import EngineConfig, SamplingConfig
    from megarl.rollout.engine.engine import RolloutEngine

    arch = arch_from_hf(hf)
    Topology.create(ParallelConfig(), world).initialize(seed=0)
    model = tempfile.mkdtemp(prefix="megarl_plan_")
    with open(f"{model}/config.json", "w") as f:
        json.dump(hf, f)
    cfg = SamplingConfig(max_tokens=8)
    with PeakRSS() as m:
        engine = RolloutEngine(model, arch, cfg, EngineConfig(kv_cache_memory_bytes=kv_bytes))
    out = {"engine": m.growth, "engine_held": rss() - m.base}
    del engine
    return out


def measure_lora(rank, world, hf: dict, dtype: str, lora_rank: int, role: str = "actor") -> dict:
    """Bytes of the parts of a LoRA actor (or critic: `role`) as built by the trainer
    (`build_model`, megatron's DDP and DistributedOptimizer, one Adam step), counted from the
    tensors themselves: `weights` every parameter, `trained` the parameters with gradients,
    `main_grads` the fp32 grads of the parameters in DDP's buffer, `grad_buffer` the buffer with
    megatron's alignment padding, `optimizer` Adam's m, v and fp32 master copies, `merged` the
    weight sync's merged copies (`lora.merged`)."""
    from megarl.models import lora
    from megarl.models.builder import BuildConfig, build_model
    from megarl.models.hf_config import PrecisionConfig, arch_from_hf
    from megarl.models.optim import OptimConfig, build_optimizer

    arch = arch_from_hf(hf)
    par = ParallelConfig()
    Topology.create(par, world).initialize(seed=0)
    adapters = lora.LoraConfig(rank=lora_rank)
    build = BuildConfig(lora=adapters) if role == "actor" else BuildConfig(critic_lora=adapters)
    chunks = build_model(arch, par, PrecisionConfig(dtype=dtype), role=role, build=build)
    params = [p for c in chunks for p in c.parameters()]
    buffers = [b for c in chunks for b in c.buffers]
    optimizer, _ = build_optimizer(chunks, OptimConfig(lr=1e-5), dtype=dtype)
    optimizer.step()  # the state after a real step (m and v exist from the build on)
    inner = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    masters = [p for o in inner for g in o.param_groups for p in g["params"]]
    fp32_params = {p.data_ptr() for p in params if p.dtype == torch.float32}
    state = [t for o in inner for s in o.state.values() for t in s.values() if torch.is_tensor(t)]
    with lora.merged(chunks):
        merged = sum(a.weight.nbytes for ad in lora.adapters_of(chunks) for a in ad.adapted)
    return {
        "weights": sum(p.nbytes for p in params),
        "adapters": sum(p.numel() for p in params if lora.is_lora(p)),
        "trained": sum(p.numel() for p in params if p.requires_grad),
        "main_grads": sum(p.main_grad.nbytes for p in params if p.requires_grad),
        "grad_buffer": sum(b.grad_data.nbytes for b in buffers),
        "optimizer": sum(t.nbytes for t in state if t.dim() > 0)  # not Adam's step counter
        + sum(p.nbytes for p in masters if p.data_ptr() not in fp32_params),  # fp32 masters
        "merged": merged,
    }
