"""A distributed model's tensors, whole, on global rank 0 (or each on one of the ranks holding
it, spread), one at a time (`CanonicalStream`); with it, the export as an HF directory
(`save_hf_streaming`) and the weights the separate placement's trainer sends its engines
(`megarl.rollout.placement.separate`, spread over every rank holding pieces). Collective.

Memory beyond the parameters: rank 0 (spread: each collector) holds the pieces of one canonical
tensor, then the merged tensor and its HF split (at most 2x the largest tensor; measured by
tests/test_memory_bounds.py); every other rank holds nothing (it sends its parameters as they
are). The plan comes from one small metadata exchange (`gather_object` of names, shapes and
dtypes to rank 0, the plan broadcast back; object collectives carry metadata only: on an
NCCL-only group they stage max-object-size x world bytes on the device):

1. Every rank lists the shards it contributes, keyed by canonical name: DP rank 0's
   (`layout.is_contributor`; of a tensor every TP rank holds whole, TP rank 0's), spread every
   DP replica's, tagged with the replica (`layout.replica`).
2. Rank 0 checks that each replica's shards cover every canonical tensor of the arch exactly
   once (all TP pieces, same dtype) and tells every rank whether to go on (broadcast of one
   error string: a plan that fails, fails on every rank, and nobody waits in a send). The
   export then opens its directory and plans the safetensors shards from the HF shapes
   (`mapping.file_shapes`), with a second such broadcast.
3. Each walk (`CanonicalStream.tensors`): all ranks go through the canonical tensors in HF
   writing order. A contributor other than rank 0 copies each of its shards to host memory and
   `send`s it to rank 0: on GPU the process group is device-mapped (`cpu:gloo,cuda:nccl`), so
   these point-to-point messages go through gloo and no NCCL communicator is created per
   (sender, rank 0) pair (there would be up to world - 1 of them, each with device buffers);
   rank 0 `recv`s the pieces of one tensor (or takes its own), merges the TP pieces
   (`layout.merge_tp`) and cuts vocab padding. The export maps each tensor to HF
   (`mapping.canonical_to_hf`: QKV per query group, [gate; up]) and appends the HF tensor(s) to
   the open shard file (`hf_write.StreamingShardWriter`, which writes each shard's header up
   front). Everyone sends in the same global order and rank 0 receives in it, so the
   point-to-point pairs always match. Spread (`CanonicalStream(spread=True)`, the separate
   placement's sync), each tensor is made whole on one of the ranks holding a piece of it, in
   any DP replica, instead of rank 0 (`collector`, chosen by `spread_plan`: the holder that has
   collected the fewest bytes so far), from the pieces of that rank's replica: the pipeline
   stages, and within a stage its TP ranks and DP replicas, each collect and send about an
   equal share, in parallel. The walk is the same global order on every rank, each tensor a
   matched set of sends to its collector, so the pairs still match: the ranks still working on
   the earliest unfinished tensor are all of its senders and its collector.
4. An error on rank 0 while it consumes the walk does not stop the receiving (the senders would
   block): closing the walk receives and drops the rest. The export then aborts the directory
   and broadcasts the error, which every rank raises. The directory is written under a
   temporary name and renamed at the end (`AtomicDir`).

Not handled: an error on a sender while others are mid-stream leaves rank 0 waiting in `recv`
until the process group's timeout (as any collective would).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist

from megarl.convert.export import export_config, finish_hf_dir
from megarl.convert.hf_write import AtomicDir, StreamingShardWriter
from megarl.convert.layout import VOCAB_PARAMS, local_params, merge_tp, replica, tp_shard
from megarl.convert.mapping import canonical_names_for, canonical_to_hf, file_shapes, to_files
from megarl.models.fused import gdn_tp_parts
from megarl.models.hf_config import ModelArch

log = logging.getLogger(__name__)


def save_hf_streaming(
    chunks: list[torch.nn.Module],
    arch: ModelArch,
    out_dir: str | os.PathLike,
    *,
    hf_config: dict | None = None,
    tokenizer_dir: str | os.PathLike | None = None,
    max_shard_bytes: int = 2 * 2**30,
    overwrite: bool = False,
) -> str:
    """Write the model held by `chunks` across all ranks as a complete HF directory on rank 0
    (collective over the default group; `megarl.convert.export.finish_hf_dir`: config,
    tokenizer files of `tokenizer_dir`, generation config). Tensors keep the parameters' dtype;
    `hf_config` (default `arch.hf_config`) becomes config.json with that dtype. Returns the
    absolute `out_dir`."""
    try:
        stream = CanonicalStream(chunks, arch)
    except ValueError as e:  # (raised on every rank)
        raise RuntimeError(f"HF export to {out_dir} refused: {e}") from e
    writer = out = None
    err: list[str | None] = [None]
    if dist.get_rank() == 0:
        try:
            out = AtomicDir(out_dir, overwrite=overwrite)
            specs = [(n, s, stream.dtype) for n, s in file_shapes(arch).items()]
            writer = StreamingShardWriter(out.tmp, specs, max_shard_bytes=max_shard_bytes)
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            err[0] = f"{type(e).__name__}: {e}"
            if out is not None:
                out.abort()
    dist.broadcast_object_list(err, src=0)
    if err[0] is not None:
        raise RuntimeError(f"HF export to {out_dir} refused: {err[0]}")

    writing = None
    try:
        with contextlib.closing(stream.tensors()) as tensors:  # (rank 0's only)

            def hf_tensors():
                nonlocal writing
                for writing, full in tensors:
                    yield from canonical_to_hf(arch, [(writing, full)])

            for hf_name, t in to_files(arch, hf_tensors()):
                writer.write(hf_name, t)
        writing = None
        if writer is not None:
            writer.close()
            config = export_config(hf_config or arch.hf_config, arch.family, _name(stream.dtype))
            finish_hf_dir(out.tmp, config, tokenizer_dir)
            out.commit()
    except Exception as e:  # noqa: BLE001 - raised on every rank below (rank 0 only: the others
        # only send, and their sends complete: closing the walk receives what is left)
        err[0] = (
            f"{type(e).__name__}" + (f" while writing {writing!r}" if writing else "") + f": {e}"
        )
        log.error("HF export: %s", err[0])
        if writer is not None:
            writer.abort()
            out.abort()
    dist.broadcast_object_list(err, src=0)
    if err[0] is not None:
        raise RuntimeError(f"HF export to {out_dir} failed: {err[0]}")
    return os.path.abspath(os.fspath(out_dir))


class CanonicalStream:
    """The canonical tensors of a model held across the default group's ranks, whole, on global
    rank 0 (`spread`: each on one of the ranks holding it), one at a time (module doc, steps
    1-3).
    Made once (collective: the metadata exchange; a plan that does not cover the arch raises on
    every rank); each `tensors()` is one walk over the current values, collective over the
    default group."""

    def __init__(self, chunks: list[torch.nn.Module], arch: ModelArch, spread: bool = False):
        self.chunks, self.arch = chunks, arch
        self.order = canonical_names_for(arch)
        meta = []
        for name, local_name, p in local_params(chunks):
            copy = replica(p)
            if copy == 0 or (spread and copy is not None):
                dim, tp, r = tp_shard(p)
                meta.append((name, local_name, dim, tp, r, tuple(p.shape), str(p.dtype), copy))
        rank = dist.get_rank()
        metas: list | None = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(meta, metas, dst=0)
        out: list = [None, {}, {}]
        if rank == 0:
            try:
                copies = _plan(arch, metas, self.order)
                out[1:] = spread_plan(copies) if spread else _at_rank_0(copies)
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                out[0] = f"{type(e).__name__}: {e}"
        dist.broadcast_object_list(out, src=0)
        if out[0] is not None:
            raise ValueError(f"the model's tensors cannot be streamed whole: {out[0]}")
        self.plan: dict[str, list[Piece]] = out[1]
        """canonical name -> the pieces it is made whole from (one copy's, by TP rank)."""
        self.collector: dict[str, int] = out[2]
        """The rank each canonical tensor is made whole on: global rank 0, or, `spread`, one of
        the ranks holding a piece of it (in any DP replica), chosen so that each rank collects
        about the same bytes (`spread_plan`)."""
        self.dtype: torch.dtype = getattr(
            torch, next(iter(self.plan.values()))[0].dtype.removeprefix("torch.")
        )
        """The parameters' one dtype."""

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """On each collector (`collector`), `(canonical name, whole tensor)` of its tensors in
        canonical order (a tensor it holds whole is its live parameter, not a copy: done with
        before the next update); every other piece is sent to its tensor's collector. Closed
        early (`contextlib.closing`), a collector receives and drops the rest, so that no
        sender waits."""
        mine = {n: p.detach() for n, _, p in local_params(self.chunks) if replica(p) is not None}
        done = 0
        try:
            for name in self.order:
                parts = self._take(name, mine)
                done += 1  # (received: a merge that fails below must not receive them again)
                if parts is not None:
                    yield name, _merge(self.arch, name, self.plan[name][0].dim, parts)
        except BaseException:  # closed early, or a failure here: the senders must not wait
            with contextlib.suppress(Exception):  # (a broken group: the first error stands)
                for name in self.order[done:]:
                    self._take(name, mine)
            raise

    def _take(self, name: str, mine: dict) -> list[torch.Tensor] | None:
        """This rank's part in tensor `name`: its collector receives the pieces (returns them,
        by TP rank); a rank that holds one of them sends it (host: gloo, see the module doc)."""
        if self.collector[name] == dist.get_rank():
            return [self._piece(x, mine, name) for x in self.plan[name]]
        if any(x.src == dist.get_rank() for x in self.plan[name]):
            dist.send(mine[name].cpu().contiguous(), dst=self.collector[name])
        return None

    def _piece(self, x: Piece, mine: dict, name: str) -> torch.Tensor:
        if x.src == dist.get_rank():
            return mine[name].cpu()
        buf = torch.empty(x.shape, dtype=self.dtype)
        dist.recv(buf, src=x.src)
        return buf


def _name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


class Piece(NamedTuple):
    """One rank's TP piece of a canonical tensor."""

    src: int
    """Global rank that sends it."""
    dim: int
    """TP partition dim, -1 = whole."""
    tp_rank: int
    tp_size: int
    shape: tuple[int, ...]
    dtype: str


def _plan(arch: ModelArch, metas: list[list], order: list[str]) -> dict[str, dict[int, list]]:
    """canonical name -> {DP replica: its pieces sorted by TP rank}; raises naming the tensor
    when a piece is missing, doubled or inconsistent, or a tensor has no HF name."""
    pieces: dict[str, dict[int, list[Piece]]] = {}
    where: dict[str, str] = {}
    for src, meta in enumerate(metas):
        for name, local_name, dim, tp, r, shape, dtype, copy in meta:
            pieces.setdefault(name, {}).setdefault(copy, []).append(
                Piece(src, dim, r, tp, shape, dtype)
            )
            where[name] = f"rank {src} {local_name!r}"
    extra = sorted(set(pieces) - set(order))
    if extra:
        raise ValueError(
            f"tensor(s) {extra[:4]} (e.g. {where[extra[0]]}) have no {arch.family} HF mapping"
        )
    plan = {}
    for name in order:
        plan[name] = {}
        by_copy = pieces.get(name, {})
        by_copy.setdefault(0, [])  # (replica 0 must be whole: the export reads it)
        for copy, found in sorted(by_copy.items()):
            got = sorted(found, key=lambda x: x.tp_rank)
            tp = got[0].tp_size if got else 1
            layouts = {(x.dim, x.tp_size) for x in got}
            if [x.tp_rank for x in got] != list(range(tp)) or len(layouts) != 1:
                raise ValueError(
                    f"canonical tensor {name!r}: pieces (rank, tp_rank) "
                    f"{[(x.src, x.tp_rank) for x in got]}, expected exactly one per TP rank "
                    f"0..{tp - 1} on DP rank {copy}"
                )
            plan[name][copy] = got
    dtypes = sorted({x.dtype for v in plan.values() for c in v.values() for x in c})
    if len(dtypes) != 1:
        raise ValueError(f"parameters have several dtypes {dtypes}; the export writes one")
    return plan


def _at_rank_0(copies: dict[str, dict[int, list]]) -> tuple[dict, dict]:
    """(plan, collector): DP replica 0's pieces of every tensor, each made whole on rank 0."""
    return {n: c[0] for n, c in copies.items()}, dict.fromkeys(copies, 0)


def spread_plan(copies: dict[str, dict[int, list]]) -> tuple[dict, dict]:
    """(plan, collector): each tensor, in canonical order, made whole on the rank holding a
    piece of it (in any DP replica) that has collected the fewest bytes so far (ties: the lowest
    rank), from the pieces of that rank's replica. Every rank that holds pieces shares the
    sending: the stages of a pipeline, and within a stage its TP ranks and DP replicas."""
    load: dict[int, int] = {}
    plan, collector = {}, {}
    for name, by_copy in copies.items():
        numel = sum(math.prod(x.shape) for x in by_copy[0])
        _, rank, copy = min(
            (load.get(x.src, 0), x.src, c) for c, pieces in by_copy.items() for x in pieces
        )
        plan[name], collector[name] = by_copy[copy], rank
        load[rank] = load.get(rank, 0) + numel
    return plan, collector


def _merge(arch: ModelArch, name: str, dim: int, parts: list[torch.Tensor]) -> torch.Tensor:
    """The canonical tensor from its TP pieces (vocab padding rows cut)."""
    t = parts[0] if len(parts) == 1 else merge_tp(name, parts, dim, gdn_tp_parts(arch, name))
    if name in VOCAB_PARAMS:
        t = t[: arch.vocab_size]
    return t
