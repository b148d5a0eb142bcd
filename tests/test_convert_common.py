"""Tiny HF models for the conversion tests (built from configs with transformers; no downloads),
and the module-level workers `spawn` runs. Holds no tests itself."""

from __future__ import annotations

import os

import torch

_BASE = dict(
    vocab_size=250,  # megatron pads to 256: exercises vocab padding and truncation on export
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    hidden_act="silu",
    tie_word_embeddings=False,
)

# the 2026 MoE families: sigmoid routing with an expert bias, shared experts, a dense first layer;
# GLM-4.5 with partial rotary, q/k norms and QKV biases; DeepSeek-V3 with multi-latent attention
# (q LoRA, a decoupled rotary key of its own width, values narrower than keys) and group-limited
# routing (2 groups, 1 chosen)
_SIGMOID_MOE = dict(
    _BASE,
    moe_intermediate_size=32,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
)
GLM4_MOE = dict(
    _SIGMOID_MOE,
    architectures=["Glm4MoeForCausalLM"],
    model_type="glm4_moe",
    head_dim=32,
    partial_rotary_factor=0.5,
    attention_bias=True,
    use_qk_norm=True,
    n_group=1,
    topk_group=1,
)
DEEPSEEK_V3 = dict(
    _SIGMOID_MOE,
    architectures=["DeepseekV3ForCausalLM"],
    model_type="deepseek_v3",
    num_key_value_heads=4,
    n_group=2,
    topk_group=1,
    q_lora_rank=48,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=24,
    num_nextn_predict_layers=0,
)

# gpt-oss: sinks, every other layer windowed (4 tokens: the tests' sequences are longer), biases
# everywhere, experts stacked and interleaved on disk, yarn; a swiglu_limit low enough to clamp
GPT_OSS = dict(
    _BASE,
    architectures=["GptOssForCausalLM"],
    model_type="gpt_oss",
    intermediate_size=32,
    head_dim=32,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=4,
    swiglu_limit=0.5,
    rope_parameters=dict(
        rope_type="yarn",
        factor=4.0,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
        original_max_position_embeddings=64,
        rope_theta=150000.0,
    ),
)

