"""The resharding plan: which trainer shard, slice and transform feeds which vLLM slice.

Computed once per run from metadata every rank publishes once (its local Megatron parameters and
the vLLM pieces it needs), then reused by every sync, which moves tensor bytes only.

How rows are tracked. Every mapping megarl needs is a permutation of indices along one dimension
`d` of a tensor (rows for column-parallel weights, embeddings and fused QKV / [gate; up];
columns for row-parallel weights):
- trainer side: which TP rank holds canonical index k, at which local index, comes from
  `megarl.convert.layout.split_tp` applied to `arange` (so [gate_r; up_r] shards and vocab
  padding follow layout's own rules);
- HF side: which canonical index HF row i comes from, by pushing an index tensor through
  `megarl.convert.mapping.canonical_to_hf` (QKV de-interleave per query group, [gate; up] split;
  the other dimension is checked to map to itself, so a transform that is not a pure
  permutation along `d` is refused at plan time); an HF tensor stored [in, out] (gpt-oss's
  experts) is planned as its transpose (`Piece.transposed`), handed to vLLM's loader as stored;
- vLLM side: which HF rows land where in each local vLLM parameter, from `vllm_layout`.
Composing the three gives, per vLLM piece, runs of consecutive indices that come from one
trainer shard: `Segment`s. A copy of one segment is one strided block copy.

Who sends what. A "sync group" is the smallest set of ranks holding the whole model: for a
dense model the ranks sharing a data-parallel (and context-parallel) index; with MoE expert
parallelism the experts of one such group sit on ranks of other DP indices too, so groups are
joined until every expert is inside (`sync_groups`); such a group holds some tensors more than
once and one replica per tensor sends. Every rank takes what its vLLM engine needs from its own
group. When all members need the same pieces (vLLM TP=1, always the case on CPU) each member
broadcasts its contribution once per bucket ("broadcast" mode); otherwise an `all_to_all`
delivers each member exactly its slices. Buckets bound the buffers. Expert tensors are sharded
over the expert-TP group (`SourceParam.shard_count`), not the dense TP group.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from megarl.convert.layout import split_tp
from megarl.convert.mapping import (
    canonical_shapes_for,
    canonical_to_hf,
    hf_names_for,
    transposed_hf,
)
from megarl.dtypes import BYTES_BY_NAME
from megarl.models.hf_config import ModelArch
from megarl.rollout.engine.pieces import Piece, PlanError, VllmDescription


@dataclass(frozen=True)
class SourceParam:
    """One trainer-local parameter, as published in the plan metadata."""

    canonical: str
    shape: tuple[int, ...]
    partition_dim: int
    """TP partition dimension; -1 = the same whole tensor on every TP rank."""
    dtype: str
    shard_rank: int | None = None
    shard_count: int | None = None
    """This shard's rank and the number of shards in its TP group: the expert-TP group for
    experts; None = the rank's dense TP rank and size."""
    expert: bool = False
    """An expert parameter: its copies are the expert-DP replicas, not the dense DP ones."""


@dataclass(frozen=True)
class RankMeta:
    """What one rank publishes, once."""

    rank: int
    group_key: tuple[int, ...]
    """(dp_rank, cp_rank): ranks with equal keys together hold one whole model."""
    pp_rank: int
    tp_rank: int
    tp_size: int
    params: tuple[SourceParam, ...]
    vllm: VllmDescription
    expert_key: tuple[int, ...] = ()
    """(pp_rank, expert_dp_rank): ranks with equal keys together hold every expert of their
    stage once (EP x ETP); () for dense models."""

    def replica(self, p: SourceParam) -> tuple:
        """Which copy of the model `p` belongs to (DP replicas hold equal copies)."""
        return ("expert", *self.expert_key) if p.expert else ("dense", *self.group_key)


