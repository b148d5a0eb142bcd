"""vLLM-side layout facts: where each Hugging Face tensor lands inside vLLM's parameters.

vLLM fuses and shards HF tensors in its own way (per vLLM tensor-parallel rank r of T):

- `QKVParallelLinear` (`qkv_proj` <- q_proj, k_proj, v_proj): local rows `[q_r; k_r; v_r]`, where
  q_r are the query heads of rank r and k_r / v_r the KV heads of rank r // kv_replicas (KV heads
  are replicated when T > kv_heads). Biases the same way.
- `MergedColumnParallelLinear` (`gate_up_proj` <- gate_proj, up_proj): local rows `[gate_r; up_r]`.
- `ColumnParallelLinear` rows, `RowParallelLinear` columns (`o_proj`, `down_proj`): a contiguous
  1/T slice; `ReplicatedLinear` and norms: whole.
- `VocabParallelEmbedding` / `ParallelLMHead`: rows `[org_start, org_end)` of the real vocabulary
  land at the top of the local shard; the remaining rows are padding (to a multiple of 64) that
  vLLM never samples, because logits are cut to the real vocabulary before sampling.
- MoE: the router (`GateLinear`) is a replicated linear; the fused experts (`RoutedExperts`
  w13 / w2, one slot per local expert) follow `megarl.rollout.engine.moe_layout`.
- One value per head (gpt-oss's attention sinks, `OAIAttention`): the rank's heads, whole.
  Module paths that differ from the HF names (gpt-oss: `.attn.`, `.embedding.`) are mapped
  back (`HF_NAMES`).

A `Piece` (`megarl.rollout.engine.pieces`) says which slice of an HF tensor fills which slice of a
vLLM parameter.
`pieces_for_module` is the pure rule (testable without vLLM); `describe_model` runs inside the
vLLM worker and applies it to the live modules, refusing any module it does not know (a clear
plan-time error, never a silent partial update).
"""

from __future__ import annotations

import dataclasses

import torch

from megarl.rollout.engine import moe_layout
from megarl.rollout.engine.pieces import Piece, PlanError, VllmDescription, VllmParam


# ----------------------------------------------------------------------------- the pure rules
def _hf_names(module_name: str, leaf: str, packed: list[str] | None) -> list[str]:
    parent, _, last = module_name.rpartition(".")
    prefix = parent + "." if parent else ""
    if packed is None:
        return [f"{prefix}{last}.{leaf}"]
    return [f"{prefix}{p}.{leaf}" for p in packed]