# Qwen3-Next: Gated DeltaNet layers (2 key heads, 4 value heads of another width) beside gated
# full attention, zero-centred norms, a quarter of each head rotary, every layer
# routed with a gated shared expert
QWEN3_NEXT = dict(
    _BASE,
    architectures=["Qwen3NextForCausalLM"],
    model_type="qwen3_next",
    head_dim=32,
    partial_rotary_factor=0.25,
    layer_types=["linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    norm_topk_prob=True,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
)

# Qwen3.5 (dense, text): Qwen3-Next's layers with separate q / k / v, z, b, a projections, plain
# MLPs, the rope of its vision-language parent (mrope sections: 1D rope on text)
QWEN3_5 = dict(
    {k: v for k, v in QWEN3_NEXT.items() if "expert" not in k and k != "norm_topk_prob"},
    architectures=["Qwen3_5ForCausalLM"],
    model_type="qwen3_5_text",
    rope_parameters=dict(
        rope_type="default",
        rope_theta=1000000.0,
        partial_rotary_factor=0.25,
        mrope_section=[2, 1, 1],
        mrope_interleaved=True,
    ),
)

# name -> HF config; together: every family, tied/untied, MHA/GQA/MQA, biases, q/k norms, rope
# scaling llama3/linear, head_dim != hidden/heads, both MoE on-disk formats
CASES: dict[str, dict] = {
    "llama3_gqa": dict(
        _BASE,
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
    "llama2_mha_linear": dict(
        _BASE,
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        num_key_value_heads=4,
        rope_scaling=dict(rope_type="linear", factor=2.0),
        vocab_size=300,
    ),
    "mistral_mqa": dict(
        _BASE,
        architectures=["MistralForCausalLM"],
        model_type="mistral",
        num_key_value_heads=1,
        sliding_window=None,
        rope_theta=1000000.0,
    ),
    "qwen2_tied_bias": dict(
        _BASE,
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
    ),
    "qwen3_tied_qknorm": dict(
        _BASE,
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        tie_word_embeddings=True,
        head_dim=32,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
    ),
    "qwen3_moe": dict(
        _BASE,
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        norm_topk_prob=True,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
    ),
    "mixtral": dict(
        _BASE,
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        num_local_experts=4,
        num_experts_per_tok=2,
        rope_theta=1000000.0,
    ),
    "glm4_moe": dict(GLM4_MOE, num_hidden_layers=4),
    "deepseek_v3": dict(DEEPSEEK_V3, num_hidden_layers=4),
    "gpt_oss": dict(GPT_OSS, num_hidden_layers=4),
    "qwen3_next": dict(
        QWEN3_NEXT,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    ),
    "qwen3_5": dict(
        QWEN3_5,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    ),
}


def make_hf_dir(cfg: dict, path: str, seed: int = 0, dtype=torch.float32) -> str:
    """Save a random HF model built from `cfg` (norms perturbed off 1) as `dtype` in `path`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    kw = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    config = AutoConfig.for_model(cfg["model_type"], **kw)
    config.architectures = cfg["architectures"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # chooses experts: make it matter
                b.copy_(0.1 * torch.randn_like(b))
    model.to(dtype).save_pretrained(path)
    _write_tokenizer(path)
    return path


def _write_tokenizer(path: str) -> None:
    """A stand-in tokenizer file: the conversion must carry it across unchanged."""
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        f.write('{"model_max_length": 256, "megarl_test": true}\n')


def convert_worker(rank, world, hf_dirs: dict, out: str, tokens: torch.Tensor):
    """World 1: per case hf -> mcore (fp32, or bf16 for `*_bf16`) -> hf; logits at TP=1."""
    from megatron.core import dist_checkpointing

    from megarl.convert.pipeline import hf_to_mcore, mcore_to_hf
    from megarl.convert.verify import megatron_logits

    res = {}
    for name, hf in hf_dirs.items():
        ckpt, back = os.path.join(out, name, "mcore"), os.path.join(out, name, "hf")
        hf_to_mcore(hf, ckpt, progress=False)
        mcore_to_hf(ckpt, back, progress=False, max_shard_bytes=64 * 2**10)
        res[name] = megatron_logits(ckpt, tokens)
        res[name + "/keys"] = set(dist_checkpointing.load_tensors_metadata(ckpt))
    return res


def layouts_worker(rank, world, ckpts: dict, out: str, tokens: torch.Tensor):
    """World 2: logits after loading at TP=2, PP=2 (and EP=2 for MoE); then a checkpoint saved
    from the first multi-rank layout is reloaded at the last one and gathered whole."""
    from megarl.checkpoint.reader import read_checkpoint_arch
    from megarl.checkpoint.writer import save_model_checkpoint
    from megarl.convert.layout import gather_full_state
    from megarl.convert.verify import forward_logits, load_megatron

    res = {}
    for name, ckpt in ckpts.items():
        arch = read_checkpoint_arch(ckpt)
        layouts = {"pp2": {"pipeline_parallel": 2}}
        if arch.num_key_value_heads % 2 == 0:
            layouts = {"tp2": _tp2(arch), **layouts}
        if arch.is_moe:
            layouts["ep2"] = {"expert_parallel": 2}
        resaved = os.path.join(out, name, "resaved")
        for k, (tag, layout) in enumerate(layouts.items()):
            chunks_arch, chunks, groups = load_megatron(ckpt, layout=layout, world=world)
            res[(name, tag)] = forward_logits(chunks, chunks_arch, groups, tokens)
            if k == 0:
                save_model_checkpoint(chunks, resaved, arch=arch)
        _, chunks, _ = load_megatron(resaved, layout=layout, world=world)
        res[(name, "resaved_" + tag)] = gather_full_state(chunks, to_all=False)
    # the trainer's models: a DDP-wrapped actor, and a critic whose value head stays initialised
    from megarl.checkpoint.reader import load_model_checkpoint
    from megarl.models.builder import build_model
    from megarl.models.hf_config import PrecisionConfig

    name = next(iter(ckpts))
    for role in ("actor", "critic"):
        arch, par, _ = _setup(ckpts[name], _tp2(read_checkpoint_arch(ckpts[name])), world)
        chunks = build_model(arch, par, PrecisionConfig(), role=role)
        load_model_checkpoint(chunks, ckpts[name])
        full = gather_full_state(chunks, to_all=False)
        res[(name, f"{role}_tp2")] = full
    return res if rank == 0 else {}


def _tp2(arch) -> dict:
    """TP 2; biased experts (gpt-oss) need expert-TP 1, so with EP 2, and Gated DeltaNet layers
    (Qwen3-Next) sequence parallelism (`transformer_config`)."""
    if arch.linear_bias and arch.is_moe:
        return {"tensor_parallel": 2, "expert_parallel": 2, "expert_tensor_parallel": 1}
    if arch.gdn is not None:
        return {"tensor_parallel": 2, "sequence_parallel": True}
    return {"tensor_parallel": 2}


def _setup(ckpt, layout, world):
    from megarl.checkpoint.reader import read_checkpoint_arch
    from megarl.distributed import ParallelConfig, Topology

    arch = read_checkpoint_arch(ckpt)
    par = ParallelConfig(**layout)
    groups = Topology.create(
        par,
        world,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_key_value_heads,
    ).initialize(seed=1)
    return arch, par, groups
