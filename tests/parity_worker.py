"""Distributed workers for the layout-parity tests (module-level so spawn can import them)."""

from __future__ import annotations

import torch

from megarl.convert.layout import gather_full_state, load_full_state
from megarl.distributed import ParallelConfig, Topology
from megarl.models import forward, vocab
from megarl.models.builder import build_model
from megarl.models.hf_config import PrecisionConfig, arch_from_hf
from megarl.models.optim import OptimConfig, build_optimizer, wire_grad_finalization


def random_full_state(hf: dict, seed: int) -> dict[str, torch.Tensor]:
    """Canonical weights of a single-rank model built with `seed` (run inside a 1-rank job)."""
    arch = arch_from_hf(hf)
    par = ParallelConfig()
    Topology.create(par, 1).initialize(seed=seed)
    model = build_model(arch, par, PrecisionConfig(), role="actor")
    with torch.no_grad():  # norms start at 1 and the value head at 0: perturb everything
        for p in model[0].parameters():
            p.add_(0.02 * torch.randn_like(p))
    return gather_full_state(model)


def make_states(rank, world, archs: dict, seed: int):
    return {name: random_full_state(hf, seed) for name, hf in archs.items()}


def _setup(hf, layout, world, seed=0):
    arch = arch_from_hf(hf)
    par = ParallelConfig(**layout)
    topo = Topology.for_model(par, world, arch)
    groups = topo.initialize(seed=seed)
    return arch, par, groups


def _loss_fn(arch, groups, global_tokens):
    def loss_fn(mb, out):
        lp = vocab.token_logprobs(
            out, mb["targets"], vocab_size=arch.vocab_size, tp_group=groups.tp
        )
        loss = -(lp * mb["mask"]).sum() / global_tokens
        full = vocab.gather_vocab(out.detach(), vocab_size=arch.vocab_size, tp_group=groups.tp)
        return loss, {"idx": mb["idx"], "logits": full, "loss": loss.detach()}

    return loss_fn


def _micro_batches(batch, groups, num_micro):
    b = batch["tokens"].shape[0]
    per = b // groups.dp_size
    lo = groups.dp_rank * per
    idx = torch.arange(lo, lo + per)
    return [
        {
            "tokens": batch["tokens"][i],
            "targets": batch["targets"][i],
            "mask": batch["mask"][i],
            "idx": i,
        }
        for i in idx.chunk(num_micro)
    ]


def parity(rank, world, archs: dict, states: dict, layout: dict, batch: dict, num_micro: int):
    """Per arch: full logits by sample, full grads, and full params after one Adam step."""
    from megatron.core.distributed import DistributedDataParallelConfig

    results = {}
    for name, hf in archs.items():
        arch, par, groups = _setup(hf, layout, world)
        global_tokens = batch["mask"].sum()
        mbs = _micro_batches(batch, groups, num_micro)
        loss_fn = _loss_fn(arch, groups, global_tokens)

        # 1) logits and grads with a plain all-reduce DDP (grads whole on every DP rank)
        ddp = DistributedDataParallelConfig(
            use_distributed_optimizer=False, grad_reduce_in_fp32=True
        )
        model = build_model(arch, par, PrecisionConfig(), role="actor", ddp_config=ddp)
        load_full_state(model, states[name])
        wire_grad_finalization(model)
        out = forward.forward_backward(
            model, mbs, loss_fn, forward_only=False, dp_size=groups.dp_size
        )
        grads = gather_full_state(model, grads=True)
        logits = {}
        if groups.tp_rank == 0:
            for m in out:
                for i, row in zip(m["idx"].tolist(), m["logits"], strict=False):
                    logits[i] = row
        # 2) one DistributedOptimizer step
        model = build_model(arch, par, PrecisionConfig(), role="actor")
        load_full_state(model, states[name])
        opt, _ = build_optimizer(
            model, OptimConfig(lr=1e-2, clip_grad=0.0, adam_eps=1e-4), dtype="fp32"
        )
        forward.forward_backward(model, mbs, loss_fn, forward_only=False, dp_size=groups.dp_size)
        ok, grad_norm, _ = opt.step()
        params = gather_full_state(model)
        results[name] = {
            "logits": logits,
            "grads": grads if rank == 0 else {},
            "params": params if rank == 0 else {},
            "grad_norm": float(grad_norm),
            "update_ok": bool(ok),
        }
    return results


def expert_bias_after_step(rank, world, hf: dict, state: dict, layout: dict, batch: dict, rate):
    """The routers' expert biases after one forward-backward of an actor built with
    `expert_bias_update_rate=rate` (megatron moves them in `finalize_model_grads`)."""
    from megarl.models.builder import BuildConfig

    arch, par, groups = _setup(hf, layout, world)
    build = BuildConfig(expert_bias_update_rate=rate)
    model = build_model(arch, par, PrecisionConfig(), role="actor", build=build)
    load_full_state(model, state)
    wire_grad_finalization(model)
    mbs = _micro_batches(batch, groups, 2)
    loss_fn = _loss_fn(arch, groups, batch["mask"].sum())
    forward.forward_backward(model, mbs, loss_fn, forward_only=False, dp_size=groups.dp_size)
    full = gather_full_state(model)
    return {k: v for k, v in full.items() if k.endswith("router.expert_bias")}
