"""Vocabulary-parallel math on tensor-parallel logits: token logprobs, entropy, top-1, gathers.

Each TP rank holds a slice of the logits, `[..., V_pad / tp]` (megatron pads the vocabulary to a
multiple; the real vocabulary is the first `vocab_size` columns overall, padded columns take no
part in any softmax). Results equal a single-device computation over the real vocabulary.

`token_logprobs` is the hot path of every forward pass (reference, old policy, update, DPO, SFT):
log p(target) under softmax(logits / temperature), and optionally the entropy of that softmax,
in one fused pass over chunks of rows. It never materialises the full-vocabulary log-softmax,
never copies the logits (a 16-bit chunk is upcast to fp32 at a time), and keeps per row only the
max, the log partition function and the softmax mean of the scaled logits; the backward
recomputes each chunk's softmax from the saved logits and writes the gradient over them, so no
second vocabulary-sized tensor is ever allocated.
On a CPU this removes the whole-tensor copies (upcast, temperature, transposes) that cost as
much as a third of a forward-only pass (SmolLM2, fp32).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# elements of one chunk of rows (fp32: 16 MiB): temporaries of that size are reused by the
# allocator instead of being mapped and faulted in afresh, as whole-vocabulary ones are
CHUNK_ELEMENTS = 1 << 22


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_size: int,
    tp_group,
    temperature: float = 1.0,
) -> torch.Tensor:
    """log p(target) under softmax(logits / temperature) over the real vocabulary.

    logits: [..., V_pad / tp] (this rank's vocabulary slice, any dtype); targets: [...] long
    (global token ids) -> [...] float32, differentiable with respect to the logits. The forward
    leaves the logits as they are; the backward writes their gradient over them (a model's
    logits are read by nothing after the loss), as megatron's vocab-parallel cross entropy does."""
    lp, _ = _TokenLogprobs.apply(logits, targets, vocab_size, tp_group, float(temperature), False)
    return lp


def token_logprobs_and_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_size: int,
    tp_group,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` and the entropy of the same distribution, softmax(logits / temperature)
    (the policy that samples), from one pass. [..., V_pad / tp], [...] -> ([...], [...]) float32,
    both differentiable."""
    return _TokenLogprobs.apply(logits, targets, vocab_size, tp_group, float(temperature), True)


def _rows(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, tp_group):
    """(logits as rows [N, V_pad / tp], n: how many of this rank's columns are real, each
    target's column on this rank [N] (clamped into range), whether this rank holds it [N])."""
    shard = logits.shape[-1]
    start = dist.get_rank(tp_group) * shard
    n = max(0, min(shard, vocab_size - start))
    x = logits.reshape(-1, shard)
    local = targets.reshape(-1).to(x.device) - start
    here = (local >= 0) & (local < n)
    return x, n, local.clamp(0, max(n - 1, 0)), here


def _row_max(x: torch.Tensor, n: int) -> torch.Tensor:
    """[N] fp32: the max of each row's first n columns (-inf with none), a chunk at a time (the
    max is one of the elements: exact in any dtype)."""
    out = torch.full((x.shape[0],), float("-inf"), dtype=torch.float32, device=x.device)
    for c in _chunks(x.shape[0], n) if n else ():
        out[c] = x[c, :n].amax(-1).float()
    return out


def _workspace(rows: int, cols: int, device, wanted: bool = True) -> torch.Tensor | None:
    """One fp32 chunk's scratch, reused by every chunk of a call."""
    if not wanted or not cols:
        return None
    return torch.empty(min(rows, max(1, CHUNK_ELEMENTS // cols)), cols, device=device)


def _chunks(rows: int, cols: int):
    step = max(1, CHUNK_ELEMENTS // max(cols, 1))
    for a in range(0, rows, step):
        yield slice(a, min(a + step, rows))


class _TokenLogprobs(torch.autograd.Function):
    """Fused logprob (+ entropy) over TP-sharded logits; see the module docstring.

    With y = (x - max x) / t over the real vocabulary (max and sums global over TP):
    logZ = log sum exp(y), lp = y[target] - logZ, p = exp(y - logZ), H = logZ - sum p y.
    Gradients: d lp / dx = (onehot - p) / t, d H / dx = -p (y - sum p y) / t."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_size, tp_group, temperature, want_entropy):
        x, n, local, here = _rows(logits, targets, vocab_size, tp_group)
        rows = x.shape[0]
        f32 = dict(dtype=torch.float32, device=x.device)
        mx = _row_max(x, n)
        dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=tp_group)
        # [3, rows]: sum exp(y), sum exp(y) * y, y[target] (on the rank that holds it)
        sums = torch.zeros(3, rows, **f32)
        y_ws, e_ws = _workspace(rows, n, x.device), _workspace(rows, n, x.device, want_entropy)
        for c in _chunks(rows, n) if n else ():
            k = c.stop - c.start
            # fp32 copy, then in place: a mixed-dtype `sub` is ~10x slower than `copy_` + `sub_`
            y = y_ws[:k].copy_(x[c, :n]).sub_(mx[c, None])  # the logits stay untouched
            if temperature != 1.0:
                y /= temperature
            if want_entropy:
                e = torch.exp(y, out=e_ws[:k])
                sums[0, c] = e.sum(-1)
                sums[1, c] = e.mul_(y).sum(-1)
            else:
                sums[0, c] = y.exp_().sum(-1)
        picked = (x[torch.arange(rows, device=x.device), local].float() - mx) / temperature
        sums[2] = torch.where(here, picked, torch.zeros_like(picked))
        dist.all_reduce(sums, group=tp_group)
        log_z = sums[0].log()
        lp = sums[2] - log_z
        mean_y = sums[1] / sums[0]
        ent = log_z - mean_y if want_entropy else torch.zeros(0, **f32)
        ctx.save_for_backward(logits, local, here, mx, log_z, mean_y)
        ctx.meta = (n, temperature, want_entropy)
        ctx.mark_non_differentiable(*(() if want_entropy else (ent,)))
        shape = targets.shape
        return lp.view(shape), ent.view(shape) if want_entropy else ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        logits, local, here, mx, log_z, mean_y = ctx.saved_tensors
        n, temperature, want_entropy = ctx.meta
        shard = logits.shape[-1]
        x = logits.reshape(-1, shard)
        rows = x.shape[0]
        # the gradient is written over the logits, whose values the pass no longer needs (the
        # output layer's backward reads its input and weight, not its output): no second
        # vocabulary-sized tensor, which on a CPU costs a fresh mapping faulted in page by page.
        # Another autograd node that saved these logits would fail its version check, loudly.
        grad = x
        grad[:, n:] = 0  # padded vocabulary columns
        g_lp = None if g_lp is None else g_lp.reshape(-1).float()
        g_ent = None if (g_ent is None or not want_entropy) else g_ent.reshape(-1).float()
        # fp32 logits: computed in place; 16-bit: in an fp32 workspace, then rounded into place
        ws = None if x.dtype == torch.float32 else _workspace(rows, n, x.device)
        for c in _chunks(rows, n) if n else ():
            k = c.stop - c.start
            # a = y - logZ = log p, so p = exp(a); then g = -p * coef (+ g_lp at the target)
            if ws is None:
                a = grad[c, :n].sub_(mx[c, None])
            else:
                a = ws[:k].copy_(x[c, :n]).sub_(mx[c, None])
            if temperature != 1.0:
                a /= temperature
            a -= log_z[c, None]
            if g_ent is None:
                g = a.exp_().mul_(g_lp[c, None].neg())
            else:  # coef = g_lp + g_ent * (y - sum p y); y - sum p y = a + logZ - sum p y
                p = a.exp()
                coef = a.add_((log_z[c] - mean_y[c])[:, None]).mul_(g_ent[c, None])
                if g_lp is not None:
                    coef += g_lp[c, None]
                g = coef.mul_(p).neg_()
            if g_lp is not None:
                rows_c = torch.arange(k, device=x.device)
                g[rows_c, local[c]] += torch.where(here[c], g_lp[c], torch.zeros_like(g_lp[c]))
            if temperature != 1.0:
                g /= temperature
            if g.data_ptr() != grad[c, :n].data_ptr():
                grad[c, :n] = g
        return grad.view(logits.shape), None, None, None, None, None


@torch.no_grad()
def top1(logits: torch.Tensor, targets: torch.Tensor, *, vocab_size: int, tp_group) -> torch.Tensor:
    """Whether each target is the argmax of its TP-sharded logits (teacher-forced token
    accuracy; a tie with another token counts as correct). [..., V/tp], [...] -> [...] bool."""
    x, n, local, here = _rows(logits, targets, vocab_size, tp_group)
    best = _row_max(x, n)
    picked = x[torch.arange(x.shape[0], device=x.device), local].float()
    # [2, rows]: the best logit, and the target's logit (-inf on the ranks without it)
    both = torch.stack([best, picked.masked_fill(~here, float("-inf"))])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=tp_group)
    return (both[1] >= both[0]).view(targets.shape)


def gather_vocab(logits: torch.Tensor, *, vocab_size: int, tp_group) -> torch.Tensor:
    """Full-vocabulary logits [..., vocab_size] from TP shards (tests and checks only)."""
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(parts, logits.contiguous(), group=tp_group)
    return torch.cat(parts, dim=-1)[..., :vocab_size]
