"""The fused vocabulary-parallel logprob / entropy pass (`megarl.models.vocab`) equals the plain
single-device computation (log_softmax over the real vocabulary, then gather; the entropy of the
same softmax), values and gradients, at TP=1 and with the vocabulary split over TP=2 gloo ranks
(padded columns on the last rank), at temperature 1 and 0.7, in chunks of a few rows; it never
writes into the logits; 16-bit logits give the fp32 result of their values."""

from __future__ import annotations

import pytest
import torch

from megarl.distributed.launch import spawn

VOCAB, PADDED = 250, 256  # megatron pads the vocabulary: 6 columns that take part in nothing
TOL = 1e-6


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(3, 5, PADDED, generator=g)).to(dtype)
    logits[..., VOCAB:] = 1e4  # padding columns: any value must be ignored
    targets = torch.randint(0, VOCAB, (3, 5), generator=g)
    weights = torch.randn(2, 3, 5, generator=g)  # d(loss)/d(logprob), d(loss)/d(entropy)
    return logits, targets, weights


def reference(logits, targets, weights, temperature):
    x = logits.detach().float().requires_grad_()
    logp = torch.log_softmax(x[..., :VOCAB] / temperature, -1)
    lp = logp.gather(-1, targets[..., None])[..., 0]
    ent = -(logp.exp() * logp).sum(-1)
    ((lp * weights[0]).sum() + (ent * weights[1]).sum()).backward()
    return lp.detach(), ent.detach(), x.grad


def job(rank: int, world: int, temperature: float) -> dict:
    import torch.distributed as dist

    from megarl.models import vocab

    vocab.CHUNK_ELEMENTS = 2 * PADDED  # chunks of 2 (or 4) rows: several per call
    group = dist.new_group(list(range(world)))
    logits, targets, weights = _inputs()
    shard = PADDED // world
    mine = logits[..., rank * shard : (rank + 1) * shard]
    kw = dict(vocab_size=VOCAB, tp_group=group, temperature=temperature)

    def pass_(fn, loss):  # the forward on a copy; the backward consumes the copy's values
        x = mine.clone().requires_grad_()
        out = fn(x, targets, **kw)
        untouched = torch.equal(x.detach(), mine)
        loss(out).backward()
        return out, x.grad, untouched

    (lp, ent), grad_both, untouched = pass_(
        vocab.token_logprobs_and_entropy,
        lambda o: (o[0] * weights[0]).sum() + (o[1] * weights[1]).sum(),
    )
    lp_only, grad_lp, untouched_lp = pass_(vocab.token_logprobs, lambda o: (o * weights[0]).sum())
    return {
        "lp": lp.detach(),
        "ent": ent.detach(),
        "lp_only": lp_only.detach(),
        "grad": grad_both,
        "grad_lp_only": grad_lp,
        "untouched": untouched and untouched_lp,
        "top1": vocab.top1(mine, targets, vocab_size=VOCAB, tp_group=group),
    }


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_logprobs_and_entropy_equal_log_softmax(world, temperature):
    logits, targets, weights = _inputs()
    want_lp, want_ent, want_grad = reference(logits, targets, weights, temperature)
    lp_weights = torch.stack([weights[0], 0 * weights[1]])
    _, _, want_grad_lp = reference(logits, targets, lp_weights, temperature)
    results = spawn(job, world, temperature, timeout=300)
    grad = torch.cat([r["grad"] for r in results], -1)
    grad_lp = torch.cat([r["grad_lp_only"] for r in results], -1)
    for r in results:
        assert r["untouched"], "the forward modified the logits"
        assert (r["lp"] - want_lp).abs().max() <= TOL * max(1.0, want_lp.abs().max())
        assert torch.equal(r["lp_only"], r["lp"])
        assert (r["ent"] - want_ent).abs().max() <= TOL * 4
        best = logits[..., :VOCAB].float().argmax(-1)
        assert torch.equal(r["top1"], best == targets)
    # relative to the largest gradient element (here ~4: |y| reaches ~20 at temperature 0.7)
    for got, want in ((grad, want_grad), (grad_lp, want_grad_lp)):
        err = (got[..., :VOCAB] - want[..., :VOCAB]).abs().max() / want.abs().max()
        print(f"TP{world} T={temperature}: max relative gradient error {err:.2e}")
        assert err <= TOL
    assert torch.all(grad[..., VOCAB:] == 0) and torch.all(grad_lp[..., VOCAB:] == 0)


def bf16_job(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from megarl.models import vocab

    logits, targets, weights = _inputs(torch.bfloat16)
    x = logits.clone().requires_grad_()
    kw = dict(vocab_size=VOCAB, tp_group=dist.new_group([0]))
    lp, ent = vocab.token_logprobs_and_entropy(x, targets, **kw)
    ((lp * weights[0]).sum() + (ent * weights[1]).sum()).backward()
    return {"lp": lp.detach(), "ent": ent.detach(), "grad": x.grad}


def test_bf16_logits_give_the_fp32_logprobs_of_their_values():
    """A 16-bit chunk is upcast before any arithmetic: the result is fp32 log_softmax of the
    bf16 values, not a bf16 computation (whose error is ~1e-2); the gradient is bf16."""
    logits, targets, weights = _inputs(torch.bfloat16)
    r = spawn(bf16_job, 1, timeout=300)[0]
    want_lp, want_ent, want_grad = reference(logits, targets, weights, 1.0)
    assert r["lp"].dtype == torch.float32 and r["grad"].dtype == torch.bfloat16
    assert (r["lp"] - want_lp).abs().max() <= TOL * want_lp.abs().max()
    assert (r["ent"] - want_ent).abs().max() <= 4 * TOL
    # the bf16 gradient: one rounding of the fp32 one (8 mantissa bits)
    err = (r["grad"].float()[..., :VOCAB] - want_grad[..., :VOCAB]).abs().max()
    assert err <= 2**-8 * want_grad.abs().max()
