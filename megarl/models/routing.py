"""MoE routing in the trainer: routing replay (R3) and the router statistics behind the MoE
metrics.

Routing replay. With `rollout.engine.routing_replay` the rollout carries, per sample, the experts
vLLM routed every token to (`Samples.routed_experts`, [tokens, layers, top_k]); `collate_routes`
places them on the batch as `routed_experts` [B, S, layers, top_k] aligned with `tokens` (position t
= the routes of token t), so micro-batching, DP / PP padding and device moves treat them like any
per-token field. Before each micro-batch's forward (`prepare_forward`, called by
`megarl.models.forward`) every router of the chunk gets its layer's routes through megatron-core's
`RouterReplay` (REPLAY_FORWARD): the router's top-k indices are replaced, its weights are still the
softmax over the replayed experts' logits, so gradients flow through the router as usual. Megatron's
router sees its tokens as [s, b] flattened (sequence-major) and, with sequence parallelism, only its
rank's contiguous 1/TP of the sequence; routes are laid out the same way.

Which tokens have routes: vLLM computes every prompt token and every response token but the
last (generation stops before it is fed back). Positions without routes (that last token,
padding) get experts 0..k-1: their outputs reach no loss (the last token's own output is
masked, and attention is causal, so no other position reads it). Replay is on for the actor
and the reference (same architecture); the critic routes by itself.

Router statistics. A forward hook on each of the actor's routers counts, over the tokens whose
output matters (all but each sequence's last token and the padding: the positions that have
routes) of the training forwards (grad enabled), the tokens routed to each expert, and sums the
router's softmax probabilities per expert; with replay it also compares the replayed experts
with the router's own top-k. `moe_metrics` turns them into the per-step metrics (global:
summed over all ranks, since every rank routes distinct tokens - megarl requires sequence
parallelism with TP > 1 for MoE - and pipeline stages hold distinct layers):
- `moe/load_balance_max`, `moe/load_balance_mean`: max / mean over layers of
  max_e(tokens_e) / mean_e(tokens_e) (1 = perfectly balanced, E / k = all on k experts);
- `moe/aux_loss`: mean over layers of megatron's load-balancing loss with coefficient 1,
  E / (T^2 k) * sum_e P_e tokens_e (P_e = summed probabilities; 1 when balanced). It is a
  metric: megarl trains with `moe_aux_loss_coeff = 0`;
- `moe/replay_agreement` (with R3): fraction of those tokens whose replayed experts are the
  trainer router's own top-k, at the weights that generated the rollout (the old-logprob pass;
  the training forwards when there is none, i.e. one epoch of one mini-batch, whose forwards
  all precede the update): 1 = sampler and trainer route alike; below 1 = what R3 corrects.
"""

from __future__ import annotations

import numpy as np
import torch

from megarl.data.packing import model_layout
from megarl.metrics.reduce import LocalMetrics
from megarl.models.builder import unwrap


class RoutingReplayError(ValueError):
    """Routes that do not fit the model; names both sides."""


# ----------------------------------------------------------------------------- collate
def collate_routes(routes: list, seq_len: torch.Tensor, width: int) -> torch.Tensor:
    """Per-sample routes ([n_b, layers, top_k] arrays, n_b = tokens vLLM computed) -> [B, S,
    layers, top_k] (S = `width`), positions without routes filled with experts 0..k-1.
    `seq_len` [B]: prompt + response tokens; n_b must be seq_len - 1 or seq_len."""
    if len(routes) != len(seq_len):
        raise RoutingReplayError(
            f"{len(routes)} samples carry routes, the batch has {len(seq_len)}"
        )
    shapes = {tuple(np.shape(r)[1:]) for r in routes}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise RoutingReplayError(
            f"routed experts per token must all be [layers, top_k]; got {sorted(shapes)}"
        )
    layers, k = shapes.pop()
    # expert ids fit a byte for up to 256 experts (vLLM returns uint8 then, uint16 beyond)
    widest = max((int(np.max(r)) for r in routes if np.size(r)), default=0)
    dtype = torch.uint8 if widest < 256 else torch.int16
    out = torch.arange(k, dtype=dtype).expand(len(routes), width, layers, k).clone()
    for b, r in enumerate(routes):
        n, total = len(r), int(seq_len[b])
        if n not in (total - 1, total):
            raise RoutingReplayError(
                f"sample {b}: routes for {n} tokens, but it has {total} (prompt + response); "
                f"accepted: {total - 1} (all but the last token) or {total}"
            )
        out[b, :n] = torch.as_tensor(np.asarray(r).astype(np.int64)).to(dtype)
    return out


