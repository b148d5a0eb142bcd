"""HF config -> ModelArch -> TransformerConfig, and the errors for configs we cannot map."""

import pytest
import torch

from megarl.distributed import ParallelConfig
from megarl.models.hf_config import ModelConfigError, PrecisionConfig, arch_from_hf
from megarl.models.mcore_config import transformer_config
from tests.tiny import TINY_LLAMA, TINY_MIXTRAL, TINY_QWEN3


def test_families_map():
    llama = arch_from_hf(TINY_LLAMA)
    assert (llama.family, llama.head_dim, llama.qk_norm, llama.qkv_bias) == (
        "llama",
        16,
        False,
        False,
    )
    qwen3 = arch_from_hf(TINY_QWEN3)
    assert (qwen3.head_dim, qwen3.qk_norm, qwen3.tie_word_embeddings) == (32, True, True)
    qwen2 = arch_from_hf({**TINY_LLAMA, "architectures": ["Qwen2ForCausalLM"]})
    assert qwen2.qkv_bias
    mix = arch_from_hf(TINY_MIXTRAL)
    assert (mix.num_experts, mix.moe_topk, mix.moe_intermediate_size) == (2, 2, 64)
    assert llama.padded_vocab_size(128, 1) == 256 and llama.padded_vocab_size(128, 4) == 512


def test_transformer_config_fields():
    arch = arch_from_hf(TINY_QWEN3)
    cfg = transformer_config(arch, ParallelConfig(), PrecisionConfig(dtype="fp32"), gpu=False)
    assert cfg.kv_channels == 32 and cfg.num_query_groups == 2 and cfg.qk_layernorm
    assert cfg.gated_linear_unit and cfg.normalization == "RMSNorm"


@pytest.mark.parametrize(
    "change,expected",
    [
        ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "accepted architectures"),
        (
            {"num_key_value_heads": 3},
            "num_attention_heads=4 is not divisible by num_key_value_heads=3",
        ),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2}}, "rope_scaling.rope_type='yarn'"),
        ({"hidden_size": None}, "required field 'hidden_size' is missing"),
    ],
)
def test_bad_configs_name_the_field(change, expected):
    with pytest.raises(ModelConfigError) as e:
        arch_from_hf({**TINY_LLAMA, **change})
    assert expected in str(e.value)


def test_bad_precision():
    with pytest.raises(ModelConfigError, match="accepted"):
        PrecisionConfig(dtype="fp8")
    with pytest.raises(ModelConfigError, match="fp8_recipe"):
        PrecisionConfig(fp8="e4m3", fp8_recipe="bogus")
    arch = arch_from_hf(TINY_LLAMA)
    with pytest.raises(ModelConfigError, match="needs a CUDA GPU with Transformer-Engine"):
        transformer_config(arch, ParallelConfig(), PrecisionConfig(fp8="e4m3"), gpu=False)


def test_top1_renormalised_moe_is_refused():
    with pytest.raises(ModelConfigError, match="num_experts_per_tok=1") as e:
        arch_from_hf({**TINY_MIXTRAL, "num_experts_per_tok": 1})
    assert "Mixtral-architecture configs" in str(e.value) and "no released" in str(e.value)
    from tests.tiny import TINY_QWEN3_MOE

    with pytest.raises(ModelConfigError, match="norm_topk_prob=false"):
        arch_from_hf({**TINY_QWEN3_MOE, "num_experts_per_tok": 1})
    # top-1 without renormalisation (weight p: megatron's pre-softmax routing) is accepted
    arch = arch_from_hf({**TINY_QWEN3_MOE, "num_experts_per_tok": 1, "norm_topk_prob": False})
    assert (arch.moe_topk, arch.moe_norm_topk_prob) == (1, False)