def sync_groups(metas: list[RankMeta]) -> list[list[RankMeta]]:
    """The smallest sets of ranks that together hold one whole model: ranks sharing a dense
    (dp, cp) index hold the dense layers, ranks sharing an expert key hold the experts, and
    with expert parallelism these sets straddle each other (EP ranks sit in different dense DP
    replicas), so the groups are the connected unions of both. Each group is sorted by
    (pp, tp, rank); groups in order of their first rank."""
    parent = list(range(len(metas)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict[tuple, int] = {}
    for i, m in enumerate(metas):
        keys = [("dense", *m.group_key)] + ([("expert", *m.expert_key)] if m.expert_key else [])
        for key in keys:
            j = first.setdefault(key, i)
            parent[find(i)] = find(j)
    out: dict[int, list[RankMeta]] = {}
    for i, m in enumerate(metas):
        out.setdefault(find(i), []).append(m)
    groups = [sorted(g, key=lambda m: (m.pp_rank, m.tp_rank, m.rank)) for g in out.values()]
    return sorted(groups, key=lambda g: min(m.rank for m in g))


@dataclass(frozen=True)
class Segment:
    """`length` consecutive indices along `dim`: source member `src`, its parameter `param` from
    `src_start` -> this receiver's piece `piece` from `dst_start`."""

    src: int
    param: int
    src_start: int
    piece: int
    dst_start: int
    length: int
    dim: int
    numel: int


@dataclass
class Bucket:
    pieces: list[int]
    local: list[Segment]
    """Segments this rank copies from its own parameters."""
    recv: list[list[Segment]]
    """Per source member, the segments this rank receives (in buffer order)."""
    send: list[list[Segment]]
    """Per destination member (all_to_all), or one list (broadcast), of segments this rank packs."""

    def recv_numel(self, member: int) -> int:
        return sum(s.numel for s in self.recv[member])

    def send_numel(self, member: int | None = None) -> int:
        segs = self.send[0] if member is None else self.send[member]
        return sum(s.numel for s in segs)


@dataclass
class SyncPlan:
    members: list[int]
    """Global ranks of this rank's sync group (`sync_groups`), ordered by (pp, tp, rank)."""
    me: int
    """This rank's index in `members`."""
    mode: str
    """"local" (group of one), "broadcast" or "all_to_all"."""
    pieces: tuple[Piece, ...]
    """This rank's vLLM pieces, in vLLM parameter order."""
    buckets: list[Bucket]
    sources: tuple[SourceParam, ...]
    """This rank's own published parameters (the order `local_params` yields them)."""
    piece_canonical: list[str]
    """Canonical (Megatron) name feeding each piece, for error messages."""
    src_dtype: str
    dst_dtype: str
    aliases: dict[int, Segment] = field(default_factory=dict)
    """Pieces covered by one local segment: readable as a view of a trainer parameter."""

    @property
    def bytes_total(self) -> int:
        return sum(p.numel for p in self.pieces) * BYTES_BY_NAME[self.dst_dtype]

    def recv_capacity(self) -> list[int]:
        return [
            max((b.recv_numel(m) for b in self.buckets), default=0)
            for m in range(len(self.members))
        ]

    def send_capacity(self) -> int:
        if self.mode == "broadcast":
            return max((b.send_numel() for b in self.buckets), default=0)
        if self.mode == "all_to_all":
            return max(
                (sum(b.send_numel(m) for m in range(len(self.members))) for b in self.buckets),
                default=0,
            )
        return 0


# ----------------------------------------------------------------------------- index maps
def _index_tensor(shape: tuple[int, ...], dim: int) -> torch.Tensor:
    """int64 tensor of `shape` whose value is the index along `dim` (a zero-stride view)."""
    view = [1] * len(shape)
    view[dim] = shape[dim]
    return torch.arange(shape[dim]).view(view).expand(shape)


def _along(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The 1-D profile of `t` along `dim` (index 0 of every other dimension)."""
    for d in reversed(range(t.dim())):
        if d != dim:
            t = t.select(d, 0)
    return t


_INDEX = re.compile(r"(?<=\.)\d+(?=\.)")  # dot-delimited layer / expert indices


_SLOT = re.compile(r"(?<=\.)#(?=\.)")


def _fill(template: str, indices: list[str]) -> str:
    it = iter(indices)
    return _SLOT.sub(lambda _: next(it), template)


def hf_index_maps(
    arch: ModelArch, dims: dict[str, int]
) -> dict[str, tuple[str, int, torch.Tensor]]:
    """HF name -> (canonical name, dim, canonical index of each HF index along dim).

    `dims` gives the dimension each canonical tensor is sharded / permuted along. Maps are
    computed once per tensor kind (layer / expert indices abstracted) and checked to cover
    exactly the HF names of `arch`. An HF tensor stored [in, out] (`transposed_hf`: gpt-oss's
    experts) is mapped as its transpose, the trainer's orientation, as its pieces are."""
    shapes = canonical_shapes_for(arch)
    cache: dict[tuple, list[tuple[str, torch.Tensor]]] = {}
    out = {}
    flipped = transposed_hf(arch)

    def hf_of(name: str, t: torch.Tensor):  # in the trainer's orientation (`Piece.transposed`)
        for h, x in canonical_to_hf(arch, [(name, t)]):
            yield h, (x.t() if h in flipped else x)

    for name, shape in shapes.items():
        d = dims.get(name, 0)
        indices = _INDEX.findall(name)
        key = (_INDEX.sub("#", name), shape, d)
        if key not in cache:
            maps = [
                (_INDEX.sub("#", h), _along(t, d).clone())
                for h, t in hf_of(name, _index_tensor(shape, d))
            ]
            if len(shape) > 1:  # the other dimension must map to itself
                other = 1 - d
                for h, t in hf_of(name, _index_tensor(shape, other)):
                    if not torch.equal(_along(t, other), torch.arange(t.shape[other])):
                        raise PlanError(
                            f"the HF mapping of {name!r} -> {h!r} permutes dimension {other} "
                            f"too; weight sync supports permutations along one dimension ({d})"
                        )
            cache[key] = maps
        for template, idx in cache[key]:
            out[_fill(template, indices)] = (name, d, idx)
    expected = set(hf_names_for(arch))
    if set(out) != expected:
        raise PlanError(
            "index maps disagree with the HF mapping's names: missing "
            f"{sorted(expected - set(out))[:5]}, unexpected {sorted(set(out) - expected)[:5]}"
        )
    return out


def _holders(name: str, metas: list[RankMeta]) -> list[tuple[int, int, SourceParam]]:
    """(member index, param index, param) of every member holding canonical `name`."""
    found = []
    for m, meta in enumerate(metas):
        for i, p in enumerate(meta.params):
            if p.canonical == name:
                found.append((m, i, p))
    return found


def _owner_maps(name: str, metas: list[RankMeta], order: int):
    """For canonical `name`: (member, param index) per canonical index, and local index.

    Of several replicas (DP copies inside one sync group, with expert parallelism) one sends,
    chosen by `order` so that the sending is spread over them."""
    holders = _holders(name, metas)
    if not holders:
        raise PlanError(
            f"canonical tensor {name!r} is held by no rank of the sync "
            f"group {[m.rank for m in metas]}"
        )
    stages = {metas[m].pp_rank for m, _, _ in holders}
    if len(stages) > 1:
        raise PlanError(f"canonical tensor {name!r} is held by several pipeline stages {stages}")
    replicas = sorted({metas[m].replica(p) for m, _, p in holders})
    chosen = replicas[order % len(replicas)]
    holders = [h for h in holders if metas[h[0]].replica(h[2]) == chosen]
    p0 = holders[0][2]
    if p0.partition_dim < 0:  # replicated over TP: spread the sending over the TP ranks
        m, i, p = holders[order % len(holders)]
        n = p.shape[0] if p.shape else 1
        return (torch.full((n,), m), torch.full((n,), i), torch.arange(n)), 0
    d = p0.partition_dim
    tp = p0.shard_count if p0.shard_count is not None else metas[holders[0][0]].tp_size
    if len(holders) != tp:
        raise PlanError(
            f"canonical tensor {name!r}: {len(holders)} TP shards found in replica {chosen}, "
            f"expected {tp}"
        )
    full = p0.shape[d] * tp
    member = torch.empty(full, dtype=torch.long)
    param = torch.empty(full, dtype=torch.long)
    local = torch.empty(full, dtype=torch.long)
    for m, i, p in holders:
        if p.shape != p0.shape or p.partition_dim != d:
            raise PlanError(f"canonical tensor {name!r}: TP shards disagree on shape/dim")
        rank = p.shard_rank if p.shard_rank is not None else metas[m].tp_rank
        rows = split_tp(name, torch.arange(full), 0, tp, rank)
        member[rows] = m
        param[rows] = i
        local[rows] = torch.arange(rows.numel())
    return (member, param, local), d


def _runs(*keys: torch.Tensor, step: torch.Tensor) -> list[tuple[int, int]]:
    """[(start, length)] of maximal runs where `keys` are constant and `step` increases by 1."""
    n = step.numel()
    if n == 0:
        return []
    brk = step[1:] != step[:-1] + 1
    for k in keys:
        brk |= k[1:] != k[:-1]
    starts = [0] + (torch.nonzero(brk).flatten() + 1).tolist()
    ends = starts[1:] + [n]
    return [(s, e - s) for s, e in zip(starts, ends, strict=True)]


# ----------------------------------------------------------------------------- the plan
def build_plan(
    arch: ModelArch, metas: list[RankMeta], me: int, *, bucket_bytes: int = 256 * 2**20
) -> SyncPlan:
    """The plan of member `me` of a sync group whose members publish `metas` (ordered as
    `sync_groups` orders them). Every member computes the same buckets."""
    mine = metas[me]
    dtypes = {p.dtype for meta in metas for p in meta.params}
    if len(dtypes) != 1:
        raise PlanError(
            f"trainer parameters have several dtypes {sorted(dtypes)}; weight sync needs one"
        )
    src_dtype = dtypes.pop()
    dst_dtype = mine.vllm.dtype
    if dst_dtype not in BYTES_BY_NAME or src_dtype not in BYTES_BY_NAME:
        raise PlanError(f"unsupported dtypes trainer={src_dtype} vLLM={dst_dtype}")
    names = list(canonical_shapes_for(arch))
    owners, dims = {}, {}
    for order, name in enumerate(names):
        owners[name], dims[name] = _owner_maps(name, metas, order)
    hf_maps, flipped = hf_index_maps(arch, dims), transposed_hf(arch)

    def segments_for(meta: RankMeta) -> tuple[list[list[Segment]], list[str]]:
        per_piece, canon = [], []
        for k, pc in enumerate(meta.vllm.pieces):
            if pc.hf not in hf_maps:
                raise PlanError(
                    f"vLLM parameter {pc.param!r} needs HF tensor {pc.hf!r}, which "
                    "megarl's HF mapping does not produce"
                )
            cname, d, idx = hf_maps[pc.hf]
            if pc.transposed != (pc.hf in flipped):
                raise PlanError(
                    f"vLLM parameter {pc.param!r} reads HF tensor {pc.hf!r} "
                    f"{'transposed' if pc.transposed else 'as stored'}; megarl's mapping stores "
                    f"it {'[in, out]' if pc.hf in flipped else '[out, in]'}"
                )
            if d != pc.dim:
                raise PlanError(
                    f"vLLM slices {pc.hf!r} along dim {pc.dim} but the trainer shards / permutes "
                    f"{cname!r} along dim {d}"
                )
            if idx.numel() != pc.hf_shape[d]:
                raise PlanError(
                    f"HF tensor {pc.hf!r}: mapping gives {idx.numel()} indices along "
                    f"dim {d}, vLLM expects {pc.hf_shape[d]}"
                )
            rows = idx[pc.hf_start : pc.hf_start + pc.length]
            member, param, local = (t[rows] for t in owners[cname])
            inner = pc.numel // pc.length if pc.length else 0
            segs = [
                Segment(int(member[s]), int(param[s]), int(local[s]), k, s, n, d, n * inner)
                for s, n in _runs(member, param, step=local)
            ]
            per_piece.append(segs)
            canon.append(cname)
        return per_piece, canon

    computed = [segments_for(meta) for meta in metas]
    all_segs = [segs for segs, _ in computed]
    piece_canonical = computed[me][1]
    same = all(m.vllm.pieces == mine.vllm.pieces for m in metas)
    mode = "local" if len(metas) == 1 else ("broadcast" if same else "all_to_all")

    # buckets over vLLM parameter names (member 0's order and sizes), so members agree
    order, sizes = [], {}
    for pc in metas[0].vllm.pieces:
        if pc.param not in sizes:
            order.append(pc.param)
            sizes[pc.param] = 0
        sizes[pc.param] += pc.numel * BYTES_BY_NAME[dst_dtype]
    bucket_of, b, acc = {}, 0, 0
    for name in order:
        if acc and acc + sizes[name] > bucket_bytes:
            b, acc = b + 1, 0
        bucket_of[name] = b
        acc += sizes[name]
    n_buckets = b + 1 if order else 0
    buckets = [Bucket([], [], [[] for _ in metas], [[] for _ in metas]) for _ in range(n_buckets)]
    for j, meta in enumerate(metas):
        for k, pc in enumerate(meta.vllm.pieces):
            if pc.param not in bucket_of:
                raise PlanError(
                    f"vLLM parameter {pc.param!r} exists on rank {meta.rank} but not "
                    f"on rank {metas[0].rank}"
                )
            bk = buckets[bucket_of[pc.param]]
            for seg in all_segs[j][k]:
                if j == me:
                    if seg.src == me:
                        bk.local.append(seg)
                    else:
                        bk.recv[seg.src].append(seg)
                elif seg.src == me and mode == "all_to_all":
                    bk.send[j].append(seg)
            if j == me:
                bk.pieces.append(k)
    if mode == "broadcast":  # what I send = what any receiver (all alike) takes from me
        for bk in buckets:
            bk.send = [list(bk.local)]
    aliases = {}
    for k, segs in enumerate(all_segs[me]):
        pc = mine.vllm.pieces[k]
        if len(segs) == 1 and segs[0].src == me and segs[0].length == pc.length:
            aliases[k] = segs[0]
    return SyncPlan(
        members=[m.rank for m in metas],
        me=me,
        mode=mode,
        pieces=mine.vllm.pieces,
        buckets=buckets,
        sources=mine.params,
        piece_canonical=piece_canonical,
        src_dtype=src_dtype,
        dst_dtype=dst_dtype,
        aliases=aliases,
    )
