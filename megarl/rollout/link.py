"""Messages and tensors over the link between trainer rank 0 and the engine ranks
(`megarl.distributed.placement`): a raw gloo process group, so point-to-point `send` / `recv`
and `broadcast` are called on the group object itself, member 0 being trainer rank 0. Weights
also travel from other trainer ranks, each over a link of its own whose member 0 it is
(`placement.sender_link`): broadcasts only.

An object travels as its pickle: an int64 length, then the bytes. Sends go through an `Outbox`
and complete in the background: gloo completes a send only when the peer posts the matching
receive, so two members that each waited for their own send to the other (the trainer sending
the next request or a weight update while the engine sends the samples it just made) would wait
for ever. Receives block. A failure of the group (a peer that died, a timeout) is raised as
`LinkError` naming the member, so a job whose engine rank is gone ends with that name rather
than a gloo socket error.
"""

from __future__ import annotations

import math
import pickle
import queue
import threading
import time

import torch
import torch.distributed as dist

_TAG = 7


class LinkError(RuntimeError):
    """The link to a member failed (the member died, or did not answer in time)."""


def _member(k: int) -> str:
    return "trainer rank 0" if k == 0 else f"engine {k - 1} (rollout rank {k - 1})"


def _wait(work, what: str, peer: int) -> None:
    """Wait for `work`: a posted operation, or a function that posts it (gloo raises at either)."""
    try:
        (work() if callable(work) else work).wait()
    except RuntimeError as e:
        raise LinkError(f"{what} {_member(peer)} failed: {e}") from e


class Outbox:
    """This member's sends over `pg`, in flight until their receivers take them (module doc);
    each keeps its buffers alive until it completes."""

    def __init__(self, pg):
        self.pg = pg
        self._flying: list[tuple[object, torch.Tensor, int]] = []

    def send(self, obj, dst: int) -> None:
        """Post `obj` to member `dst`; raises a `LinkError` of an earlier send that failed."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        for t in (size, data):  # gloo keeps the order of sends to one member on one tag
            try:
                self._flying.append((self.pg.send([t], dst, _TAG), t, dst))
            except RuntimeError as e:
                raise LinkError(f"sending to {_member(dst)} failed: {e}") from e
        self._collect(block=False)

    def flush(self) -> None:
        """Wait until every send was received."""
        self._collect(block=True)

    def _collect(self, block: bool) -> None:
        flying = []
        for work, t, dst in self._flying:
            if block or work.is_completed():
                _wait(work, "sending to", dst)  # raises what a failed send raised
            else:
                flying.append((work, t, dst))
        self._flying = flying


def recv_object(pg, src: int):
    size = torch.empty(1, dtype=torch.int64)
    _wait(lambda: pg.recv([size], src, _TAG), "receiving from", src)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    _wait(lambda: pg.recv([data], src, _TAG), "receiving from", src)
    return pickle.loads(data.numpy().tobytes())


class Inbox:
    """The messages member `src` sends to this member, received by a thread of their own, so
    that the member can look for the next one between steps of other work (gloo cannot be
    polled: a posted receive reports completion only from `wait`). The thread stops after the
    message `last(msg)` is true of, or after a failure (raised again by `get`). `prepare(msg)`,
    when given, runs on that thread before the message is handed on: where the member receives
    the broadcasts a message announces, so that the sender's broadcast does not wait for the
    member's other work."""

    def __init__(self, pg, src: int, last, prepare=None):
        self._queue: queue.Queue = queue.Queue()

        def receive() -> None:
            while True:
                try:
                    msg = recv_object(pg, src)
                    if prepare is not None:
                        prepare(msg)
                except Exception as e:  # noqa: BLE001 - raised by `get`, on the member's thread
                    self._queue.put(e)
                    return
                self._queue.put(msg)
                if last(msg):
                    return

        threading.Thread(target=receive, daemon=True, name=f"inbox-{src}").start()

    def get(self, block: bool = True):
        """The next message (None when `block` is false and none has arrived)."""
        try:
            msg = self._queue.get(block=block)
        except queue.Empty:
            return None
        if isinstance(msg, Exception):
            raise msg
        return msg


def broadcast(pg, tensor: torch.Tensor, sender: int = 0) -> None:
    """`tensor` from member 0 (trainer rank `sender`) to every member, in place."""
    Broadcasts(pg, sender).start(tensor).wait()


class Broadcasts:
    """Broadcasts from member 0 (trainer rank `sender`) that run while the caller goes on (gloo
    moves the bytes on its own threads): `start(tensor)` each, then `wait()` for all; the
    tensors must stay untouched until then. A failure raises `LinkError` from `wait`."""

    def __init__(self, pg, sender: int = 0):
        self.pg, self.sender, self.works = pg, sender, []

    def start(self, tensor: torch.Tensor) -> Broadcasts:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        try:
            self.works.append((self.pg.broadcast([tensor], opts), tensor))  # (kept alive)
        except RuntimeError as e:
            raise self._error(e) from e
        return self

    def wait(self, keep: int = 0) -> None:
        """Wait for the oldest broadcasts until at most `keep` are in flight (their tensors
        are then released)."""
        try:
            while len(self.works) > keep:
                work, _ = self.works.pop(0)
                work.wait()
        except RuntimeError as e:
            self.works = []
            raise self._error(e) from e

    def _error(self, e: Exception) -> LinkError:
        if self.pg.rank() == 0:
            who = "engine 0" if self.pg.size() == 2 else f"engines 0-{self.pg.size() - 2}"
            return LinkError(
                f"broadcasting from trainer rank {self.sender} to {who} (rollout ranks) "
                f"failed: {e}"
            )
        return LinkError(f"receiving a broadcast from trainer rank {self.sender} failed: {e}")


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
"""Buckets `send_buckets` keeps on the wire at once: the sender holds at most these, not the
model."""


def bucket_numel(bucket: list) -> int:
    """Elements of one bucket of `bucket_layout`: the length of its flat buffer."""
    return sum(math.prod(shape) for _, shape in bucket)


def send_buckets(pg, tensors, buckets: list, dtype: torch.dtype, sums, sender: int = 0) -> float:
    """Member 0 (trainer rank `sender`): broadcast `tensors` ((name, tensor) pairs, in the order
    and shapes `buckets` lays out; an iterable, consumed as the buckets are packed), each
    bucket packed into one flat buffer of `dtype` and added to `sums` (a
    `megarl.rollout.checksum.FamilySums`) while the buckets before it are on the wire; returns
    the seconds spent packing (the rest of the time is the wire's)."""
    sending, it, packing = Broadcasts(pg, sender), iter(tensors), 0.0
    for bucket in buckets:
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
        sending.wait(keep=IN_FLIGHT)  # (bounded memory: the model may not fit twice)
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
