"""Distributed workers for the routing-replay tests (module-level for spawn).

`reference` (one rank): a tiny Qwen3-MoE's natural routes, recorded with forward hooks on its
routers (plain [s, b] order at TP=1, independent of megarl's replay layout code), and its
logprobs. `replay` (any layout): the same weights replaying those routes - and, as a control,
routes with every expert id shifted by one - through megarl's batch path (build_batch ->
micro-batches -> forward_logprobs), so row grouping, PP padding and sequence-parallel sharding
are all exercised.
"""

from __future__ import annotations

import torch

from tests.tiny import TINY_QWEN3_MOE

B, S_MAX = 6, 14


def _batch_inputs():
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (int(3 + b % 3),), generator=g).tolist() for b in range(B)]
    responses = [
        torch.randint(3, 250, (int(2 + (5 * b) % 7),), generator=g).tolist() for b in range(B)
    ]
    return prompts, responses


def _setup(layout: dict, world: int):
    from megarl.distributed import ParallelConfig, Topology
    from megarl.models.builder import BuildConfig, build_model
    from megarl.models.hf_config import PrecisionConfig, arch_from_hf

    arch = arch_from_hf(TINY_QWEN3_MOE)
    par = ParallelConfig(**layout)
    groups = Topology.for_model(par, world, arch).initialize(seed=0)
    chunks = build_model(
        arch, par, PrecisionConfig(), role="actor", build=BuildConfig(routing_replay=True)
    )
    return arch, groups, chunks


def _logprobs(chunks, arch, groups, routes, pad_to):
    from megarl.data.batch import MicroBatching
    from megarl.trainer import experience as xp

    prompts, responses = _batch_inputs()
    batch = xp.build_batch(
        prompts,
        responses,
        [[0.0] * len(r) for r in responses],
        pad_id=0,
        pad_to=pad_to,
        routed_experts=routes,
    )
    return xp.forward_logprobs(
        chunks,
        batch.fields(),
        micro=MicroBatching(size=2, pad_to=pad_to),
        vocab_size=arch.vocab_size,
        groups=groups,
        temperature=1.0,
    ), batch


def reference(rank: int, world: int) -> dict:
    from megarl.convert.layout import gather_full_state
    from megarl.models.routing import _routers

    arch, groups, chunks = _setup({}, world)
    with torch.no_grad():  # sharper routing than megatron's init: clear top-k margins
        for p in chunks[0].parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    natural = {}
    hooks = []
    for layer, router in _routers(chunks[0]):

        def hook(mod, args, out, layer=layer):
            logits = mod.gating(args[0])  # [s, b, E]
            natural.setdefault(layer, []).append(logits.topk(arch.moe_topk, -1).indices)

        hooks.append(router.register_forward_hook(hook))
    lp, batch = _logprobs(chunks, arch, groups, None, 1)
    for h in hooks:
        h.remove()
    # one forward per micro-batch: put each micro-batch's rows back (same split as forward)
    from megarl.data.batch import MicroBatching, split_micro_batches

    mbs = split_micro_batches(batch.fields(), MicroBatching(size=2))
    full = torch.zeros(B, batch.tokens.shape[1], arch.num_layers, arch.moe_topk, dtype=torch.long)
    for layer, parts in natural.items():
        for mb, idx in zip(mbs, parts, strict=True):
            full[mb["index"], : idx.shape[0], layer] = idx.transpose(0, 1)
    routes = [full[b, : int(batch.seq_len[b]) - 1].numpy() for b in range(B)]
    return {
        "state": gather_full_state(chunks),
        "routes": routes,
        "logprobs": lp,
        "mask": batch.loss_mask,
    }


def replay(rank: int, world: int, layout: dict, ref: dict) -> dict:
    from megarl.convert.layout import load_full_state
    from megarl.models.routing import RoutingReplayError

    arch, groups, chunks = _setup(layout, world)
    load_full_state(chunks, ref["state"])
    pad = groups.tp_size if layout.get("sequence_parallel") else 1
    out = {}
    out["replayed"], _ = _logprobs(chunks, arch, groups, ref["routes"], pad)
    shifted = [(r + 1) % arch.num_experts for r in ref["routes"]]
    out["shifted"], _ = _logprobs(chunks, arch, groups, shifted, pad)
    out["natural"], _ = _logprobs(chunks, arch, groups, None, pad)
    try:
        _logprobs(chunks, arch, groups, [r[:, :1] for r in ref["routes"]], pad)
        out["wrong_layers"] = ""
    except RoutingReplayError as e:
        out["wrong_layers"] = str(e)
    return out


def uneven(rank: int, world: int, ref: dict) -> dict:
    """EP2 where rank 1 has one row fewer (so one micro-batch fewer): every forward exchanges
    tokens within the EP group, so without equal counts rank 0 would wait forever. Each rank's
    logprobs must still equal the reference's for its rows."""
    from megarl.convert.layout import load_full_state
    from megarl.data.batch import MicroBatching
    from megarl.trainer import experience as xp

    arch, groups, chunks = _setup({"expert_parallel": 2}, world)
    load_full_state(chunks, ref["state"])
    prompts, responses = _batch_inputs()
    rows = B - rank
    batch = xp.build_batch(
        prompts[:rows],
        responses[:rows],
        [[0.0] * len(r) for r in responses[:rows]],
        pad_id=0,
        pad_to=1,
        routed_experts=ref["routes"][:rows],
    )
    lp = xp.forward_logprobs(
        chunks,
        batch.fields(),
        micro=MicroBatching(size=1),
        vocab_size=arch.vocab_size,
        groups=groups,
        temperature=1.0,
    )
    return {"rows": rows, "logprobs": lp}