# ------------------------------------------------------------------ the 2026 MoE families
def test_sigmoid_moe_families_map_to_megatrons_router():
    """GLM-4.5 and DeepSeek-V3: sigmoid routing with an expert bias, group-limited top-k, the
    routed scaling factor, shared experts and dense first layers reach megatron's config."""
    from tests.test_convert_common import DEEPSEEK_V3, GLM4_MOE

    ds = arch_from_hf(DEEPSEEK_V3)
    assert (ds.moe_score, ds.moe_expert_bias, ds.moe_groups, ds.moe_group_topk) == (
        "sigmoid",
        True,
        2,
        1,
    )
    assert (ds.moe_scaling, ds.moe_shared_intermediate_size, ds.dense_layers) == (2.5, 32, 1)
    assert ds.mla.qk_head_dim == 32 and ds.head_dim == 32 and ds.num_key_value_heads == 4
    cfg = transformer_config(ds, ParallelConfig(), PrecisionConfig(), gpu=False)
    assert cfg.multi_latent_attention and (cfg.qk_head_dim, cfg.qk_pos_emb_head_dim) == (16, 16)
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.v_head_dim, cfg.rope_type) == (
        48,
        32,
        24,
        "rope",
    )
    assert cfg.moe_layer_freq == [0, 1] and cfg.moe_router_score_function == "sigmoid"
    assert (cfg.moe_router_num_groups, cfg.moe_router_group_topk) == (2, 1)
    assert cfg.moe_router_enable_expert_bias and cfg.moe_router_bias_update_rate == 0.0
    assert cfg.moe_router_topk_scaling_factor == 2.5
    assert cfg.moe_shared_expert_intermediate_size == 32
    rate = transformer_config(
        ds, ParallelConfig(), PrecisionConfig(), gpu=False, expert_bias_rate=1e-3
    )
    assert rate.moe_router_bias_update_rate == 1e-3
    glm = arch_from_hf(GLM4_MOE)
    assert (glm.rotary_fraction, glm.qk_norm, glm.qkv_bias, glm.moe_groups) == (0.5, True, True, 1)
    cfg = transformer_config(glm, ParallelConfig(), PrecisionConfig(), gpu=False)
    assert cfg.moe_router_num_groups is None and not cfg.multi_latent_attention


def test_yarn_reaches_multi_latent_attention():
    from tests.test_convert_common import DEEPSEEK_V3

    yarn = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)
    yarn.update(beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)
    arch = arch_from_hf({**DEEPSEEK_V3, "rope_scaling": yarn})
    cfg = transformer_config(arch, ParallelConfig(), PrecisionConfig(), gpu=False)
    assert (cfg.rope_type, cfg.rotary_scaling_factor, cfg.original_max_position_embeddings) == (
        "yarn",
        4.0,
        64,
    )
    assert (cfg.mscale, cfg.mscale_all_dim) == (1.0, 1.0)


@pytest.mark.parametrize(
    "change,expected",
    [
        ({"rope_interleave": False}, "rope_interleave=false is not supported"),
        ({"attention_bias": True}, "attention_bias=true with multi-latent attention"),
        ({"norm_topk_prob": False}, "norm_topk_prob=false"),
        ({"n_group": 2, "topk_group": 2, "num_experts_per_tok": 2}, "by its top two"),
        ({"n_group": 3}, "n_group dividing n_routed_experts"),
        ({"first_k_dense_replace": 4}, "at least one MoE layer"),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4, "mscale": 0.7}},
            "mscale != 1 without mscale_all_dim",
        ),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8}}, "accepted: 'yarn', 'default'"),
    ],
)
def test_deepseek_v3_configs_megatron_cannot_express_are_refused(change, expected):
    from tests.test_convert_common import DEEPSEEK_V3

    with pytest.raises(ModelConfigError, match=expected):
        arch_from_hf({**DEEPSEEK_V3, **change})


def test_num_params_equals_the_mapped_hf_tensors():
    """The analytic count (memory plans, MFU) against the mapping's shapes, every family."""
    from megarl.convert.mapping import hf_shapes_for
    from megarl.models.builder import num_params
    from tests.test_convert_common import CASES

    for name, hf in CASES.items():
        arch = arch_from_hf(hf)
        want = sum(torch.Size(s).numel() for s in hf_shapes_for(arch).values())
        assert num_params(arch) == want, name
    ds = arch_from_hf({**CASES["deepseek_v3"], "q_lora_rank": None})
    want = sum(torch.Size(s).numel() for s in hf_shapes_for(ds).values())
    assert num_params(ds) == want


