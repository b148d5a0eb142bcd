"""The weights in buckets over a link (`megarl.distributed.link`): a sender packs HF tensors into
flat buffers of the engine dtype and broadcasts them, a few in flight; the engines receive every
sender's buckets at once and read the tensors back out. Both sides lay a bucket out from the same
list of (name, shape) (`bucket_layout`).
"""

from __future__ import annotations

import math
import time

import torch

from megarl.distributed.link import Broadcasts, broadcast


def bucket_layout(tensors: list[tuple[str, torch.Tensor]], limit: int) -> list[list]:
    """`tensors` in order, cut into buckets of at most `limit` bytes (a larger tensor alone in
    its own): per bucket, the (name, shape) of each tensor in it. Both sides lay out a bucket's
    flat buffer from this (`send_buckets`, `bucket_items`)."""
    buckets, size = [[]], 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if buckets[-1] and size + nbytes > limit:
            buckets.append([])
            size = 0
        buckets[-1].append((name, tuple(t.shape)))
        size += nbytes
    return buckets


IN_FLIGHT = 4
"""Buckets `send_buckets` holds at once, the one it packs included: the sender holds at most
these, not the model."""


def bucket_numel(bucket: list) -> int:
    """Elements of one bucket of `bucket_layout`: the length of its flat buffer."""
    return sum(math.prod(shape) for _, shape in bucket)


def send_buckets(pg, tensors, buckets: list, dtype: torch.dtype, sums, sender: int = 0) -> float:
    """Member 0 (trainer rank `sender`): broadcast `tensors` ((name, tensor) pairs, in the order
    and shapes `buckets` lays out; an iterable, consumed as the buckets are packed), each
    bucket packed into one flat buffer of `dtype` and added to `sums` (a
    `megarl.rollout.sync.checksum.FamilySums`) while the buckets before it are on the wire; returns
    the seconds spent packing (the rest of the time is the wire's)."""
    sending, it, packing = Broadcasts(pg, sender), iter(tensors), 0.0
    for bucket in buckets:
        sending.wait(keep=IN_FLIGHT - 1)  # (bounded memory: the model may not fit twice)
        t0 = time.perf_counter()
        flat = torch.empty(bucket_numel(bucket), dtype=dtype)
        offset = 0
        for want, shape in bucket:
            name, t = next(it)
            if name != want or tuple(t.shape) != shape:  # the engines would load it elsewhere
                raise ValueError(
                    f"tensor {name!r} {tuple(t.shape)} sent where the engines expect {want!r} "
                    f"{shape}"
                )
            packed = flat[offset : offset + t.numel()].view(t.shape)
            packed.copy_(t)
            sums.add(name, packed)
            offset += t.numel()
        packing += time.perf_counter() - t0
        sending.start(flat)
    sending.wait()
    return packing


def receive_buckets(sources: list, dtype: torch.dtype) -> list[torch.Tensor]:
    """The engines: every bucket each sender's `send_buckets` sends, as flat buffers in the
    order of `sources` ((trainer rank, its link, its buckets) per sender; all received before
    this returns). Every link's receives are posted before any is waited for, so that the
    senders send at once."""
    flats, receiving = [], []
    for sender, pg, buckets in sources:
        receiving.append(Broadcasts(pg, sender))
        for b in buckets:
            flats.append(torch.empty(bucket_numel(b), dtype=dtype))
            receiving[-1].start(flats[-1])
    for r in receiving:
        r.wait()
    return flats


def bucket_items(buckets: list, flats: list[torch.Tensor]):
    """(name, tensor) of every tensor in the received `flats`, in the order sent (views)."""
    for bucket, flat in zip(buckets, flats, strict=True):
        offset = 0
        for name, shape in bucket:
            yield name, flat[offset : offset + math.prod(shape)].view(shape)
            offset += math.prod(shape)


def timed_broadcasts(pg, buckets: list, dtype: torch.dtype, sender: int = 0) -> float:
    """A sender: seconds to broadcast its buckets as plain buffers (no checksums, no loading),
    the floor a sync is measured against; the engines take them with `receive_buckets`, in
    the same order as the sync's."""
    flats = [torch.zeros(bucket_numel(b), dtype=dtype) for b in buckets]
    t0 = time.perf_counter()
    for flat in flats:
        broadcast(pg, flat, sender)
    return time.perf_counter() - t0
