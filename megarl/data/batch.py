"""Collating prompt + response token ids into padded training tensors, and micro-batching them
(packed into rows when asked: `megarl.data.packing`).

Layout (B sequences, S = longest prompt + response, right padding):

    position      0    1    2    3    4    5
    tokens        p0   p1   r0   r1   r2   pad      prompt_len=2, response_len=3, seq_len=5
    targets       p1   r0   r1   r2   pad  pad      tokens shifted left by one
    loss_mask     0    1    1    1    0    0        1 where the *target* is a response token

`loss_mask[b, i] = 1` exactly for prompt_len - 1 <= i < seq_len - 1: the logits at position i
predict token i + 1, so per-token log-probs gathered with `targets` line up with the mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.data.packing import PackedRows, first_fit_decreasing

# Fields of the collated batch that are per-token ([B, S]).
TOKEN_FIELDS = ("tokens", "targets", "loss_mask")


def collate(
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    pad_id: int,
    *,
    pad_to_multiple: int = 1,
) -> dict[str, torch.Tensor]:
    """Right-padded batch of prompt + response sequences.

    Returns `tokens` [B, S] long, `targets` [B, S] long (tokens shifted left; the last column and
    every padding position hold `pad_id`), `loss_mask` [B, S] float32, and `prompt_len`,
    `response_len`, `seq_len` [B] long. S is the longest sequence, rounded up to a multiple of
    `pad_to_multiple` (e.g. the TP size with sequence parallelism). Every prompt must hold at
    least one token (the first response token is predicted from the last prompt token).
    """
    if len(prompt_ids) != len(response_ids):
        raise ValueError(f"collate: {len(prompt_ids)} prompts but {len(response_ids)} responses")
    if not prompt_ids:
        raise ValueError("collate: empty batch")
    if pad_to_multiple < 1:
        raise ValueError(f"collate: pad_to_multiple must be >= 1, got {pad_to_multiple}")
    for b, p in enumerate(prompt_ids):
        if not p:
            raise ValueError(f"collate: prompt {b} is empty; a prompt needs at least one token")
    prompt_len = torch.tensor([len(p) for p in prompt_ids], dtype=torch.long)
    response_len = torch.tensor([len(r) for r in response_ids], dtype=torch.long)
    seq_len = prompt_len + response_len
    width = int(seq_len.max())
    width = -(-width // pad_to_multiple) * pad_to_multiple

    batch = len(prompt_ids)
    tokens = torch.full((batch, width), pad_id, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompt_ids, response_ids, strict=True)):
        tokens[b, : len(p) + len(r)] = torch.tensor(list(p) + list(r), dtype=torch.long)
    targets = torch.full_like(tokens, pad_id)
    targets[:, :-1] = tokens[:, 1:]
    pos = torch.arange(width).unsqueeze(0)  # [1, S]
    loss_mask = ((pos >= prompt_len[:, None] - 1) & (pos < seq_len[:, None] - 1)).float()
    return {
        "tokens": tokens,
        "targets": targets,
        "loss_mask": loss_mask,
        "prompt_len": prompt_len,
        "response_len": response_len,
        "seq_len": seq_len,
    }


def collate_sequences(
    ids: list[list[int]],
    trained: list[list[bool]],
    pad_id: int,
    *,
    pad_to_multiple: int = 1,
) -> dict[str, torch.Tensor]:
    """Right-padded batch of whole sequences whose trained tokens may lie anywhere (offline
    training: SFT on several assistant turns, preference pairs).

    `trained[b][t]` says whether token t of sequence b is a training target (it must be
    predicted from the tokens before it, so `trained[b][0]` is ignored). Returns the fields of
    `collate`: `tokens`, `targets`, `loss_mask` [B, S] with `loss_mask[b, i] = trained[b][i + 1]`,
    and `seq_len`, `response_len` (trained tokens) [B] long, `prompt_len` [B] (tokens before the
    first trained one)."""
    if len(ids) != len(trained):
        raise ValueError(f"collate_sequences: {len(ids)} sequences but {len(trained)} masks")
    if not ids:
        raise ValueError("collate_sequences: empty batch")
    for b, (seq, m) in enumerate(zip(ids, trained, strict=True)):
        if len(seq) != len(m):
            raise ValueError(f"collate_sequences: sequence {b} has {len(seq)} ids, {len(m)} flags")
    seq_len = torch.tensor([len(x) for x in ids], dtype=torch.long)
    width = -(-int(seq_len.max()) // pad_to_multiple) * pad_to_multiple
    tokens = torch.full((len(ids), width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(len(ids), width, dtype=torch.float32)
    for b, (seq, m) in enumerate(zip(ids, trained, strict=True)):
        tokens[b, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        if len(m) > 1:
            loss_mask[b, : len(m) - 1] = torch.tensor(m[1:], dtype=torch.float32)
    targets = torch.full_like(tokens, pad_id)
    targets[:, :-1] = tokens[:, 1:]
    first = [next((t for t, x in enumerate(m) if x and t > 0), len(m)) for m in trained]
    return {
        "tokens": tokens,
        "targets": targets,
        "loss_mask": loss_mask,
        "prompt_len": torch.tensor(first, dtype=torch.long),
        "response_len": loss_mask.sum(1).long(),
        "seq_len": seq_len,
    }


@dataclass(frozen=True, kw_only=True)
class MicroBatching:
    """How a batch is cut into the micro-batches of one forward (and backward) pass: from the
    `algorithm` section (`of`) and the run's sequence multiple."""

    size: int
    """Most sequences per micro-batch (`algorithm.micro_batch_size`); with packing, the token
    budget of a micro-batch is `size` x the batch's longest sequence unless `max_tokens` is set."""
    max_tokens: int | None = None
    """Token budget of a micro-batch (`algorithm.max_tokens_per_micro_batch`): unpacked, its
    padded size (rows x longest); packed, its real tokens."""
    pad_to: int = 1
    """Sequence lengths (packed: row lengths) are multiples of this (`megarl.models.forward.
    sequence_multiple`)."""
    pack: bool = False
    """Pack each micro-batch's sequences into one row (`megarl.data.packing`,
    `algorithm.pack_sequences`)."""

    def __post_init__(self):
        if self.size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.size}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(
                f"max_tokens_per_micro_batch must be >= 1 or None, got {self.max_tokens}"
            )
        if self.pad_to < 1:
            raise ValueError(f"pad_to must be >= 1, got {self.pad_to}")

    @classmethod
    def of(cls, alg, *, pad_to: int) -> MicroBatching:
        """The micro-batching of the `algorithm` config section `alg`."""
        return cls(
            size=alg.micro_batch_size,
            max_tokens=alg.max_tokens_per_micro_batch,
            pad_to=pad_to,
            pack=alg.pack_sequences,
        )