@pytest.mark.parametrize(
    "arch,why",
    [
        ("Qwen3_5MoeForCausalLM", "routed experts"),
        ("Qwen3_5ForConditionalGeneration", "vision-language"),
        ("Gemma3ForCausalLM", "local / global attention"),
    ],
)
def test_families_megarl_does_not_build_are_refused_with_the_reason(arch, why):
    with pytest.raises(ModelConfigError, match=f"not supported yet: .*{why}.*DeepseekV3"):
        arch_from_hf({**TINY_LLAMA, "architectures": [arch], "model_type": "x"})


def test_gpt_oss_maps_to_megatrons_sinks_windows_biases_and_clamped_glu():
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    from tests.test_convert_common import GPT_OSS

    arch = arch_from_hf(GPT_OSS)
    assert arch.window_layers == (True, False) and arch.sliding_window == 4
    assert arch.attention_sinks and arch.linear_bias and arch.stacked_experts
    assert arch.moe_intermediate_size == 32 and arch.swiglu_limit == 0.5
    cfg = transformer_config(arch, ParallelConfig(), PrecisionConfig(), gpu=False)
    assert cfg.softmax_type == "learnable" and cfg.add_bias_linear
    assert cfg.window_size == (3, 0) and cfg.window_attn_skip_freq == [1, 0]
    assert cfg.activation_func is quick_gelu and cfg.glu_linear_offset == 1.0
    assert cfg.activation_func_clamp_value == 0.5 and not cfg.moe_router_pre_softmax
    assert (cfg.yarn_rotary_scaling_factor, cfg.yarn_correction_range_round_to_int) == (4.0, False)
    with pytest.raises(ModelConfigError, match="expert_tensor_parallel: 1 with expert_parallel"):
        transformer_config(arch, ParallelConfig(tensor_parallel=2), PrecisionConfig(), gpu=False)
    for change, expected in [
        ({"swiglu_alpha": 1.5}, "swiglu_alpha=1.5; accepted: 1.702"),
        ({"layer_types": ["full_attention"]}, "accepted: 2 entries"),
        ({"sliding_window": None}, "sliding_attention layers without a sliding_window"),
    ]:
        with pytest.raises(ModelConfigError, match=expected):
            arch_from_hf({**GPT_OSS, **change})


def test_qwen3_next_maps_to_megatrons_gated_delta_net_and_gated_attention():
    from megarl.models.mcore_config import packing_refusal
    from megarl.rollout.config import RolloutConfigError
    from megarl.rollout.engine.checks import check_engine_family
    from tests.tiny import TINY_QWEN3_NEXT

    arch = arch_from_hf(TINY_QWEN3_NEXT)
    assert arch.linear_layers == (True, True, True, False)
    assert (arch.gdn.key_heads, arch.gdn.value_heads, arch.gdn.conv_kernel) == (2, 4, 4)
    assert arch.zero_centered_norms and arch.attention_output_gate and arch.moe_shared_gate
    assert arch.rotary_fraction == 0.25 and arch.qk_norm and arch.moe_shared_intermediate_size
    # vLLM caches K and V of the one full-attention layer only
    assert arch.kv_cache_per_token(1, 2)[0] == 2 * 1 * 2 * 32 * 2
    cfg = transformer_config(
        arch, ParallelConfig(tensor_parallel=2, sequence_parallel=True), PrecisionConfig(),
        gpu=False,
    )  # fmt: skip
    assert cfg.experimental_attention_variant == "gated_delta_net"
    assert cfg.linear_attention_freq == [1, 1, 1, 0] and cfg.attention_output_gate
    assert cfg.layernorm_zero_centered_gamma and cfg.moe_shared_expert_gate
    with pytest.raises(ModelConfigError, match="parallel.sequence_parallel: true"):
        transformer_config(arch, ParallelConfig(tensor_parallel=2), PrecisionConfig(), gpu=False)
    assert "algorithm.pack_sequences: false" in packing_refusal(arch, packed=True)
    assert packing_refusal(arch, packed=False) is None
    assert packing_refusal(arch_from_hf(TINY_LLAMA), packed=True) is None
    with pytest.raises(RolloutConfigError, match="qwen3_next: no rollout engine yet"):
        check_engine_family(arch)
    for change, expected in [
        ({"layer_types": ["full_attention"]}, "accepted: 4 entries"),
        ({"mlp_only_layers": [0]}, "mlp_only_layers"),
        ({"linear_num_value_heads": 3}, "not a multiple of linear_num_key_heads=2"),
    ]:
        with pytest.raises(ModelConfigError, match=expected):
            arch_from_hf({**TINY_QWEN3_NEXT, **change})


