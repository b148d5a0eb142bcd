"""LoRA adapters on megatron-core's parallel linears (`model.lora`).

An adapted linear computes `W x + scale * B (A x)` with `scale = alpha / rank`, the base `W`
frozen and only `A` [rank, in] and `B` [out, rank] trained. Adapters are named as Hugging Face
and PEFT name the linears (`q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`, `up_proj`,
`down_proj`), one pair per HF linear, so a PEFT adapter maps onto them one to one; megatron's
fused `linear_qkv` and `linear_fc1` carry the pairs of their parts, whose outputs are laid out as
the fused weight's rows are (`qkv_to_megatron`; fc1: this rank's gate rows, then its up rows).

Sharding follows the base linear (so nothing but rank-sized activations crosses ranks):
- column-parallel base (q / k / v / gate / up; output split over TP): `A` is whole on every TP
  rank, `B` split like the output rows. `A x` is computed on this rank's input and made whole
  for `B`: under sequence parallelism its sequence shards are all-gathered (backward: reduce-
  scatter), otherwise its gradient is all-reduced over TP (`copy_to_tensor_model_parallel_region`),
  as the base does for its own input.
- row-parallel base (o / down; input split over TP): `A` split like the input columns, `B` whole.
  `A x` is a partial sum on each TP rank: all-reduced, or reduce-scattered over the sequence under
  sequence parallelism, where the base output is sequence-sharded too.
A whole tensor that sees only a sequence shard (sequence parallelism) is marked
`sequence_parallel`, so megatron's grad finalisation sums its gradient over TP, as for norms.

Adapters live in one container per model chunk, `GPTModel.lora` (`LoraAdapters`), keyed by the
global layer number, and reach the linears through forward hooks, so the base's parameter names
(checkpoints, conversion, the weight sync) are unchanged; whole-model paths skip them
(`is_lora`). Their checkpoint keys are global (layer number, TP offset): a checkpoint resumes at
any layout. `A` is drawn as PEFT draws it (kaiming-uniform, a = sqrt(5)) from a generator seeded
by the run's seed and the adapter's name, whole, then sliced: the same adapters at every layout.
`B` starts at zero, so step 0 is the base model. `disabled(chunks)` switches every adapter off:
the reference policy of a LoRA run is the base (no second model).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from dataclasses import dataclass

import torch

from megarl.errors import ConfigError
from megarl.models.fused import qkv_to_megatron
from megarl.models.hf_config import ModelArch

HF_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linears an adapter can sit on, by their HF name; `all-linear` = all of them."""
_LINEAR = {  # HF name -> (megatron module under a transformer layer, how it is split over TP)
    "q_proj": ("self_attention.linear_qkv", "column"),
    "k_proj": ("self_attention.linear_qkv", "column"),
    "v_proj": ("self_attention.linear_qkv", "column"),
    "o_proj": ("self_attention.linear_proj", "row"),
    "gate_proj": ("mlp.linear_fc1", "column"),
    "up_proj": ("mlp.linear_fc1", "column"),
    "down_proj": ("mlp.linear_fc2", "row"),
}
_HF_MODULE = {"o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
LORA_ATTR = "megarl_lora"
"""Set on every adapter parameter: whole-model paths (HF loads, exports, the weight sync) skip
the parameters that carry it."""


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    rank: int = 0
    """Adapter rank r; 0 = no adapters (full fine-tuning)."""
    alpha: float = 32.0
    """The adapter's output is scaled by alpha / rank (PEFT's lora_alpha)."""
    dropout: float = 0.0
    """Dropout on the adapter's input (PEFT's lora_dropout); needs parallel.tensor_parallel 1."""
    targets: tuple[str, ...] = ("all-linear",)
    """HF names of the adapted linears: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
    down_proj, or all-linear."""
    merge: bool = False
    """false: the rollout engine serves the adapters with vLLM's LoRA layers and each sync sends
    only them (the base once); true: each sync sends the merged weights W + scale B A (computed
    shard by shard), for engines or modules that cannot take adapters."""
    init_from: str | None = None
    """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) to start the
    adapters from; its rank, alpha and targets must match these."""

    def __post_init__(self):
        if self.rank < 0:
            raise ConfigError(f"model.lora.rank={self.rank}; accepted: 0 (off) or a rank >= 1")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.lora.dropout={self.dropout}; accepted: 0 <= dropout < 1")
        if self.alpha <= 0:
            raise ConfigError(f"model.lora.alpha={self.alpha}; accepted: > 0")
        bad = [t for t in self.targets if t not in (*HF_TARGETS, "all-linear")]
        if bad or not self.targets:
            raise ConfigError(
                f"model.lora.targets={list(self.targets)}: {bad or 'empty'}; accepted: a list "
                f"of {', '.join(HF_TARGETS)}, or [all-linear]"
            )

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def modules(self) -> tuple[str, ...]:
        """The adapted linears' HF names, in `HF_TARGETS` order."""
        if "all-linear" in self.targets:
            return HF_TARGETS
        return tuple(t for t in HF_TARGETS if t in self.targets)


def is_lora(p: torch.Tensor) -> bool:
    return getattr(p, LORA_ATTR, False)


def te_refusal(cfg: LoraConfig, precision) -> str | None:
    """Why a GPU run refuses `cfg`'s adapters, or None: on GPU the run builds Transformer-Engine
    layers unless precision.transformer_engine is false (`megarl.models.builder.resolve_use_te`;
    FP8 needs them), and TE normalises the input of linear_qkv / linear_fc1 inside the layer,
    where the adapters read it unnormalised."""
    if not cfg.enabled or precision.transformer_engine is False:
        return None
    if precision.fp8:
        why, fix = f"precision.fp8={precision.fp8} needs them", "precision.fp8: null and "
    elif precision.transformer_engine:
        why, fix = "precision.transformer_engine=true", ""
    else:
        why, fix = "precision.transformer_engine=null: the GPU default", ""
    return (
        f"model.lora.rank={cfg.rank} with Transformer-Engine layers ({why}): the adapters "
        "read the input of linear_qkv / linear_fc1, which TE normalises inside the layer; "
        f"accepted: {fix}precision.transformer_engine: false (megatron-core's local layers), "
        "or model.lora.rank: 0 (full fine-tuning)"
    )


def check_lora(cfg: LoraConfig, arch: ModelArch, *, tp: int, use_te: bool, precision=None) -> None:
    """Raise naming the key when `cfg` cannot run on `arch` at this layout (`use_te`: the layers
    this run builds, `precision` their settings)."""
    if not cfg.enabled:
        return
    if use_te:
        why = te_refusal(cfg, precision) if precision is not None else None
        raise ConfigError(
            why
            or f"model.lora.rank={cfg.rank} with Transformer-Engine layers: not available; "
            "accepted: precision.transformer_engine: false"
        )
    if arch.mla is not None:
        # the adapters know q/k/v/o and the dense MLP's linears; multi-latent attention has
        # other projections (q_a / q_b / kv_a / kv_b) and a latent layout vLLM absorbs
        raise ConfigError(
            f"model.lora.rank={cfg.rank} on a multi-latent-attention model ({arch.family}): "
            "adapters on its projections are not available; accepted: model.lora.rank: 0 "
            "(full fine-tuning)"
        )
    mlp = [t for t in cfg.modules() if _LINEAR[t][0].startswith("mlp.")]
    if arch.is_moe and mlp:
        raise ConfigError(
            f"model.lora.targets: {mlp} on a mixture-of-experts model ({arch.num_experts} "
            "experts): adapters on experts are not available; accepted: q_proj, k_proj, "
            "v_proj, o_proj"
        )
    if cfg.dropout and tp > 1:
        raise ConfigError(
            f"model.lora.dropout={cfg.dropout} with parallel.tensor_parallel={tp}: each TP rank "
            "would draw its own mask for the adapter input they share; accepted: dropout 0"
        )


def peft_key(layer: int, name: str, part: str) -> str:
    """The tensor's name in a PEFT adapter file; `part`: A or B."""
    module = _HF_MODULE.get(name, "self_attn")
    return f"base_model.model.model.layers.{layer}.{module}.{name}.lora_{part}.weight"


def _seed(seed: int, layer: int, name: str) -> int:
    digest = hashlib.sha256(f"lora/{seed}/{layer}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class LoraPair(torch.nn.Module):
    """`A` [rank, in_local] and `B` [out_local, rank] of one HF linear (module docstring)."""

    def __init__(
        self,
        in_full: int,
        out_full: int,
        cfg: LoraConfig,
        *,
        kind: str,
        sp: bool,
        tp_group,
        tp: int,
        tp_rank: int,
        seed: int,
        dtype,
    ):
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        super().__init__()
        self.kind, self.sp, self.tp_group, self.scale = kind, sp, tp_group, cfg.scale
        self.dropout = torch.nn.Dropout(cfg.dropout) if cfg.dropout else torch.nn.Identity()
        g = torch.Generator().manual_seed(seed)
        bound = 1.0 / math.sqrt(in_full)  # kaiming_uniform_(a=sqrt(5)), PEFT's init of A
        a = torch.empty(cfg.rank, in_full).uniform_(-bound, bound, generator=g)
        if kind == "row":
            a = a.chunk(tp, dim=1)[tp_rank]
        out_local = out_full // tp if kind == "column" else out_full
        self.A = torch.nn.Parameter(a.to(dtype).contiguous())
        self.B = torch.nn.Parameter(torch.zeros(out_local, cfg.rank, dtype=dtype))
        split, whole = (self.B, self.A) if kind == "column" else (self.A, self.B)
        set_tensor_model_parallel_attributes(split, True, 0 if kind == "column" else 1, 1)
        whole.sequence_parallel = sp  # sees a sequence shard: grads summed over TP
        for p in (self.A, self.B):
            setattr(p, LORA_ATTR, True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [s_local, b, in_local] -> the adapter's output [s_out, b, out_local], where s_out is
        the base output's sequence length (whole for column-parallel under SP)."""
        h = self.across_tp(torch.nn.functional.linear(self.dropout(x), self.A))
        return torch.nn.functional.linear(h, self.B) * self.scale

    def across_tp(self, h: torch.Tensor) -> torch.Tensor:
        """`A x` [s_local, b, r] made what `B` needs: whole (column-parallel), or summed over
        TP (row-parallel), as the base does with its own input and output."""
        from megatron.core import tensor_parallel as mp

        if self.kind == "column":
            return (
                mp.gather_from_sequence_parallel_region(h, group=self.tp_group)
                if self.sp
                else mp.copy_to_tensor_model_parallel_region(h, group=self.tp_group)
            )
        return (
            mp.reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group)
            if self.sp
            else mp.reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
        )

    def delta(self) -> torch.Tensor:
        """scale * B A: this rank's shard of the update to the base weight [out_local, in_local]."""
        return (self.B.detach().float() @ self.A.detach().float()) * self.scale


class LoraAdapters(torch.nn.Module):
    """One chunk's adapters: `layers[str(global layer)][hf name]` -> `LoraPair`."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleDict()
        self.on = True
        self.adapted: list[_Adapted] = []
        """Every adapted linear of the chunk (a plain list: its modules are registered above)."""

    def pairs(self):
        """(global layer, HF name, pair) of every adapter in this chunk."""
        for layer, mods in self.layers.items():
            for name, pair in mods.items():
                yield int(layer), name, pair

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """Global keys (layer number, TP offset): the same file at every layout."""
        from megatron.core.utils import (
            make_sharded_tensor_for_checkpoint,
            make_tp_sharded_tensor_for_checkpoint,
        )

        out = {}
        for layer, name, pair in self.pairs():
            for part, p in (("A", pair.A), ("B", pair.B)):
                key = f"{prefix}layers.{layer}.{name}.{part}"
                if getattr(p, "tensor_model_parallel", False):
                    out[key] = make_tp_sharded_tensor_for_checkpoint(p, key, p.partition_dim)
                else:
                    out[key] = make_sharded_tensor_for_checkpoint(p, key)
        return out


def _fuse(parts: dict[str, torch.Tensor], order, widths, heads) -> torch.Tensor:
    """A fused linear's rows [out_local, ...] from its parts' rows (a missing part is zero):
    linear_qkv by query group (`qkv_to_megatron`, `heads` = this rank's head counts), linear_fc1
    as this rank's gate rows, then its up rows (`heads` None)."""
    like = next(iter(parts.values()))
    rows = [
        parts[n] if n in parts else like.new_zeros(w, *like.shape[1:])
        for n, w in zip(order, widths, strict=True)
    ]
    return torch.cat(rows) if heads is None else qkv_to_megatron(*rows, *heads)


@dataclass(frozen=True, eq=False)
class _Adapted:
    """One adapted megatron linear: its base weight and the pairs of its parts."""

    weight: torch.nn.Parameter
    pairs: dict
    order: tuple[str, ...] | None
    """The fused linear's parts in output order (None: a linear of one HF linear)."""
    widths: tuple[int, ...] | None
    heads: tuple[int, int, int] | None

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        outs = {n: p(x) for n, p in self.pairs.items()}
        if self.order is None:
            return next(iter(outs.values()))
        parts = {n: t.movedim(-1, 0) for n, t in outs.items()}
        return _fuse(parts, self.order, self.widths, self.heads).movedim(0, -1)

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """out + the adapters' output on the base's input x. The parts of a fused linear share
        x, so their `A`s run as one GEMM, and their `B`s as one block matrix laid out as the
        fused weight's rows: one rank-sized GEMM added into the base output, instead of a GEMM
        per part, the parts' outputs interleaved into the fused layout and a separate add,
        each a pass over the output (most of the adapters' time on CPU). With dropout each
        part keeps its own mask (`delta`)."""
        pairs = list(self.pairs.values())
        if not isinstance(pairs[0].dropout, torch.nn.Identity):
            return out + self.delta(x).to(out.dtype)
        a = pairs[0].A if len(pairs) == 1 else torch.cat([p.A for p in pairs])
        h = pairs[0].across_tp(torch.nn.functional.linear(x, a))
        flat = torch.addmm(
            out.reshape(-1, out.shape[-1]),
            h.reshape(-1, h.shape[-1]).to(out.dtype),
            self.fused_b().t().to(out.dtype),
            alpha=pairs[0].scale,
        )
        return flat.view(out.shape)

    def fused_b(self) -> torch.Tensor:
        """The parts' `B`s as one [out_local, parts x r] matrix: part i's rows (in the fused
        weight's row order) read its block of columns i, so `fused_b @ cat(A_i x)` is the
        fused output of every part (unscaled)."""
        pairs = list(self.pairs.items())
        if self.order is None:
            return pairs[0][1].B
        r, n = pairs[0][1].B.shape[1], len(pairs)
        blocks = {
            name: torch.nn.functional.pad(p.B, (i * r, (n - 1 - i) * r))
            for i, (name, p) in enumerate(pairs)
        }
        return _fuse(blocks, self.order, self.widths, self.heads)

    def merged(self) -> torch.Tensor:
        """This rank's shard of W + scale B A (every part's rows in the fused layout)."""
        deltas = {n: p.delta() for n, p in self.pairs.items()}
        if self.order is not None:
            delta = _fuse(deltas, self.order, self.widths, self.heads)
        else:
            delta = next(iter(deltas.values()))
        return (self.weight.detach().float() + delta).to(self.weight.dtype)


def _hook(adapters: LoraAdapters, adapted: _Adapted):
    def hook(module, args, output):
        if not adapters.on:
            return output
        out, bias = output
        return adapted.add_to(out, args[0]), bias

    return hook


def apply_lora(model, cfg: LoraConfig, arch: ModelArch, seed: int) -> LoraAdapters:
    """Freeze `model` (a `GPTModel` chunk) and attach `cfg`'s adapters to its layers, as
    `model.lora`; returns them."""
    from megatron.core import parallel_state as ps

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    group, sp = ps.get_tensor_model_parallel_group(), model.config.sequence_parallel
    dtype = model.config.params_dtype
    d, h = arch.head_dim, arch.hidden_size
    q_out, kv_out = arch.num_attention_heads * d, arch.num_key_value_heads * d
    f = arch.intermediate_size
    shape = {  # HF name -> (in, out), whole
        "q_proj": (h, q_out),
        "k_proj": (h, kv_out),
        "v_proj": (h, kv_out),
        "o_proj": (q_out, h),
        "gate_proj": (h, f),
        "up_proj": (h, f),
        "down_proj": (f, h),
    }
    fused = {  # megatron module -> (its parts in output order, local widths, local head counts)
        "self_attention.linear_qkv": (
            ("q_proj", "k_proj", "v_proj"),
            (q_out // tp, kv_out // tp, kv_out // tp),
            (arch.num_attention_heads // tp, arch.num_key_value_heads // tp, d),
        ),
        "mlp.linear_fc1": (("gate_proj", "up_proj"), (f // tp, f // tp), None),
    }
    model.requires_grad_(False)
    adapters = LoraAdapters()
    for layer in model.decoder.layers:
        g = layer.layer_number - 1
        mods = torch.nn.ModuleDict()
        for name in cfg.modules():
            mods[name] = LoraPair(
                *shape[name],
                cfg,
                kind=_LINEAR[name][1],
                sp=sp,
                tp_group=group,
                tp=tp,
                tp_rank=tp_rank,
                seed=_seed(seed, g, name),
                dtype=dtype,
            )
        adapters.layers[str(g)] = mods
        for path in dict.fromkeys(_LINEAR[n][0] for n in cfg.modules()):
            order, widths, heads = fused.get(path, (None, None, None))
            linear = layer.get_submodule(path)
            pairs = {n: mods[n] for n in cfg.modules() if _LINEAR[n][0] == path}
            adapted = _Adapted(linear.weight, pairs, order, widths, heads)
            adapters.adapted.append(adapted)
            linear.register_forward_hook(_hook(adapters, adapted))
    model.lora = adapters
    return adapters


def adapters_of(chunks) -> list[LoraAdapters]:
    """The `LoraAdapters` of each chunk that has them (none without LoRA)."""
    out = []
    for c in chunks:
        while hasattr(c, "module"):  # DDP / Float16Module wrappers
            c = c.module
        if isinstance(getattr(c, "lora", None), LoraAdapters):
            out.append(c.lora)
    return out


@contextlib.contextmanager
def merged(chunks):
    """Inside the block every adapted base weight of `chunks` holds W + scale B A (its shard,
    computed in fp32) and the adapters are off: whole-model readers (the weight sync, HF export)
    see the trained policy as one dense model. The base weights' own tensors are put back after,
    untouched (no add-then-subtract rounding). Holds a merged copy of the adapted weights."""
    adapted = [a for ad in adapters_of(chunks) for a in ad.adapted]
    originals = [a.weight.data for a in adapted]
    with disabled(chunks):
        try:
            for a in adapted:
                a.weight.data = a.merged()
            yield chunks
        finally:
            for a, t in zip(adapted, originals, strict=True):
                a.weight.data = t


@contextlib.contextmanager
def disabled(chunks):
    """Every adapter of `chunks` off inside the block: the base model (a LoRA run's reference)."""
    adapters = adapters_of(chunks)
    for a in adapters:
        a.on = False
    try:
        yield chunks
    finally:
        for a in adapters:
            a.on = True


@torch.no_grad()
def base_fingerprint(chunks) -> float:
    """The sum of squares (float64) of the transformer layers' dense base weights of the whole
    model, the same at every layout (TP-split tensors summed over TP, whole ones counted once,
    stages summed over PP): a LoRA checkpoint holds no base, so a resume checks that it rebuilt
    the one the adapters were trained on. Collective over the model-parallel ranks."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank()
    total = None
    for c in chunks:
        for name, p in c.named_parameters():
            # embeddings / output rows are padded by layout; experts are spread over EP
            layer = ".decoder.layers." in f".{name}"
            if is_lora(p) or not layer or not getattr(p, "allreduce", True):
                continue
            if not getattr(p, "tensor_model_parallel", False) and tp_rank != 0:
                continue
            s = p.detach().double().square().sum()
            total = s if total is None else total + s
    device = next(chunks[0].parameters()).device
    t = (total if total is not None else torch.zeros((), dtype=torch.float64)).to(device)
    dist.all_reduce(t, group=ps.get_model_parallel_group())
    return float(t)
