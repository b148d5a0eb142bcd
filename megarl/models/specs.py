"""Layer specs: Transformer-Engine (GPU, FP8-capable) or megatron-core's local modules (CPU).

The local spec is megatron-core's `get_gpt_layer_local_spec` with its norms replaced: the stock
`WrappedTorchNorm` refuses sequence parallelism, so we use an RMSNorm whose weight carries
`sequence_parallel = config.sequence_parallel` (megatron's `finalize_model_grads` then all-reduces
its grads over TP). Q/K norms are left without that attribute: megatron reduces their grads by name.
Transformer-Engine is imported lazily, only when the TE spec is asked for.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class RMSNorm(torch.nn.Module):
    """RMSNorm for hidden states; sequence-parallel aware. Signature matches megatron's norms."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # computed in fp32 then cast back, as Hugging Face's Llama/Qwen RMSNorm does
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * y.to(x.dtype)


class QKRMSNorm(RMSNorm):
    """RMSNorm over one attention head (Qwen3 q_norm/k_norm); never sequence-sharded."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__(config, hidden_size, eps)
        self.weight.sequence_parallel = False


def require_transformer_engine(what: str) -> None:
    try:
        import transformer_engine  # noqa: F401
    except ImportError as e:
        raise ImportError(
            f"{what} needs Transformer-Engine (pip install 'megarl[gpu]' on a CUDA machine); "
            f"it is not importable here: {e}"
        ) from e


def layer_spec(arch, *, use_te: bool):
    """The per-layer `ModuleSpec` for `arch` (a `ModelArch`)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if use_te:
        require_transformer_engine("the Transformer-Engine layer spec")
        return specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=arch.num_experts, moe_grouped_gemm=False, qk_layernorm=arch.qk_norm
        )
    spec = specs.get_gpt_layer_local_spec(
        num_experts=arch.num_experts,
        moe_grouped_gemm=False,
        qk_layernorm=arch.qk_norm,
        normalization="RMSNorm",
    )
    sub = spec.submodules
    sub.input_layernorm = RMSNorm
    sub.pre_mlp_layernorm = RMSNorm
    if arch.qk_norm:
        sub.self_attention.submodules.q_layernorm = QKRMSNorm
        sub.self_attention.submodules.k_layernorm = QKRMSNorm
    return spec


def block_spec(arch, config, *, use_te: bool, vp_stage: int | None, pp_rank: int | None = None):
    """Spec of this stage's transformer block, with the final norm megarl needs."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (
        TransformerBlock,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    layer = layer_spec(arch, use_te=use_te)
    n = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm as final_norm
    else:
        final_norm = RMSNorm
    return ModuleSpec(
        module=TransformerBlock,
        submodules=TransformerBlockSubmodules(layer_specs=[layer] * n, layer_norm=final_norm),
    )
