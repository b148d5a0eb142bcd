"""Marks megarl sets on megatron-core's parameters after a build, where megatron's own marks
would make the gather, the sync, the clipping norm or the grad reduction wrong: experts are never
sequence-parallel, sinks and the Gated DeltaNet's tensors are split over TP as megatron's
checkpoints split them. Each function says which megatron line it corrects."""

from __future__ import annotations

import logging

import torch

from megarl.models.fused import gdn_tp_parts
from megarl.models.hf_config import ModelArch

log = logging.getLogger(__name__)


def mark_parameters(model: torch.nn.Module, arch: ModelArch) -> None:
    """Every mark below, on one freshly built model chunk."""
    experts_not_sequence_parallel(model)
    sinks_split_with_heads(model)
    gdn_tp_layout(model, arch)


def experts_not_sequence_parallel(model: torch.nn.Module) -> None:
    """Clear `sequence_parallel` on expert parameters (gpt-oss's expert biases): megatron-core
    marks a row-parallel bias with it whatever the layer (tensor_parallel/layers.py:1228,
    extensions/transformer_engine.py:1114), and `finalize_model_grads` then sums its grad over
    the dense TP group (finalize_model_grads.py:354), whose ranks hold other experts at EP > 1:
    expert 0's bias got expert 2's gradient added (measured at TP 2 x EP 2 with SP: 9.4e-2 off).
    Experts see dispatched tokens, never a sequence shard. (The Transformer-Engine layers mark
    it only when built with `use_cpu_initialization`, never on GPU; cleared all the same.)"""
    for p in model.parameters():
        if getattr(p, "allreduce", True) is False:  # megatron's mark of an expert parameter
            p.sequence_parallel = False


def sinks_split_with_heads(model: torch.nn.Module) -> None:
    """Mark attention sinks (megatron's learnable softmax offset, one per local head) as split
    over TP on dim 0, as megatron's checkpoints split them (dot_product_attention.py:260-270):
    neither megatron's local attention nor Transformer-Engine's marks the parameter, so the
    conversion, grad norm and weight sync would take TP rank 0's heads for all of them."""
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    for name, p in model.named_parameters():
        if name.endswith("core_attention.softmax_offset"):
            set_tensor_model_parallel_attributes(p, True, 0, 1)


def gdn_tp_layout(model: torch.nn.Module, arch: ModelArch) -> None:
    """Mark the Gated DeltaNet's TP split: megatron marks its conv1d, dt_bias and A_log
    `tensor_model_parallel` without a partition dim (gated_delta_net.py:172-198), so megarl's
    gather and sync would take them whole; in_proj and conv1d hold a slice of each component
    (`tp_parts`, read by `megarl.convert.layout.merge_tp` / `split_tp`)."""
    if arch.gdn is None:
        return
    from megatron.core.ssm import gated_delta_net

    if torch.cuda.is_available() and getattr(gated_delta_net, "megarl_torch_delta_rule", False):
        log.warning(
            "flash-linear-attention is not installed: the Gated DeltaNet layers run megatron-core"
            "'s torch delta rule, far slower than its kernels (pip install flash-linear-attention)"
        )
    for name, p in model.named_parameters():
        if name.endswith(("self_attention.conv1d.weight", ".dt_bias", ".A_log")):
            p.partition_dim, p.partition_stride = 0, 1
        if parts := gdn_tp_parts(arch, name):
            p.tp_parts = parts
    for name, m in model.named_modules():
        # the DeltaNet's output norm scales by w, not 1 + w, on either spec (TE's RMSNorm keeps
        # its flag as `zero_centered_gamma`, megarl's as `zero_centered`): the canonical weight
        # is transformers' as stored, so a zero-centred one would be off by one everywhere
        if name.endswith("self_attention.out_norm") and (
            getattr(m, "zero_centered", False) or getattr(m, "zero_centered_gamma", False)
        ):
            raise RuntimeError(f"{name}: the Gated DeltaNet's output norm must not be zero-centred")