def test_gpt_oss_fields_vllm_does_not_read_are_refused_at_the_engine():
    """vLLM 0.32 fixes swiglu_limit, swiglu_alpha, the windowed layers and the norm eps of
    gpt-oss whatever the config says (measured 0.8-7.7 nats off): such a config is refused."""
    from megarl.rollout.config import RolloutConfigError
    from megarl.rollout.engine.checks import check_vllm_reads
    from tests.tiny import TINY_GPT_OSS

    check_vllm_reads(arch_from_hf(TINY_GPT_OSS), "tiny")  # the published values pass
    for change, named in [
        ({"swiglu_limit": 3.0}, "swiglu_limit"),
        ({"rms_norm_eps": 1e-6}, "rms_norm_eps"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ]:
        with pytest.raises(RolloutConfigError, match=f"{named}.*vLLM 0.32 does not read"):
            check_vllm_reads(arch_from_hf({**TINY_GPT_OSS, **change}), "tiny")


def test_adapters_on_a_moe_policy_are_refused_before_the_engine_starts():
    """vLLM 0.32's LoRA engine serves MoE experts through a layer megarl's sync does not know
    (measured: the first sync of a Qwen3-MoE or gpt-oss run with attention adapters raised a
    PlanError naming FusedMoEModularMethod); a dense policy's adapters pass."""
    from megarl.rollout.config import RolloutConfigError
    from megarl.rollout.engine.checks import check_lora_engine
    from tests.tiny import TINY_GPT_OSS

    check_lora_engine(arch_from_hf(TINY_LLAMA), 4)
    check_lora_engine(arch_from_hf(TINY_GPT_OSS), 0)
    with pytest.raises(RolloutConfigError, match="model.lora.rank=4 with a mixture-of-experts"):
        check_lora_engine(arch_from_hf(TINY_GPT_OSS), 4)


def test_expert_bias_updates_need_fp32():
    from megarl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="precision.dtype=bf16: the expert bias is kept"):
        load_config(None, ["model.expert_bias_update_rate=0.001", "precision.dtype=bf16"])
    with pytest.raises(ConfigError, match="accepted: a number >= 0"):
        load_config(None, ["model.expert_bias_update_rate=-1"])
    assert load_config(None, ["model.expert_bias_update_rate=0.001"]).model.expert_bias_update_rate


def test_vllm_reads_kimi_k2_as_the_deepseek_v3_architecture():
    """Kimi-K2's config names a remote-code model_type; vLLM gets DeepSeek-V3's, with the router
    fields it needs (a config without them would route by softmax in vLLM)."""
    from transformers import AutoConfig

    from megarl.rollout.engine.checks import vllm_hf_config

    kimi = vllm_hf_config(arch_from_hf("examples/models/kimi-k2-instruct"))
    assert kimi["model_type"] == "deepseek_v3" and "auto_map" not in kimi
    assert (kimi["topk_method"], kimi["scoring_func"], kimi["n_routed_experts"]) == (
        "noaux_tc",
        "sigmoid",
        384,
    )
    cfg = AutoConfig.for_model(**{k: v for k, v in kimi.items() if k != "quantization_config"})
    assert cfg.num_hidden_layers == 61
    from tests.test_convert_common import DEEPSEEK_V3

    bare = vllm_hf_config(arch_from_hf(DEEPSEEK_V3))  # transformers writes neither field
    assert (bare["topk_method"], bare["scoring_func"]) == ("noaux_tc", "sigmoid")
