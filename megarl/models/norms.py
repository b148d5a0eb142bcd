"""megarl's RMSNorms for megatron-core's local layers (the stock `WrappedTorchNorm` refuses
sequence parallelism). A hidden-state norm's weight carries `sequence_parallel =
config.sequence_parallel`, so megatron's `finalize_model_grads` all-reduces its grads over TP;
q / k norms are left without it (megatron reduces their grads by name). Zero-centred weights
(Qwen3-Next) follow `config.layernorm_zero_centered_gamma`. A norm's output has its weight's
dtype whatever its input's (an fp32 residual stream feeds bf16 GEMMs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class RMSNorm(torch.nn.Module):
    """RMSNorm for hidden states; sequence-parallel aware. Signature matches megatron's norms.
    With `config.layernorm_zero_centered_gamma` the weight w stands for the scale 1 + w, taken in
    fp32 as transformers' Qwen3-Next norm does (`Qwen3NextRMSNorm`)."""

    zero_centered_ok = True

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__()
        self.eps = eps
        self.zero_centered = self.zero_centered_ok and config.layernorm_zero_centered_gamma
        init = torch.zeros if self.zero_centered else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # computed in fp32 then cast to the weights' dtype, as Hugging Face's Llama/Qwen RMSNorm
        # does; an fp32 residual stream (precision.fp32_residual) leaves as the GEMMs' dtype
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.zero_centered:
            return (y * (1.0 + self.weight.float())).to(self.weight.dtype)
        return self.weight * y.to(self.weight.dtype)


class PlainRMSNorm(RMSNorm):
    """The Gated DeltaNet's output norm: a plain weight even in a zero-centred model
    (transformers' `Qwen3NextRMSNormGated`), over one value head."""

    zero_centered_ok = False


class QKRMSNorm(RMSNorm):
    """RMSNorm over one attention head (Qwen3 q_norm/k_norm); never sequence-sharded."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__(config, hidden_size, eps)
        self.weight.sequence_parallel = False


class LatentRMSNorm(RMSNorm):
    """MLA's norm of the compressed query / key-value vectors (q_a_layernorm, kv_a_layernorm)
    with eps 1e-6 whatever `rms_norm_eps` is, as DeepSeek's reference code and transformers 5.19
    build it (`DeepseekV3RMSNorm(config.kv_lora_rank)`, modeling_deepseek_v3.py:381,393); vLLM
    0.32 takes `rms_norm_eps` (deepseek_v2.py:501,525): equal for every released checkpoint,
    whose rms_norm_eps is 1e-6. Under sequence parallelism megatron norms the latents
    sequence-sharded (multi_latent_attention.py:593-613), so the weight's grads are all-reduced
    over TP like a hidden-state norm's."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__(config, hidden_size, 1e-6)
