"""HF config -> ModelArch -> TransformerConfig, and the errors for configs we cannot map."""

import pytest

from megarl.distributed import ParallelConfig
from megarl.models.hf_config import (
    ModelConfigError,
    PrecisionConfig,
    arch_from_hf,
    transformer_config,
)
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
