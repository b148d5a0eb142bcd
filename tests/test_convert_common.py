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
}


def make_hf_dir(cfg: dict, path: str, seed: int = 0) -> str:
    """Save a random fp32 HF model built from `cfg` into `path` (norms perturbed off 1)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    kw = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    config = AutoConfig.for_model(cfg["model_type"], **kw)
    config.architectures = cfg["architectures"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(path)
    _write_tokenizer(path)
    return path


def _write_tokenizer(path: str) -> None:
    """A stand-in tokenizer file: the conversion must carry it across unchanged."""
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        f.write('{"model_max_length": 256, "megarl_test": true}\n')


def hf_logits(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    """fp32 logits of transformers' model loaded from `hf_dir`: [b, s, vocab]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def megatron_logits_worker(rank, world, cases: dict, layout: dict, tokens: torch.Tensor):
    """Load each converted checkpoint at `layout` and return full logits (rank 0; {} elsewhere).

    `cases` maps name -> megatron checkpoint dir."""
    from megarl.convert.verify import megatron_logits

    out = {}
    for name, ckpt in cases.items():
        logits = megatron_logits(ckpt, tokens, layout=layout, world=world)
        if rank == 0:
            out[name] = logits
    return out
