"""Megatron shards <-> full ("canonical") megatron-named tensors.

The canonical form of a model is a dict `{name: tensor}` with megatron-core's parameter names
(`decoder.layers.{i}.mlp.linear_fc1.weight`, ...) where `i` is the *global* layer index, expert
indices are global, and every tensor is whole (TP shards concatenated, vocab rows cut to the real
`vocab_size`: megatron's padding to a multiple of divisible_by x TP depends on TP). This form does
not depend on TP / PP / VPP / EP, so it is what layout-invariance tests compare and what the HF
mapping (`megarl.convert.mapping`) consumes.

Two megatron layouts need care when concatenating TP shards: a gated `linear_fc1` shard is
`[gate_r; up_r]`, so the full tensor is `[gate_0..gate_n; up_0..up_n]`, not the concatenation, and
the Gated DeltaNet's in_proj / conv1d shards hold a slice of each of their components (`tp_parts`).
QKV shards hold whole query groups, so plain concatenation is right.

`gather_full_state` / `load_full_state` are the *naive* path (object collectives, the full model on
every rank): they serve tests and the reference weight sync only. Production paths move one tensor
at a time: `megarl.convert.sharded` (initial weights), `megarl.convert.stream` (HF export, the
separate engines' weights), `megarl.rollout.sync.colocated` (the per-step sync).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
import torch.distributed as dist

from megarl.models.builder import unwrap
from megarl.models.lora import is_lora

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


# Transformer-Engine's spec fuses the pre-attention / pre-MLP norms into the next linear layer;
# canonical names are the local spec's
_TE_FUSED_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "self_attention.in_proj.layer_norm_weight": "input_layernorm.weight",  # Gated DeltaNet
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
}


def _canonical_norm_name(local_name: str) -> str:
    for te, local in _TE_FUSED_NORMS.items():
        if local_name.endswith(te):
            return local_name[: -len(te)] + local
    return local_name


def _is_gated_fc1(name: str) -> bool:
    return name.endswith("linear_fc1.weight") or name.endswith("linear_fc1.bias")


def local_params(chunks: list[torch.nn.Module]) -> Iterator[tuple[str, str, torch.nn.Parameter]]:
    """Yield `(canonical_name, local_name, param)` for every parameter this rank holds.

    Tied output weights on the last pipeline stage are skipped (the embedding is canonical)."""
    from megatron.core import parallel_state as ps

    ep_rank = ps.get_expert_model_parallel_rank()
    for chunk in chunks:
        model = unwrap(chunk)
        layer_numbers = {}
        if hasattr(model, "decoder"):
            for i, layer in enumerate(model.decoder.layers):
                layer_numbers[i] = layer.layer_number - 1
        for local_name, p in _tensors(model):
            if is_lora(p):  # adapters are not part of the model's canonical (HF) tensors
                continue
            if local_name == "output_layer.weight" and getattr(
                model, "share_embeddings_and_output_weights", False
            ):
                continue
            name = _canonical_norm_name(local_name)
            m = _LAYER.match(name)
            if m:
                name = f"decoder.layers.{layer_numbers[int(m.group(1))]}." + name[m.end() :]
            e = _EXPERT.search(name)
            if e:
                mlp = model.decoder.layers[int(m.group(1))].mlp
                n_local = mlp.experts.num_local_experts
                g = ep_rank * n_local + int(e.group(1))
                name = name[: e.start()] + f".local_experts.{g}." + name[e.end() :]
            yield name, local_name, p


def _tensors(model) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's parameters, then the routers' expert biases: buffers the optimizer never
    updates that are part of the model all the same (HF `e_score_correction_bias`)."""
    yield from model.named_parameters()
    for name, b in model.named_buffers():
        if name.endswith(EXPERT_BIAS):
            yield name, b


EXPERT_BIAS = ".mlp.router.expert_bias"


def is_expert(p) -> bool:
    return getattr(p, "allreduce", True) is False  # megatron marks expert params allreduce=False


def _tp_group_for(p):
    from megatron.core import parallel_state as ps

    if is_expert(p):
        return ps.get_expert_tensor_parallel_group()
    return ps.get_tensor_model_parallel_group()


