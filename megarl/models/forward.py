"""The one seam into megatron: `forward_step` + `get_forward_backward_func`.

Micro-batches are dicts of tensors with at least `tokens [b, s]`, collated on the host; `run` is
the one place that moves them to the model's device (every tensor but the host-side `index`
rows, which the callers use to place results into host tensors). Every pipeline stage iterates
the same list (only the first stage reads the tokens, the last one the targets). The causal mask
is passed explicitly (megatron would otherwise build one on "cuda"). MoE: right before each
micro-batch's forward, `megarl.models.routing.prepare_forward` hands the chunk's routers their
replayed routes (`routed_experts`, R3) and the mask of real tokens.

Loss scaling. `loss_fn(micro_batch, output) -> (loss, metrics)` must return this micro-batch's
*share* of the global loss (its numerator over the global denominator). megatron then divides by
the number of micro-batches and DDP averages gradients over DP (x CP); `run` multiplies the share
by `num_microbatches x dp_size` so that the gradient is exactly d(global loss)/d(theta), whatever
the micro-batch and DP split.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from megarl.models import routing


def causal_mask(seq_len: int, device) -> torch.Tensor:
    """[1, 1, s, s] bool, True where attention is *not* allowed (megatron convention)."""
    return torch.triu(torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool, device=device), 1)


def model_inputs(mb: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens = mb["tokens"]
    b, s = tokens.shape
    pos = mb.get("position_ids")
    if pos is None:
        pos = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
    return tokens, pos, causal_mask(s, tokens.device)


def forward_backward(
    chunks: list[torch.nn.Module],
    micro_batches: list[dict],
    loss_fn: Callable[[dict, torch.Tensor], tuple[torch.Tensor, dict]] | None,
    *,
    forward_only: bool,
    dp_size: int,
) -> list[dict]:
    """Run megatron's schedule over `micro_batches`; return the metrics dicts of the last stage
    (empty list on other stages). With `forward_only=False` grads accumulate in the chunks."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    pp = ps.get_pipeline_model_parallel_world_size()
    micro_batches = _same_count_over_experts(micro_batches)
    if len(chunks) > 1 and len(micro_batches) % pp:
        # the interleaved schedule runs micro-batches in groups of PP: add empty ones (no valid
        # token, so no share of any loss; the scale below counts them, as megatron does)
        micro_batches = micro_batches + [
            empty_micro_batch(micro_batches[0]) for _ in range(-len(micro_batches) % pp)
        ]
    if pp > 1:  # stages exchange activations of one fixed shape
        micro_batches = pad_micro_batches(micro_batches)
    routing.check_micro_batches(chunks, micro_batches)  # MoE routes fit the model (all stages)
    dev = next(chunks[0].parameters()).device
    micro_batches = [to_device(mb, dev) for mb in micro_batches]
    num_mb = len(micro_batches)
    scale = 1.0 if forward_only else float(num_mb * dp_size)

    def scaled_loss(mb, output):
        loss, metrics = loss_fn(mb, output)
        return loss * scale, metrics

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        tokens, pos, mask = model_inputs(mb)
        routing.prepare_forward(model, mb)  # MoE: replayed routes, router statistics
        output = model(tokens, pos, mask)
        return output, partial(scaled_loss, mb)

    seq_len = max(mb["tokens"].shape[1] for mb in micro_batches)
    mbs = max(mb["tokens"].shape[0] for mb in micro_batches)
    iterators = [iter(micro_batches) for _ in chunks]
    out = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=num_mb,
        seq_length=seq_len,
        micro_batch_size=mbs,
        forward_only=forward_only,
    )
    return list(out or [])


