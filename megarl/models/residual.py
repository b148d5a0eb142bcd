"""The residual add of megarl's local layers. megatron-core's bias-dropout-add casts the residual
to the layer output's dtype (fusions/fused_bias_dropout.py:29-34), so with
`fp32_residual_connection` only the embedding output stayed fp32; here an fp32 residual takes the
sum in fp32 (`precision.fp32_residual`). Same dtypes: megatron's own function, unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bias_dropout_add(training: bool, fused: bool):
    """Signature of megatron's `get_bias_dropout_add` (a layer's `self_attn_bda` / `mlp_bda`)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

    same_dtype = get_bias_dropout_add(training, fused)

    def add(x_with_bias, residual: torch.Tensor, prob: float) -> torch.Tensor:
        x, bias = x_with_bias
        if residual.dtype != torch.float32 or x.dtype == torch.float32:
            return same_dtype(x_with_bias, residual, prob)
        x = x.float() if bias is None else x.float() + bias.float()
        return residual + F.dropout(x, p=prob, training=training)

    return add
