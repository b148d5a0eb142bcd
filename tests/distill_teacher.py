"""A tiny HF teacher for the distillation tests: a random Llama of another shape than the
embedded default's policy (3 layers, hidden 96, 4 heads of 24), with the toy tokenizer's files,
its LM head sharpened so that its next-token distribution is far from the student's."""

from __future__ import annotations

import torch

TEACHER = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=20,
    hidden_size=96,
    intermediate_size=192,
    num_hidden_layers=3,
    num_attention_heads=4,  # head_dim 24: the teacher never runs in vLLM
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    hidden_act="silu",
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def write_teacher(path: str, seed: int = 7, sharpen: float = 4.0) -> str:
    """Save the teacher (fp32 safetensors + the toy tokenizer) into `path`; returns it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from megarl.data.toy import toy_tokenizer

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TEACHER)).float()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    model.save_pretrained(path, safe_serialization=True)
    toy_tokenizer(path)
    return path


@torch.no_grad()
def teacher_logprobs(path: str, tokens: torch.Tensor, temperature: float = 1.0):
    """transformers' forward of the teacher at `path`: (log p(tokens[:, t + 1] | ...) at t,
    whether that token is the argmax), both [B, S] (the last position 0 / False)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    logits = model(input_ids=tokens).logits.float() / temperature
    logp = torch.log_softmax(logits, -1)
    targets = torch.roll(tokens, -1, 1)
    lp = logp.gather(-1, targets[..., None])[..., 0]
    top1 = logits.argmax(-1) == targets
    lp[:, -1], top1[:, -1] = 0.0, False
    return lp, top1