def merge_tp(name: str, shards: list[torch.Tensor], partition_dim: int, parts=None) -> torch.Tensor:
    """Concatenate TP shards of one parameter into the full tensor. A dim-0 shard made of
    components each split over TP (`tp_parts`) holds each one's slice in turn."""
    parts = tp_parts(name, parts) if partition_dim == 0 else None
    if parts is None:
        return torch.cat(shards, dim=partition_dim)
    tp = len(shards)
    local = [n // tp for n in (parts or [shards[0].shape[0] * tp // 2] * 2)]
    pieces = [s.split(local, 0) for s in shards]
    return torch.cat([pieces[r][c] for c in range(len(local)) for r in range(tp)], dim=0)


def split_tp(
    name: str, full: torch.Tensor, partition_dim: int, tp: int, rank: int, parts=None
) -> torch.Tensor:
    """This TP rank's shard of a full tensor (inverse of `merge_tp`)."""
    parts = tp_parts(name, parts) if partition_dim == 0 else None
    if parts is None:
        return full.chunk(tp, dim=partition_dim)[rank]
    glob = list(parts or [full.shape[0] // 2] * 2)
    return torch.cat([c.chunk(tp, 0)[rank] for c in full.split(glob, 0)], dim=0)


def tp_parts(name: str, parts=None) -> tuple[int, ...] | None:
    """The components, in global rows, of a dim-0 TP-split tensor whose shards hold a slice of
    each: `parts` (a parameter's `tp_parts`: the Gated DeltaNet's in_proj [q; k; v; z; b; a] and
    conv1d [q; k; v], `megarl.models.marks.gdn_tp_layout`), () for a gated `linear_fc1`
    ([gate; up], halves), or None: a plain split."""
    if parts:
        return tuple(parts)
    return () if _is_gated_fc1(name) else None


def _is_tp_sharded(p) -> bool:
    return bool(getattr(p, "tensor_model_parallel", False)) and getattr(p, "partition_dim", -1) >= 0


def tp_shard(p) -> tuple[int, int, int]:
    """`(partition_dim, tp_size, tp_rank)` of a parameter in its TP group (the expert-TP group for
    experts); `(-1, 1, 0)` for a tensor every TP rank holds whole."""
    if not _is_tp_sharded(p):
        return -1, 1, 0
    group = _tp_group_for(p)
    return p.partition_dim, dist.get_world_size(group), dist.get_rank(group)


def is_contributor(p) -> bool:
    """Whether this rank's copy of `p` is the one whole-model readers take: DP replicas (the
    expert-DP group for experts) hold equal copies, so only DP rank 0's counts; of a tensor that
    is not TP-sharded, only TP rank 0's."""
    return replica(p) == 0


def replica(p) -> int | None:
    """Which of `p`'s equal copies this rank holds a part of: its DP rank (with context
    parallel; the expert-DP rank for experts), or None on a TP rank other than 0 for a tensor
    that is not TP-sharded (TP rank 0's copy stands for the TP group's)."""
    from megatron.core import parallel_state as ps

    if is_expert(p):
        dp_rank = ps.get_expert_data_parallel_rank()
        tp_rank = ps.get_expert_tensor_parallel_rank()
    else:
        dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
        tp_rank = ps.get_tensor_model_parallel_rank()
    return dp_rank if _is_tp_sharded(p) or tp_rank == 0 else None


def gather_full_state(
    chunks: list[torch.nn.Module],
    *,
    grads: bool = False,
    to_all: bool = True,
    views: bool = False,
) -> dict[str, torch.Tensor]:
    """The canonical full state (or full grads, from DDP `main_grad`) of a distributed model.

    Collective over the whole world. With `to_all=False` only global rank 0 gets the dict (others
    get {}). Grads must already be reduced across DP (non-distributed-optimizer DDP). `views`:
    on a world of one, the unsharded tensors are views of the live parameters, not copies (for
    a caller done with them before the next update)."""
    from megatron.core import parallel_state as ps

    # every (PP, EP) coordinate holds different names; DP/TP replicas hold equal ones, so one
    # owner per name contributes: expert params are replicated over the expert-DP group instead
    dense_owner = ps.get_data_parallel_rank(with_context_parallel=True) == 0 and (
        ps.get_tensor_model_parallel_rank() == 0
    )
    expert_owner = ps.get_expert_data_parallel_rank() == 0 and (
        ps.get_expert_tensor_parallel_rank() == 0
    )
    alone = dist.get_world_size() == 1  # no collective below makes the copies
    local: dict[str, torch.Tensor] = {}
    for name, _, p in local_params(chunks):
        t = p.data
        if grads:
            t = getattr(p, "main_grad", None)
            t = p.grad if t is None else t
            if t is None:
                t = torch.zeros_like(p.data)
        t = t.detach()
        group = _tp_group_for(p) if _is_tp_sharded(p) else None
        if group is not None and dist.get_world_size(group) > 1:  # TP 1: the shard is whole
            shards = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
            dist.all_gather(shards, t.contiguous(), group=group)
            t = merge_tp(name, shards, p.partition_dim, getattr(p, "tp_parts", None))
        if name in VOCAB_PARAMS and _is_tp_sharded(p):  # (not the critic's value head)
            t = t[: _vocab_size(chunks)]
        if expert_owner if is_expert(p) else dense_owner:
            t = t.float().cpu() if grads else t.cpu()
            is_view = t.untyped_storage().nbytes() > t.numel() * t.element_size()
            if (not views) if alone else is_view:
                # (a view into megatron's flat parameter / gradient buffer: pickled by the object
                # collectives below, it would carry the whole buffer, once per tensor)
                t = t.clone()
            local[name] = t
    if alone:
        return local
    parts: list[dict | None] = [None] * dist.get_world_size()
    if to_all:
        dist.all_gather_object(parts, local)
    else:
        dist.gather_object(local, parts if dist.get_rank() == 0 else None, dst=0)
        if dist.get_rank() != 0:
            return {}
    full: dict[str, torch.Tensor] = {}
    for part in parts:
        full.update(part or {})
    return full


@torch.no_grad()
def load_full_state(chunks: list[torch.nn.Module], full: dict[str, torch.Tensor]) -> None:
    """Copy a canonical full state into this rank's shards (every name must be present)."""
    from megatron.core import parallel_state as ps

    for name, local_name, p in local_params(chunks):
        if name not in full:
            raise KeyError(f"canonical state has no tensor for {name!r} (local {local_name!r})")
        t = full[name]
        if name in VOCAB_PARAMS and _is_tp_sharded(p):
            tp = ps.get_tensor_model_parallel_world_size()
            t = pad_rows(t, p.shape[0] * tp)
        if _is_tp_sharded(p):
            group = _tp_group_for(p)
            size, rank = dist.get_world_size(group), dist.get_rank(group)
            t = split_tp(name, t, p.partition_dim, size, rank, getattr(p, "tp_parts", None))
        if t.shape != p.shape:
            raise ValueError(f"{name}: canonical shard shape {tuple(t.shape)} != {tuple(p.shape)}")
        p.data.copy_(t)
    _sync_tied_output(chunks, full)


VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")
"""The parameters with a row per vocabulary entry (padded to megatron's vocab size)."""


def _vocab_size(chunks) -> int:
    return unwrap(chunks[0]).megarl_vocab_size


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """`t` cut or padded to `rows` rows; the zero rows are megatron's vocab padding (never
    sampled: logits are cut to vocab_size)."""
    if t.shape[0] >= rows:
        return t[:rows]
    pad = torch.zeros(rows - t.shape[0], *t.shape[1:], dtype=t.dtype)
    return torch.cat([t, pad])


def _sync_tied_output(chunks, full) -> None:
    """With tied embeddings and PP > 1 the last stage holds its own copy of the embedding."""
    from megatron.core import parallel_state as ps

    for chunk in chunks:
        model = unwrap(chunk)
        if getattr(model, "share_embeddings_and_output_weights", False) and model.post_process:
            w = model.shared_embedding_or_output_weight()
            tp, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
            src = pad_rows(full["embedding.word_embeddings.weight"], w.shape[0] * tp)
            w.data.copy_(src.chunk(tp, 0)[r].to(w.dtype))