def _same_count_over_experts(micro_batches: list[dict]) -> list[dict]:
    """With expert parallelism every forward exchanges tokens between the ranks of an EP group,
    so they must run the same number of micro-batches; length grouping with a token budget can
    split different data into different counts. Ranks with fewer add empty micro-batches (no
    valid token: no share of any loss; the scale in `run` counts them)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.get_expert_model_parallel_world_size() == 1:
        return micro_batches
    n = torch.tensor([len(micro_batches)], dtype=torch.long)
    dist.all_reduce(n, op=dist.ReduceOp.MAX, group=ps.get_expert_model_parallel_group())
    extra = int(n) - len(micro_batches)
    return micro_batches + [empty_micro_batch(micro_batches[0]) for _ in range(extra)]


def sequence_multiple(tp: int, sequence_parallel: bool, fp8_recipe: str | None) -> int:
    """What every micro-batch's sequence length is padded to a multiple of. Sequence parallelism
    splits the sequence over the TP ranks; Transformer-Engine's FP8 GEMMs need the flattened
    token dimension (micro-batch x local sequence) divisible by 16 (32 for MXFP8, as
    `megatron.core.fp8_utils.get_fp8_align_size`), which a local sequence length that is a
    multiple of it guarantees for any micro-batch size. `fp8_recipe`: None when FP8 is off."""
    multiple = tp if sequence_parallel else 1
    if fp8_recipe is None:
        return multiple
    return multiple * (32 if fp8_recipe == "mxfp8" else 16)


# micro-batch fields that stay on the host: row indices into host-side result tensors
HOST_FIELDS = ("index",)


def to_device(mb: dict, device: torch.device) -> dict:
    """`mb` with every tensor but `HOST_FIELDS` on `device` (a no-op for tensors already there)."""
    return {
        k: v.to(device, non_blocking=True)
        if isinstance(v, torch.Tensor) and k not in HOST_FIELDS
        else v
        for k, v in mb.items()
    }


def empty_micro_batch(like: dict) -> dict:
    """A micro-batch shaped like `like` with no rows of its own: `loss_mask` all zero and an empty
    `index`, so it adds nothing to any loss share, metric or assembled result."""
    out = dict(like)
    out["loss_mask"] = torch.zeros_like(like["loss_mask"])
    out["index"] = torch.zeros(0, dtype=torch.long)
    return out


def pad_micro_batches(micro_batches: list[dict]) -> list[dict]:
    """Pad every `[b, s, ...]` field to the largest b and s among the micro-batches (zeros:
    masks stay zero in the padding). Pipeline stages exchange fixed-shape activations, so all
    micro-batches of one schedule call share a shape; `num_rows` keeps each one's real size."""
    b = max(mb["tokens"].shape[0] for mb in micro_batches)
    s = max(mb["tokens"].shape[1] for mb in micro_batches)
    out = []
    for mb in micro_batches:
        rows, cols = mb["tokens"].shape
        padded = {"num_rows": rows}
        for k, v in mb.items():
            if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[:2] == (rows, cols):
                # F.pad lists dims from the last one: trailing dims (MoE routes) unpadded
                pad = [0, 0] * (v.dim() - 2) + [0, s - cols, 0, b - rows]
                v = torch.nn.functional.pad(v, pad)
            padded[k] = v
        out.append(padded)
    return out


# ------------------------------------------------------------------ vocab-parallel math
def vocab_parallel_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, *, vocab_size: int, tp_group, temperature=1.0
) -> torch.Tensor:
    """log p(target) from TP-sharded logits.

    logits: [b, s, V_pad / tp] (this rank's vocab slice); targets: [b, s] -> [b, s] float32.
    Padded vocab columns (>= vocab_size) are excluded from the softmax, so the result equals a
    single-device log_softmax over the real vocabulary."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = mask_padded_vocab(logits.float() / temperature, vocab_size, tp_group)
    # megatron's kernel is [s, b] major and returns -log p
    nll = vocab_parallel_cross_entropy(
        logits.transpose(0, 1).contiguous(), targets.t().contiguous()
    )
    return -nll.t()


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int, tp_group) -> torch.Tensor:
    import torch.distributed as dist

    shard = logits.shape[-1]
    start = dist.get_rank(tp_group) * shard
    if start + shard <= vocab_size:
        return logits
    cols = torch.arange(start, start + shard, device=logits.device)
    return logits.masked_fill(cols >= vocab_size, float("-inf"))


def vocab_parallel_entropy(logits: torch.Tensor, *, vocab_size: int, tp_group) -> torch.Tensor:
    """Entropy of the softmax over TP-sharded logits. [b, s, V/tp] -> [b, s] (differentiable)."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    logits = mask_padded_vocab(logits.float(), vocab_size, tp_group)
    with torch.no_grad():
        m = logits.max(dim=-1, keepdim=True).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits - m
    e = shifted.exp()
    z = reduce_from_tensor_model_parallel_region(e.sum(-1), group=tp_group)
    ez = reduce_from_tensor_model_parallel_region(
        (e * shifted.masked_fill(e == 0, 0.0)).sum(-1), group=tp_group
    )
    return z.log() - ez / z


@torch.no_grad()
def vocab_parallel_top1(
    logits: torch.Tensor, targets: torch.Tensor, *, vocab_size: int, tp_group
) -> torch.Tensor:
    """Whether each target is the argmax of its TP-sharded logits (teacher-forced token
    accuracy; a tie with another token counts as correct). [b, s, V/tp], [b, s] -> [b, s] bool."""
    import torch.distributed as dist

    logits = mask_padded_vocab(logits.float(), vocab_size, tp_group)
    shard = logits.shape[-1]
    start = dist.get_rank(tp_group) * shard
    local = targets - start
    here = (local >= 0) & (local < shard)
    # [2, b, s]: the best logit, and the target's logit (-inf on the ranks without it)
    both = torch.stack(
        [
            logits.max(dim=-1).values,
            logits.gather(-1, local.clamp(0, shard - 1).unsqueeze(-1))
            .squeeze(-1)
            .masked_fill(~here, float("-inf")),
        ]
    )
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=tp_group)
    return both[1] >= both[0]


def gather_vocab(logits: torch.Tensor, *, vocab_size: int, tp_group) -> torch.Tensor:
    """Full-vocabulary logits [b, s, vocab_size] from TP shards (tests and debugging only)."""
    import torch.distributed as dist

    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(parts, logits.contiguous(), group=tp_group)
    return torch.cat(parts, dim=-1)[..., :vocab_size]
