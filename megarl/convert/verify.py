"""Logit parity between transformers and megatron on the same token ids.

Both models run in fp32 whatever the checkpoint dtype (bf16 weights are upcast exactly), so the
comparison measures the implementations and the conversion, not rounding of activations. The
token ids are random but seeded, `batch x seq_len`, drawn from the real vocabulary, or the
tokens of a text (`text=`, tokenized with the HF directory's tokenizer; one sequence of at most
`seq_len` tokens): long real text exercises rope at far positions. A critic (value head) is
compared on its per-position values (`model.score(hidden states)` in transformers).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile

import torch
import torch.distributed as dist

from megarl.checkpoint.reader import load_into, open_checkpoint
from megarl.convert import fp8_blocks
from megarl.convert.hf_io import LazyHFTensors
from megarl.convert.mapping import to_files
from megarl.convert.pipeline import build_chunks, init_single_process
from megarl.data.tokenizer import load_tokenizer
from megarl.distributed import ParallelConfig, Topology
from megarl.models import forward, vocab
from megarl.models.hf_config import arch_from_hf, load_hf_config

log = logging.getLogger(__name__)


def sample_tokens(vocab_size: int, *, batch: int = 2, seq_len: int = 32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq_len), generator=g)


def hf_logits(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' fp32 logits [b, s, vocab] for `tokens` [b, s] (a sequence-classification
    directory, i.e. an exported critic: its values [b, s, 1] at every position)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    archs = AutoConfig.from_pretrained(hf_dir).architectures or []
    critic = any(a.endswith("ForSequenceClassification") for a in archs)
    auto = AutoModelForSequenceClassification if critic else AutoModelForCausalLM
    cfg = load_hf_config(hf_dir)
    mxfp4 = (cfg.get("quantization_config") or {}).get("quant_method") == "mxfp4"
    if fp8_blocks.block_size(cfg) is not None or mxfp4:
        # transformers dequantizes a block-FP8 (or MXFP4) checkpoint on CPU but then computes in
        # bf16: the reference is its bf16 model (the same values, tests/test_convert_fp8_blocks.py,
        # tests/test_convert_mxfp4.py) in fp32
        with tempfile.TemporaryDirectory() as plain:
            write_dequantized(hf_dir, plain)
            return hf_logits(plain, tokens)
    model = auto.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        if critic:
            out = model.score(model.model(input_ids=tokens).last_hidden_state).float()
        else:
            out = model(input_ids=tokens).logits.float()
    del model
    return out


def write_dequantized(hf_dir: str, out: str) -> None:
    """The bf16 model a block-FP8 or MXFP4 HF directory stands for, as config.json + one
    safetensors (gpt-oss's experts stacked again, as transformers reads them)."""
    from safetensors.torch import save_file

    lazy = LazyHFTensors(hf_dir)
    items = to_files(arch_from_hf(hf_dir), ((n, lazy.get(n)) for n in lazy.names))
    save_file({n: t.contiguous() for n, t in items}, os.path.join(out, "model.safetensors"))
    cfg = {k: v for k, v in load_hf_config(hf_dir).items() if k != "quantization_config"}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)


def text_tokens(hf_dir: str, text: str, *, max_len: int) -> torch.Tensor:
    """The first `max_len` token ids [1, s] of `text` under `hf_dir`'s tokenizer."""
    ids = load_tokenizer(hf_dir)(text, add_special_tokens=False)["input_ids"][:max_len]
    if not ids:
        raise ValueError("verify: the text has no tokens")
    return torch.tensor([ids])


def load_megatron(
    ckpt_dir: str, *, layout: dict | None = None, world: int = 1, role: str | None = None
):
    """Initialise megatron at `layout` (ParallelConfig fields) over `world` ranks and load role
    `role` of `ckpt_dir` (any megarl checkpoint, `megarl.checkpoint.reader`) into fp32 chunks.
    Collective. Returns (arch, chunks, groups)."""
    source = open_checkpoint(ckpt_dir, role)
    arch = source.arch
    par = ParallelConfig(**(layout or {}))
    topo = Topology.for_model(par, world, arch)
    groups = topo.initialize(seed=0)
    chunks = build_chunks(
        arch, par, dtype="fp32", role="critic" if source.value_head else "reference"
    )
    load_into(chunks, source)
    return arch, chunks, groups


def forward_logits(chunks, arch, groups, tokens: torch.Tensor) -> torch.Tensor:
    """Full-vocab fp32 logits [b, s, vocab] of `tokens` [b, s]; every rank gets them."""

    def loss_fn(mb, out):
        if out.shape[-1] == 1:  # a value head: replicated over TP
            return out.sum() * 0.0, {"logits": out.float()}
        full = vocab.gather_vocab(out.float(), vocab_size=arch.vocab_size, tp_group=groups.tp)
        return out.sum() * 0.0, {"logits": full}

    with torch.no_grad():
        outs = forward.forward_backward(
            chunks, [{"tokens": tokens}], loss_fn, forward_only=True, dp_size=1
        )
    mine = outs[0]["logits"] if outs else None
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return next(p for p in parts if p is not None)


def megatron_logits(
    ckpt_dir: str,
    tokens: torch.Tensor,
    *,
    layout: dict | None = None,
    world: int = 1,
    role: str | None = None,
) -> torch.Tensor:
    """megatron's fp32 logits [b, s, vocab] (a critic: values [b, s, 1]) for `tokens` after
    loading role `role` of `ckpt_dir` at `layout`. Collective over `world` ranks; every rank
    gets them."""
    arch, chunks, groups = load_megatron(ckpt_dir, layout=layout, world=world, role=role)
    return forward_logits(chunks, arch, groups, tokens)


def compare_logits(ref: torch.Tensor, got: torch.Tensor) -> dict:
    """max / mean |delta| and the fraction of positions whose argmax agrees."""
    if ref.shape != got.shape:
        raise ValueError(f"logit shapes differ: {tuple(ref.shape)} vs {tuple(got.shape)}")
    d = (ref.float() - got.float()).abs()
    return {
        "max_abs_delta": float(d.max()),
        "mean_abs_delta": float(d.mean()),
        "argmax_agreement": float((ref.argmax(-1) == got.argmax(-1)).float().mean()),
    }


def verify(
    hf_dir: str,
    ckpt_dir: str,
    *,
    tol: float = 1e-3,
    seq_len: int | None = None,
    text: str | None = None,
    role: str | None = None,
) -> dict:
    """Compare transformers on `hf_dir` with megatron on role `role` of `ckpt_dir` (one process,
    TP=PP=1), on `seq_len` random tokens (default 32) or on the first `seq_len` tokens of `text`
    (default: as many as the model's context holds).

    Returns the `compare_logits` dict plus `tokens` (the sequence length), `tol` and `ok`
    (max |delta| <= tol)."""
    arch = open_checkpoint(ckpt_dir, role).arch
    if not dist.is_initialized():
        init_single_process()
    longest = min(seq_len or arch.max_position_embeddings, arch.max_position_embeddings)
    if text is not None:
        tokens = text_tokens(hf_dir, text, max_len=longest)
    else:
        tokens = sample_tokens(arch.vocab_size, seq_len=min(seq_len or 32, longest))
    ref = hf_logits(hf_dir, tokens)
    got = megatron_logits(ckpt_dir, tokens, role=role)
    res = compare_logits(ref, got)
    res.update(tokens=int(tokens.shape[1]), tol=tol, ok=res["max_abs_delta"] <= tol)
    return res