def pieces_for_module(
    kind: str,
    module_name: str,
    leaf: str,
    attrs: dict,
    packed: list[str] | None,
    param_module: str | None = None,
) -> list[Piece]:
    """The pieces that fill parameter `module_name.leaf` of a module of `kind`.

    `attrs` are plain numbers read from the vLLM module (names below), so this function is the
    whole of megarl's knowledge of vLLM's layouts and can be tested without vLLM:
    - qkv: num_heads, num_kv_heads (local), head_size, kv_replicas, tp_rank, hidden (input size)
    - merged: output_sizes (global, one per packed tensor), tp_rank, tp_size, hidden
    - column: output_size (global), tp_rank, tp_size, hidden; row: input_size (global), tp_rank,
      tp_size, output_size; replicated: output_size, input_size
    - vocab: org_start, org_end, org_vocab, hidden; full: shape (the parameter's shape)
    - experts: see `megarl.rollout.engine.moe_layout.expert_pieces`
    `param_module`: where the parameter really lives when it is not `module_name` (a linear that
    vLLM's LoRA wrapped: `...qkv_proj.base_layer`).
    """
    if kind == "experts":
        return moe_layout.expert_pieces(module_name, leaf, attrs)
    name = f"{param_module or module_name}.{leaf}"
    if leaf == EXPERT_BIAS:  # the router's expert bias: whole on every rank
        return [Piece(name, f"{module_name}.{leaf}", 0, 0, attrs["shape"][0], 0, attrs["shape"])]
    hf = _hf_names(module_name, leaf, packed if kind in ("qkv", "merged") else None)
    is_bias = leaf == "bias"

    def rows(hf_name, hf_rows, start, length, offset, cols):
        shape = (hf_rows,) if is_bias else (hf_rows, cols)
        return Piece(name, hf_name, 0, start, length, offset, shape)

    if kind == "qkv":
        if packed is None or len(packed) != 3:
            raise PlanError(
                f"vLLM parameter {name!r}: QKV module needs 3 packed HF names, got {packed}"
            )
        hs, nh, nkv = attrs["head_size"], attrs["num_heads"], attrs["num_kv_heads"]
        r, kv_r = attrs["tp_rank"], attrs["tp_rank"] // attrs["kv_replicas"]
        q_total, kv_total = nh * hs * attrs["tp_size"], attrs["total_kv_heads"] * hs
        h = attrs["hidden"]
        return [
            rows(hf[0], q_total, r * nh * hs, nh * hs, 0, h),
            rows(hf[1], kv_total, kv_r * nkv * hs, nkv * hs, nh * hs, h),
            rows(hf[2], kv_total, kv_r * nkv * hs, nkv * hs, (nh + nkv) * hs, h),
        ]
    if kind == "merged":
        sizes, t, r = attrs["output_sizes"], attrs["tp_size"], attrs["tp_rank"]
        if packed is None or len(packed) != len(sizes):
            raise PlanError(
                f"vLLM parameter {name!r}: {len(sizes)} merged outputs but packed HF names {packed}"
            )
        out, offset = [], 0
        for hf_name, size in zip(hf, sizes, strict=True):
            local = size // t
            out.append(rows(hf_name, size, r * local, local, offset, attrs["hidden"]))
            offset += local
        return out
    if kind == "column":
        local = attrs["output_size"] // attrs["tp_size"]
        return [
            rows(hf[0], attrs["output_size"], attrs["tp_rank"] * local, local, 0, attrs["hidden"])
        ]
    if kind == "row":
        if is_bias:  # row-parallel biases are added after the reduce: whole on every rank
            n = attrs["output_size"]
            return [Piece(name, hf[0], 0, 0, n, 0, (n,))]
        local = attrs["input_size"] // attrs["tp_size"]
        shape = (attrs["output_size"], attrs["input_size"])
        return [Piece(name, hf[0], 1, attrs["tp_rank"] * local, local, 0, shape)]
    if kind == "replicated":
        n = attrs["output_size"]
        return [rows(hf[0], n, 0, n, 0, attrs["input_size"])]
    if kind == "vocab":
        start, end = attrs["org_start"], attrs["org_end"]
        return [rows(hf[0], attrs["org_vocab"], start, end - start, 0, attrs["hidden"])]
    if kind == "full":
        shape = tuple(attrs["shape"])
        return [Piece(name, hf[0], 0, 0, shape[0], 0, shape)]
    if kind == "heads":  # one value per attention head (gpt-oss's sinks), split over TP
        n = attrs["shape"][0]
        return [Piece(name, hf[0], 0, attrs["tp_rank"] * n, n, 0, (n * attrs["tp_size"],))]
    raise PlanError(f"vLLM parameter {name!r}: unknown module kind {kind!r}")


# ----------------------------------------------------------------------------- inside the worker
_NORM_SUFFIXES = ("RMSNorm", "LayerNorm")
FUSED_A_PROJ = ("DeepSeekV2FusedQkvAProjLinear",)
MLA_MODULES = ("MLAAttention",)
"""vLLM 0.32's multi-latent attention: its W_UK_T / W_UV are kv_b_proj split and absorbed by
`process_weights_after_loading` (mla_attention.py:1220-1327), never loaded."""
EXPERT_BIAS = "e_score_correction_bias"
HEAD_MODULES = ("OAIAttention",)
"""Modules whose own parameters hold one value per attention head: gpt-oss's attention (its
`sinks`, split over TP by heads, gpt_oss.py:128-131)."""
HF_NAMES = {"GptOssForCausalLM": ((".attn.", ".self_attn."), (".embedding.", ".embed_tokens."))}
"""Per vLLM model class, how its module paths differ from the HF names (the inverse of its
`hf_to_vllm_mapper`, gpt_oss.py:1420-1444, for the parameters pieces name)."""