# ----------------------------------------------------------------------------- the model side
def _routers(model) -> list[tuple[int, torch.nn.Module]]:
    """(global layer index, router) of every MoE layer of a chunk, memoized on the chunk."""
    inner = unwrap(model)
    found = getattr(inner, "_megarl_routers", None)
    if found is None:
        found = []
        decoder = getattr(inner, "decoder", None)
        for layer in getattr(decoder, "layers", []):
            router = getattr(getattr(layer, "mlp", None), "router", None)
            if router is not None:
                found.append((layer.layer_number - 1, router))
        inner._megarl_routers = found
    return found


def _token_layout(x: torch.Tensor, router) -> torch.Tensor:
    """[b, s, ...] -> the router's token order: [s, b] flattened, this rank's sequence shard
    under sequence parallelism -> [tokens, ...]."""
    x = x.transpose(0, 1)
    if router.config.sequence_parallel:
        tp = router.tp_group.size()
        if x.shape[0] % tp:
            raise RoutingReplayError(
                f"sequence length {x.shape[0]} is not a multiple of TP={tp} (sequence parallel)"
            )
        x = x.chunk(tp, dim=0)[router.tp_group.rank()]
    return x.reshape(-1, *x.shape[2:])


def _distinct(idx: torch.Tensor) -> torch.Tensor:
    """Rows with a repeated expert (zero padding added by PP micro-batch padding) -> 0..k-1."""
    k = idx.shape[-1]
    if k > 1:
        srt = idx.sort(dim=-1).values
        bad = (srt[:, 1:] == srt[:, :-1]).any(-1)
        if bad.any():
            idx = idx.clone()
            idx[bad] = torch.arange(k, device=idx.device, dtype=idx.dtype)
    return idx


def prepare_forward(model, mb: dict) -> None:
    """Before `model`'s forward on micro-batch `mb`: hand each router its layer's replayed
    routes (or clear the replay when `mb` has none), and tell the statistics hooks which
    tokens are real. A no-op for dense models."""
    routers = _routers(model)
    if not routers:
        return
    _install_stats(model, routers)
    tokens = mb["tokens"]
    b, s = tokens.shape
    valid = torch.zeros(b, s, dtype=torch.bool, device=tokens.device)
    seq_len = mb.get("seq_len")
    if seq_len is None:
        valid[:] = True
    else:  # the last token's output reaches no loss and no other token (causal): not counted
        # rows of their own: an empty (padding) micro-batch copies another's fields, no `index`
        n = len(mb["index"]) if "index" in mb else len(seq_len)
        last = seq_len[:n].to(tokens.device)[:, None] - 1
        valid[:n] = torch.arange(s, device=tokens.device) < last
    valid = model_layout(mb, valid)  # packed: the row's real tokens, [1, T]
    routes = mb.get("routed_experts")
    routes = None if routes is None else model_layout(mb, routes)
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for layer, router in routers:
        router._megarl_valid = _token_layout(valid, router)
        replay = getattr(router, "router_replay", None)
        if replay is None:
            continue
        replay.clear_indices()
        if routes is None:
            replay.clear_router_replay_action()
            continue
        idx = _distinct(_token_layout(routes[:, :, layer, :], router).long())
        replay.set_target_indices(idx)
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def check_micro_batches(chunks, micro_batches: list[dict]) -> None:
    """Before a schedule runs (every pipeline stage, before any communication, so a bad batch
    fails everywhere instead of leaving a stage waiting): routes in the batch must fit the
    model, and a model that must replay them must be able to."""
    routes = next((mb["routed_experts"] for mb in micro_batches if "routed_experts" in mb), None)
    if routes is None:
        return
    for chunk in chunks:
        routers = _routers(chunk)
        if not routers:
            continue
        replaying = any(getattr(r, "router_replay", None) is not None for _, r in routers)
        if not replaying and _role(chunk) in ("actor", "reference"):
            raise RoutingReplayError(
                "the batch carries routed experts (rollout.engine.routing_replay) but the "
                f"{_role(chunk)} was built without megatron's moe_enable_routing_replay"
            )
        if replaying:
            _check_routes(routes, routers)


def _check_routes(routes: torch.Tensor, routers) -> None:
    config = routers[0][1].config
    layers, k = routes.shape[2], routes.shape[3]
    if layers != config.num_layers or k != config.moe_router_topk:
        raise RoutingReplayError(
            f"rollout routes have {layers} layers x top-{k} per token, the trainer's model has "
            f"{config.num_layers} MoE layers x top-{config.moe_router_topk} (num_hidden_layers, "
            "num_experts_per_tok of the model config); vLLM and the trainer must run the same "
            "architecture"
        )


def _role(model) -> str | None:
    return getattr(unwrap(model), "megarl_role", None)


