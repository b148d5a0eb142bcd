"""Layer specs: Transformer-Engine (GPU, FP8-capable) or megatron-core's local modules (CPU).

The local spec is megatron-core's `get_gpt_layer_local_spec` with its norms replaced: the stock
`WrappedTorchNorm` refuses sequence parallelism, so we use an RMSNorm whose weight carries
`sequence_parallel = config.sequence_parallel` (megatron's `finalize_model_grads` then all-reduces
its grads over TP). Q/K norms are left without that attribute: megatron reduces their grads by name.
Core attention is `SDPAttention`: megatron's `DotProductAttention` (same construction, state and
head bookkeeping) computing with torch's fused `scaled_dot_product_attention` instead of
baddbmm + an unfused masked softmax + bmm (a third of a CPU training step went there).
Transformer-Engine is imported lazily, only when the TE spec is asked for.
"""

from __future__ import annotations

import contextlib
import functools

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


@functools.cache
def _sdpa_attention_class():
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class SDPAttention(DotProductAttention):
        """megatron's local core attention through `F.scaled_dot_product_attention`.

        Assumes what megarl's forward passes guarantee: no attention dropout, the vanilla
        softmax, no attention bias or packed sequences, and for causal layers a mask that is
        exactly the causal one (`megarl.models.forward.causal_mask`; right padding keeps real
        tokens from seeing padding), so `is_causal=True` replaces it. Other mask types use the
        given mask. query: [sq, b, np, hn]; key, value: [sk, b, ng, hn] -> [sq, b, np * hn]."""

        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            if (
                config.attention_dropout
                or config.softmax_type != "vanilla"
                or config.apply_query_key_layer_scaling
            ):
                raise ValueError(
                    "SDPAttention supports attention_dropout=0, the vanilla softmax and no "
                    f"query-key layer scaling; got {config.attention_dropout}, "
                    f"{config.softmax_type!r}, {config.apply_query_key_layer_scaling}"
                )

        def forward(
            self,
            query,
            key,
            value,
            attention_mask,
            attn_mask_type=None,
            attention_bias=None,
            packed_seq_params=None,
        ):
            if attention_bias is not None or packed_seq_params is not None:
                raise ValueError("SDPAttention: attention bias / packed sequences unsupported")
            groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
            if groups > 1:  # grouped-query attention: each KV head serves `groups` query heads
                key = key.repeat_interleave(groups, dim=2)
                value = value.repeat_interleave(groups, dim=2)
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, np, s, hn]
            causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
            with _cpu_sdpa_backend(q):
                out = F.scaled_dot_product_attention(
                    q,
                    k,
                    v,
                    attn_mask=None if causal or attention_mask is None else ~attention_mask,
                    is_causal=causal,
                    scale=self.softmax_scale,
                )
            sq, b = query.shape[0], query.shape[1]
            return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    return SDPAttention


def _cpu_sdpa_backend(q: torch.Tensor):
    """On CPU, SDPA's flash kernel is the fastest in fp32 but about 2x slower than the plain
    math path in bf16 (measured, head_dim 32, fwd + bwd: 0.16 s vs 0.08 s; fp32 flash 0.048 s vs
    math 0.065 s): pick the math backend for 16-bit CPU tensors, SDPA's own choice otherwise."""
    if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(SDPBackend.MATH)
    return contextlib.nullcontext()


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
    sub.self_attention.submodules.core_attention = _sdpa_attention_class()
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
