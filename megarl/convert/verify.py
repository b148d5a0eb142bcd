"""Logit parity between transformers and megatron on the same token ids.

Both models run in fp32 whatever the checkpoint dtype (bf16 weights are upcast exactly), so the
comparison measures the implementations and the conversion, not rounding of activations. The
token ids are random but seeded, `batch x seq_len`, drawn from the real vocabulary.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


def sample_tokens(vocab_size: int, *, batch: int = 2, seq_len: int = 32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq_len), generator=g)


def hf_logits(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' fp32 logits [b, s, vocab] for `tokens` [b, s]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        out = model(input_ids=tokens).logits.float()
    del model
    return out


def load_megatron(ckpt_dir: str, *, layout: dict | None = None, world: int = 1):
    """Initialise megatron at `layout` (ParallelConfig fields) over `world` ranks and load
    `ckpt_dir` into fp32 chunks. Collective. Returns (arch, chunks, groups)."""
    from megarl.convert.checkpoint import load_model_checkpoint, read_checkpoint_arch
    from megarl.convert.pipeline import build_chunks
    from megarl.distributed import ParallelConfig, Topology

    arch = read_checkpoint_arch(ckpt_dir)
    par = ParallelConfig(**(layout or {}))
    topo = Topology.for_model(par, world, arch)
    groups = topo.initialize(seed=0)
    chunks = build_chunks(arch, par, dtype="fp32")
    load_model_checkpoint(chunks, ckpt_dir)
    return arch, chunks, groups


def forward_logits(chunks, arch, groups, tokens: torch.Tensor) -> torch.Tensor:
    """Full-vocab fp32 logits [b, s, vocab] of `tokens` [b, s]; every rank gets them."""
    from megarl.models import forward

    def loss_fn(mb, out):
        full = forward.gather_vocab(out.float(), vocab_size=arch.vocab_size, tp_group=groups.tp)
        return out.sum() * 0.0, {"logits": full}

    with torch.no_grad():
        outs = forward.run(chunks, [{"tokens": tokens}], loss_fn, forward_only=True, dp_size=1)
    mine = outs[0]["logits"] if outs else None
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return next(p for p in parts if p is not None)


def megatron_logits(
    ckpt_dir: str, tokens: torch.Tensor, *, layout: dict | None = None, world: int = 1
) -> torch.Tensor:
    """megatron's fp32 logits [b, s, vocab] for `tokens` after loading `ckpt_dir` at `layout`.
    Collective over `world` ranks; every rank gets the logits."""
    arch, chunks, groups = load_megatron(ckpt_dir, layout=layout, world=world)
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


def verify(hf_dir: str, ckpt_dir: str, *, tol: float = 1e-3, seq_len: int = 32) -> dict:
    """Compare transformers on `hf_dir` with megatron on `ckpt_dir` (one process, TP=PP=1).

    Returns the `compare_logits` dict plus `ok` (max |delta| <= tol)."""
    from megarl.convert.checkpoint import read_checkpoint_arch
    from megarl.convert.pipeline import init_single_process

    arch = read_checkpoint_arch(ckpt_dir)
    if not dist.is_initialized():
        init_single_process()
    tokens = sample_tokens(arch.vocab_size, seq_len=min(seq_len, arch.max_position_embeddings))
    ref = hf_logits(hf_dir, tokens)
    got = megatron_logits(ckpt_dir, tokens)
    res = compare_logits(ref, got)
    res["tol"] = tol
    res["ok"] = res["max_abs_delta"] <= tol
    return res