def split_micro_batches(
    batch: dict, how: MicroBatching, *, together: torch.Tensor | None = None
) -> list[dict]:
    """The rows of `batch` grouped into micro-batches, each trimmed to its longest sequence.

    Unpacked (`how.pack` false): rows are taken longest first (ties in row order) and a
    micro-batch closes when it holds `how.size` rows or when one more row would make its padded
    size (rows x longest `seq_len`, rounded up to `how.pad_to`) exceed `how.max_tokens` (a row
    longer than the budget gets a micro-batch of its own). Grouping by length keeps padding low.
    Packed: first-fit decreasing over the rows' real lengths under a token budget (`how.
    max_tokens`, else `how.size` x the batch width), and each micro-batch gets `packing`, its
    `megarl.data.packing.PackedRows` (a row of its real tokens rounded up to `how.pad_to`). The
    losses use global denominators, so the grouping changes no loss or gradient
    (tests/test_losses_invariance.py, tests/test_packing.py).

    `together` [B] long: rows with the same id always share a micro-batch (the chosen and
    rejected sequence of a preference pair, whose loss needs both); they are placed as one unit
    (by its longest row; packed: by its total length), counted by their rows against `how.size`
    and `how.max_tokens`; a unit larger than either gets a micro-batch of its own.

    Every tensor whose first dim is B is indexed by the micro-batch's rows; those that also have
    dim 1 equal to the batch width S (`tokens`, `targets`, `loss_mask`, and any per-token field
    the caller added, e.g. old log-probs or advantages as [B, S]) are trimmed to the
    micro-batch's longest `seq_len`, rounded up to `how.pad_to` (S must be a multiple of it
    already). Lists of length B are indexed too; other values are shared. Each micro-batch gets
    `index` [b] long: its rows' indices in `batch`.
    """
    tokens = batch["tokens"]
    rows, width = tokens.shape
    if width % how.pad_to:
        raise ValueError(
            f"batch width {width} is not a multiple of pad_to_multiple={how.pad_to}; "
            "collate with the same pad_to_multiple"
        )

    def padded(n: int) -> int:
        return min(width, -(-n // how.pad_to) * how.pad_to)

    lengths = batch["seq_len"].tolist()
    units: dict[int, list[int]] = {}
    for r in range(rows):
        units.setdefault(int(together[r]) if together is not None else r, []).append(r)
    if how.pack:
        unit_rows = list(units.values())
        budget = how.max_tokens or how.size * width
        bins = first_fit_decreasing([sum(lengths[r] for r in u) for u in unit_rows], budget)
        groups = [[r for j in b for r in unit_rows[j]] for b in bins]
    else:
        groups = _length_groups(list(units.values()), lengths, how, padded)
    out = []
    for g in groups:
        idx = torch.tensor(sorted(g), dtype=torch.long)
        trimmed = padded(max(lengths[r] for r in g))
        micro: dict = {}
        for key, value in batch.items():
            if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == rows:
                value = value[idx]
                if value.dim() >= 2 and value.shape[1] == width:
                    value = value[:, :trimmed].contiguous()
                micro[key] = value
            elif isinstance(value, list) and len(value) == rows:
                micro[key] = [value[r] for r in idx.tolist()]
            else:
                micro[key] = value
        micro["index"] = idx
        if how.pack:
            micro["packing"] = PackedRows.of(micro["seq_len"], how.pad_to)
        out.append(micro)
    return out


def _length_groups(units: list[list[int]], lengths: list[int], how: MicroBatching, padded):
    """Unpacked grouping: units longest first, a group closing at `how.size` rows or at its
    padded size exceeding `how.max_tokens`."""
    order = sorted(units, key=lambda u: (-max(lengths[r] for r in u), u[0]))
    groups: list[list[int]] = []
    for unit in order:  # longest first: a group's first unit fixes its width
        g = groups[-1] if groups else None
        n = len(g) + len(unit) if g is not None else 0
        if (
            g is not None
            and n <= how.size
            and (how.max_tokens is None or n * padded(max(lengths[r] for r in g)) <= how.max_tokens)
        ):
            g.extend(unit)
        else:
            groups.append(list(unit))
    return groups


def pad_share(micro_batches: list[dict]) -> tuple[int, int]:
    """(real tokens, tokens the model computes on) of `micro_batches`: what `train/pad_share`
    is made of (packed: the row lengths; unpacked: rows x width)."""
    real = sum(int(mb["seq_len"].sum()) for mb in micro_batches)
    computed = sum(
        mb["packing"].length if "packing" in mb else mb["tokens"].numel() for mb in micro_batches
    )
    return real, computed