# ----------------------------------------------------------------------------- statistics
class RouterStats:
    """Per-layer sums over the actor's forwards since the last `moe_metrics`, kept on the
    model's device (no host sync inside the forward)."""

    def __init__(self, num_layers: int, num_experts: int, device=None):
        def zeros(*shape):
            return torch.zeros(*shape, dtype=torch.float64, device=device)

        self.tokens_per_expert = zeros(num_layers, num_experts)
        self.prob_per_expert = zeros(num_layers, num_experts)
        self.tokens = zeros(num_layers)
        # replayed tokens whose experts equal the router's own top-k; [0]: no-grad forwards
        # (the old-logprob pass), [1]: training forwards
        self.agree = zeros(2, num_layers)
        self.replayed = zeros(2, num_layers)

    def reset(self) -> None:
        for t in vars(self).values():
            t.zero_()


def _install_stats(model, routers) -> None:
    inner = unwrap(model)
    if _role(model) != "actor" or getattr(inner, "megarl_router_stats", None) is not None:
        return
    config = routers[0][1].config
    stats = RouterStats(config.num_layers, config.num_moe_experts, routers[0][1].weight.device)
    inner.megarl_router_stats = stats
    for layer, router in routers:
        router.register_forward_hook(_stats_hook(stats, layer))


def _stats_hook(stats: RouterStats, layer: int):
    def hook(router, args, output) -> None:
        training = torch.is_grad_enabled()
        valid = getattr(router, "_megarl_valid", None)
        _, routing_map = output
        if valid is None or valid.numel() != routing_map.shape[0]:
            return  # a forward megarl did not prepare (no token mask): not counted
        replay = getattr(router, "router_replay", None)
        replaying = replay is not None and replay.router_replay_action is not None
        if not (training or replaying):
            return
        with torch.no_grad():
            logits = router.gating(args[0]).view(-1, routing_map.shape[1]).float()
            chosen = routing_map[valid]
            if training:
                stats.tokens_per_expert[layer] += chosen.sum(0).double()
                stats.prob_per_expert[layer] += logits.softmax(-1)[valid].sum(0).double()
                stats.tokens[layer] += valid.sum()
            if replaying:
                own = own_choice(router, logits)
                stats.agree[int(training), layer] += (own[valid] == chosen).all(-1).sum()
                stats.replayed[int(training), layer] += valid.sum()

    return hook


def own_choice(router, logits: torch.Tensor) -> torch.Tensor:
    """[tokens, experts] bool: the experts `router` would choose by itself from `logits` (its
    score function, expert bias and group limit, as megatron-core routes), not the replayed."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    c = router.config
    _, chosen = topk_routing_with_score_function(
        logits,
        c.moe_router_topk,
        use_pre_softmax=c.moe_router_pre_softmax,
        num_groups=c.moe_router_num_groups,
        group_topk=c.moe_router_group_topk,
        scaling_factor=c.moe_router_topk_scaling_factor,
        score_function=c.moe_router_score_function,
        expert_bias=router.expert_bias,
    )
    return chosen


def moe_metrics(chunks, arch) -> LocalMetrics:
    """The MoE metrics of the actor's forwards since the last call (module docstring), as
    `same` values (already global). Collective over the world for MoE models; resets."""
    import torch.distributed as dist

    out = LocalMetrics()
    if not arch.is_moe:
        return out
    stats = [s for c in chunks if (s := getattr(unwrap(c), "megarl_router_stats", None))]
    total = RouterStats(arch.num_layers, arch.num_experts)
    for s in stats:
        for name, t in vars(total).items():
            t += getattr(s, name).cpu()
        s.reset()
    flat = torch.cat([t.flatten() for t in vars(total).values()])
    dist.all_reduce(flat)
    offset = 0
    for t in vars(total).values():
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    at = 0 if total.replayed[0].sum() > 0 else 1  # the sampler's weights (module docstring)
    if total.replayed[at].sum() > 0:
        agree = total.agree[at].sum() / total.replayed[at].sum()
        out.add_same("moe/replay_agreement", float(agree))
    seen = total.tokens > 0
    if not seen.any():  # no training forward (e.g. PPO's critic warm-up)
        return out
    counts, probs = total.tokens_per_expert[seen], total.prob_per_expert[seen]
    tokens = total.tokens[seen]
    balance = counts.max(1).values / counts.mean(1).clamp_min(1e-12)
    aux = arch.num_experts * (probs * counts).sum(1) / (tokens * tokens * arch.moe_topk)
    out.add_same("moe/load_balance_max", float(balance.max()))
    out.add_same("moe/load_balance_mean", float(balance.mean()))
    out.add_same("moe/aux_loss", float(aux.mean()))
    return out
