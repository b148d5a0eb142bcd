"""The one seam into megatron: `forward_step` + `get_forward_backward_func`.

Micro-batches are dicts of tensors with at least `tokens [b, s]`, collated on the host;
`forward_backward` is the one place that moves them to the model's device (every tensor but the
host-side `index` rows, which the callers use to place results into host tensors). Every
pipeline stage iterates the same list (only the first stage reads the tokens, the last one the
targets). The causal mask is passed explicitly (megatron would otherwise build one on "cuda").
A packed micro-batch (`packing`: `megarl.data.packing.PackedRows`) runs as one row `[1, T]` in
megatron's THD format; the loss functions read model outputs through `per_token` /
`token_logprobs`, which return them in the micro-batch's `[b, s]` layout either way. MoE: right
before each micro-batch's forward, `megarl.models.routing.prepare_forward` hands the chunk's
routers their replayed routes (`routed_experts`, R3) and the mask of real tokens.

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

from megarl.data.packing import model_layout
from megarl.models import routing, vocab


def causal_mask(seq_len: int, device) -> torch.Tensor:
    """[1, 1, s, s] bool, True where attention is *not* allowed (megatron convention)."""
    return torch.triu(torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool, device=device), 1)


def model_inputs(mb: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, object]:
    """(token ids, position ids, attention mask, megatron's PackedSeqParams or None) of `mb`.
    Packed: the row [1, T], positions restarting in each sequence, no mask (attention is
    causal within each segment of the THD format)."""
    packing = mb.get("packing")
    if packing is not None:
        tokens = packing.pack(mb["tokens"])
        cols = packing.cols.to(tokens.device)
        pos = torch.cat([cols, torch.arange(packing.length - packing.real, device=tokens.device)])
        return tokens, pos.unsqueeze(0), None, packing.seq_params()
    tokens = mb["tokens"]
    b, s = tokens.shape
    pos = mb.get("position_ids")
    if pos is None:
        pos = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
    return tokens, pos, causal_mask(s, tokens.device), None


def model_shape(mb: dict) -> tuple[int, int]:
    """(rows, sequence length) of what the model sees for `mb`: (1, T) packed."""
    packing = mb.get("packing")
    return (1, packing.length) if packing is not None else tuple(mb["tokens"].shape)


def per_token(mb: dict, x: torch.Tensor) -> torch.Tensor:
    """A per-token model output of `mb` (`[rows, s, ...]` as `model_shape(mb)`: logprobs,
    values) in the micro-batch's own `[b, s, ...]` layout, aligned with `mb["targets"]` and
    `mb["loss_mask"]` (packed: unpacked, zeros on padding)."""
    packing = mb.get("packing")
    if packing is None:
        return x
    return packing.unpack(x, *mb["tokens"].shape)


def token_logprobs(
    mb: dict, logits: torch.Tensor, *, vocab_size: int, tp_group, temperature: float = 1.0
) -> torch.Tensor:
    """log p(target) of `mb`'s targets under its TP-sharded logits -> [b, s] float32
    (`megarl.models.vocab.token_logprobs`, in the micro-batch's layout)."""
    targets = model_layout(mb, mb["targets"])
    return per_token(
        mb,
        vocab.token_logprobs(
            logits, targets, vocab_size=vocab_size, tp_group=tp_group, temperature=temperature
        ),
    )


def token_logprobs_and_entropy(
    mb: dict, logits: torch.Tensor, *, vocab_size: int, tp_group, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` and the entropy of softmax(logits / temperature), from one pass."""
    targets = model_layout(mb, mb["targets"])
    lp, ent = vocab.token_logprobs_and_entropy(
        logits, targets, vocab_size=vocab_size, tp_group=tp_group, temperature=temperature
    )
    return per_token(mb, lp), per_token(mb, ent)


def token_top1(mb: dict, logits: torch.Tensor, *, vocab_size: int, tp_group) -> torch.Tensor:
    """Whether each target of `mb` is its logits' argmax -> [b, s] bool (`vocab.top1`)."""
    targets = model_layout(mb, mb["targets"])
    return per_token(mb, vocab.top1(logits, targets, vocab_size=vocab_size, tp_group=tp_group))


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
        tokens, pos, mask, packed = model_inputs(mb)
        routing.prepare_forward(model, mb)  # MoE: replayed routes, router statistics
        output = model(tokens, pos, mask, packed_seq_params=packed, **_output_kw(model))
        return output, partial(scaled_loss, mb)

    seq_len = max(model_shape(mb)[1] for mb in micro_batches)
    mbs = max(model_shape(mb)[0] for mb in micro_batches)
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


def _output_kw(model) -> dict:
    """Keep a 16-bit model's output (logits, values) in its precision: megatron's Float16Module
    would upcast the whole vocabulary-sized logits to fp32, a copy that the losses do not need
    (`megarl.models.vocab` upcasts a chunk at a time; values and scores are cast where read)."""
    from megatron.core.transformer.module import Float16Module

    wrapped = (model, getattr(model, "module", None))  # DDP(Float16Module(...)) or frozen
    return {"fp32_output": False} if any(isinstance(m, Float16Module) for m in wrapped) else {}


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
    multiple of it guarantees for any micro-batch size. Blockwise FP8 under sequence parallelism
    all-gathers quantized inputs whose token dimension must be divisible by 128 (TE 2.9
    `assert_dim_for_all_gather`, pytorch/utils.py:449-456, float8_blockwise_tensor.py:203-211).
    `fp8_recipe`: None when FP8 is off."""
    multiple = tp if sequence_parallel else 1
    if fp8_recipe is None:
        return multiple
    if fp8_recipe == "blockwise" and sequence_parallel and tp > 1:
        return multiple * 128
    return multiple * (32 if fp8_recipe == "mxfp8" else 16)


# micro-batch fields that stay on the host: row indices into host-side result tensors
HOST_FIELDS = ("index",)


def to_device(mb: dict, device: torch.device) -> dict:
    """`mb` with every tensor but `HOST_FIELDS` (and the packing) on `device` (a no-op for
    tensors already there)."""
    out = {
        k: v.to(device, non_blocking=True)
        if isinstance(v, torch.Tensor) and k not in HOST_FIELDS
        else v
        for k, v in mb.items()
    }
    if "packing" in mb:
        out["packing"] = mb["packing"].to(device)
    return out


def empty_micro_batch(like: dict) -> dict:
    """A micro-batch shaped like `like` with no rows of its own: `loss_mask` all zero and an empty
    `index`, so it adds nothing to any loss share, metric or assembled result."""
    out = dict(like)
    out["loss_mask"] = torch.zeros_like(like["loss_mask"])
    out["index"] = torch.zeros(0, dtype=torch.long)
    return out


def pad_micro_batches(micro_batches: list[dict]) -> list[dict]:
    """Pad every `[b, s, ...]` field to the largest b and s among the micro-batches (zeros:
    masks stay zero in the padding); packed ones: their rows to the longest row. Pipeline stages
    exchange fixed-shape activations, so all micro-batches of one schedule call share a shape;
    `num_rows` keeps each one's real size."""
    if any("packing" in mb for mb in micro_batches):
        length = max(mb["packing"].length for mb in micro_batches)
        return [{**mb, "packing": mb["packing"].padded_to(length)} for mb in micro_batches]
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