def _module_kind(module) -> tuple[str, dict]:
    """Classify a live vLLM module and read the attributes `pieces_for_module` needs."""
    from vllm.model_executor.layers import linear as L
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    cls = type(module)
    if isinstance(module, L.QKVParallelLinear) and cls.__name__ == "QKVParallelLinear":
        return "qkv", dict(
            head_size=module.head_size,
            num_heads=module.num_heads,
            num_kv_heads=module.num_kv_heads,
            total_kv_heads=module.total_num_kv_heads,
            kv_replicas=module.num_kv_head_replicas,
            tp_rank=module.tp_rank,
            tp_size=module.tp_size,
            hidden=module.input_size,
        )
    if isinstance(module, L.MergedColumnParallelLinear) and (
        cls.__name__ == "MergedColumnParallelLinear"
    ):
        return "merged", dict(
            output_sizes=list(module.output_sizes),
            tp_rank=module.tp_rank,
            tp_size=module.tp_size,
            hidden=module.input_size,
        )
    if cls is L.ColumnParallelLinear:
        return "column", dict(
            output_size=module.output_size,
            tp_rank=module.tp_rank,
            tp_size=module.tp_size,
            hidden=module.input_size,
        )
    if cls is L.RowParallelLinear:
        return "row", dict(
            input_size=module.input_size,
            tp_rank=module.tp_rank,
            tp_size=module.tp_size,
            output_size=module.output_size,
        )
    if isinstance(module, L.MergedColumnParallelLinear) and cls.__name__ in FUSED_A_PROJ:
        # DeepSeek's q_a_proj + kv_a_proj_with_mqa stacked, replicated over TP (disable_tp)
        return "merged", dict(
            output_sizes=list(module.output_sizes), tp_rank=0, tp_size=1, hidden=module.input_size
        )
    if isinstance(module, L.ReplicatedLinear) and cls.__name__ in moe_layout.GATE_MODULES:
        # GateLinear (the MoE router) only picks faster GEMMs for the same replicated weight;
        # a plain ReplicatedLinear (MLA's kv_a_proj_with_mqa without a q LoRA) is the same
        return "replicated", dict(output_size=module.output_size, input_size=module.input_size)
    if cls.__name__ in MLA_MODULES:
        return "derived", {}
    if cls.__name__ in moe_layout.EXPERTS_MODULES:
        return "experts", {}
    if cls.__name__ in HEAD_MODULES:
        from vllm.distributed import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        return "heads", dict(
            tp_rank=get_tensor_model_parallel_rank(),
            tp_size=get_tensor_model_parallel_world_size(),
        )
    if isinstance(module, VocabParallelEmbedding):
        idx = module.shard_indices
        if idx.num_added_elements:
            raise PlanError(
                f"{cls.__name__} with added vocabulary (LoRA extra tokens) is not "
                "supported by weight sync"
            )
        return "vocab", dict(
            org_start=idx.org_vocab_start_index,
            org_end=idx.org_vocab_end_index,
            org_vocab=module.org_vocab_size,
            hidden=module.embedding_dim,
        )
    if cls.__name__.endswith(_NORM_SUFFIXES):
        return "full", {}
    return "unknown", {}


def _logical_shape(module, kind: str, leaf: str, param: torch.Tensor) -> tuple[int, ...]:
    """The dense local shape, also for repacked weights (whose storage is an empty tensor)."""
    if leaf == EXPERT_BIAS:
        return tuple(param.shape)
    if kind in ("qkv", "merged", "column"):
        out = module.output_size_per_partition
        return (out,) if leaf == "bias" else (out, module.input_size_per_partition)
    if kind == "row":
        out = module.output_size_per_partition
        return (out,) if leaf == "bias" else (out, module.input_size_per_partition)
    if kind == "replicated":
        return (module.output_size,) if leaf == "bias" else (module.output_size, module.input_size)
    return tuple(param.shape)


def describe_model(model, *, tp_rank: int, tp_size: int) -> VllmDescription:
    """Describe a live vLLM model (run inside the worker via `collective_rpc`)."""
    import vllm

    packed_map = dict(getattr(model, "packed_modules_mapping", {}) or {})
    params, pieces, seen, derived = [], [], set(), []
    for mod_name, module in model.named_modules():
        direct = [(leaf, p) for leaf, p in module.named_parameters(recurse=False)]
        if not direct:
            continue
        kind, attrs = _module_kind(module)
        if kind == "experts":
            attrs = moe_layout.expert_attrs(module, mod_name)
        quant = getattr(module, "quant_method", None)
        if quant is not None and not type(quant).__name__.startswith("Unquantized"):
            raise PlanError(
                f"vLLM module {mod_name!r} uses quantization {type(quant).__name__}; megarl's "
                "weight sync writes unquantized weights only"
            )
        for leaf, p in direct:
            name = f"{mod_name}.{leaf}"
            if id(p) in seen:  # a tied parameter registered under a second module
                continue
            seen.add(id(p))
            if kind == "derived":
                derived.append(name)
                continue
            if kind == "unknown":
                raise PlanError(
                    f"vLLM parameter {name!r} belongs to module class {type(module).__name__}, "
                    f"which megarl's weight sync does not know how to fill (vLLM "
                    f"{vllm.__version__}, model {type(model).__name__}); supported: QKV/merged/"
                    "column/row/replicated linears, vocab embeddings, norms, fused MoE experts"
                )
            shape = _logical_shape(module, kind, leaf, p)
            attrs_p = dict(attrs, shape=shape)
            # vLLM's LoRA wraps each linear: its weight moves to `<linear>.base_layer`
            logical = mod_name.replace(".base_layer", "")
            last = logical.rpartition(".")[2]
            packed = packed_map.get(last) if kind in ("qkv", "merged") else None
            if kind in ("qkv", "merged") and packed is None:
                raise PlanError(
                    f"vLLM parameter {name!r}: the model declares no "
                    f"packed_modules_mapping for {last!r}"
                )
            repacked = p.numel() == 0 and 0 not in shape
            params.append(
                VllmParam(
                    name, shape, type(module).__name__, repacked=attrs.get("repacked", repacked)
                )
            )
            pieces.extend(
                pieces_for_module(
                    kind, logical, leaf, attrs_p, packed, mod_name if logical != mod_name else None
                )
            )
    dtype = next(iter(model.parameters())).dtype
    for vllm_part, hf_part in HF_NAMES.get(type(model).__name__, ()):
        pieces = [dataclasses.replace(pc, hf=pc.hf.replace(vllm_part, hf_part)) for pc in pieces]
    return VllmDescription(
        params=tuple(params),
        pieces=tuple(pieces),
        tp_rank=tp_rank,
        tp_size=tp_size,
        dtype=str(dtype).removeprefix("torch."),
        model_class=type(model).__name__,
        vllm_version=vllm.__version__,
        derived=tuple(derived),
    )


def check_coverage(
    desc: VllmDescription, hf_shapes: dict[str, tuple[int, ...]], *, tied: bool
) -> None:
    """Every vLLM parameter fully covered by pieces of HF tensors megarl produces, and every HF
    tensor megarl produces consumed; otherwise a `PlanError` naming the parameters."""
    problems = []
    by_param: dict[str, list[Piece]] = {}
    for pc in desc.pieces:
        by_param.setdefault(pc.param, []).append(pc)
        want = hf_shapes.get(pc.hf)
        if want is None:
            problems.append(
                f"vLLM parameter {pc.param!r} needs HF tensor {pc.hf!r}, which "
                "megarl's HF mapping does not produce"
            )
        elif tuple(want) != tuple(pc.stored_shape):
            problems.append(
                f"HF tensor {pc.hf!r}: megarl's mapping gives shape {tuple(want)}, "
                f"vLLM expects {tuple(pc.stored_shape)}"
            )
    for p in desc.params:
        ps = by_param.get(p.name, [])
        if not ps:
            problems.append(f"vLLM parameter {p.name!r} ({p.module}) is filled by no HF tensor")
            continue
        # pieces with leading indices (expert slots) each fill one sub-tensor param[index]
        by_index: dict[tuple[int, ...], list[Piece]] = {}
        for pc in ps:
            by_index.setdefault(pc.index, []).append(pc)
        depth = {len(i) for i in by_index}
        n_sub = 1
        for d in p.shape[: max(depth)]:
            n_sub *= d
        if len(depth) > 1 or len(by_index) != n_sub:
            problems.append(
                f"vLLM parameter {p.name!r} shape {p.shape}: pieces fill {len(by_index)} of "
                f"its {n_sub} sub-tensors along its leading dims"
            )
            continue
        for index, sub in by_index.items():
            dims = {pc.dim for pc in sub}
            covered = sum(pc.length for pc in sub)
            extent = p.shape[len(index) + sub[0].dim] if len(dims) == 1 else -1
            # vocab shards keep padding rows at the end; everything else is covered exactly
            if covered > extent or (covered < extent and p.module not in _VOCAB_MODULES):
                at = f"[{', '.join(map(str, index))}]" if index else ""
                problems.append(
                    f"vLLM parameter {p.name!r}{at} shape {p.shape}: pieces cover {covered} "
                    f"of {extent} along dim {sorted(dims)}"
                )
    used = {pc.hf for pc in desc.pieces}
    if desc.tp_size == 1:
        unused = sorted(set(hf_shapes) - used)
        if unused:
            problems.append(
                f"HF tensors megarl produces but vLLM ({desc.model_class}) has no "
                f"parameter for: {unused[:8]}{' ...' if len(unused) > 8 else ''}"
                f" (tie_word_embeddings={tied})"
            )
    if problems:
        raise PlanError(
            f"weight sync cannot map this model into vLLM {desc.vllm_version} "
            f"({desc.model_class}):\n  " + "\n  ".join(problems[:20])
        )


_VOCAB_MODULES = ("VocabParallelEmbedding", "ParallelLMHead")


# ----------------------------------------------------------------------------- reload recovery
def abort_layerwise_reload(model) -> int:
    """Put back the previous kernel tensors of every layer a failed `reload_weights` left
    half-loaded (on the meta device, with wrapped loaders). Returns how many layers it restored.

    Afterwards each layer holds either its new or its previous weights, consistently; the model
    as a whole is a mix, which the engine records (see `RolloutEngine.weights.state`)."""
    from vllm.model_executor.model_loader.reload import layerwise as lw

    restored = 0
    for layer in model.modules():
        info = lw.LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load():
            continue
        if info.kernel_tensors is not None:
            for t in lw.get_layer_tensors(layer).values():
                t.weight_loader = lw._get_original_loader(t)
            lw._place_kernel_tensors(layer, info)
            restored += 1
        info.reset()
    lw.LOADING_LAYERS.clear()
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    return restored
