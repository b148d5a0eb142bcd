"""Messages and tensors over a link between trainer ranks and the engine ranks
(`megarl.distributed.placement.Job`): a raw gloo process group, so point-to-point `send` /
`recv` and `broadcast` are called on the group object itself, member 0 being a trainer rank
(trainer rank 0 on the link that carries messages; weights also travel from other trainer
ranks, each over a link of its own whose member 0 it is: broadcasts only).

An object travels as its pickle: an int64 length, then the bytes. Sends go through an `Outbox`
and complete in the background: gloo completes a send only when the peer posts the matching
receive, so two members that each waited for their own send to the other (the trainer sending
the next request or a weight update while the engine sends the samples it just made) would wait
for ever. Receives block. A failure of the group (a peer that died, a timeout) is raised as
`LinkError` naming the member, so a job whose engine rank is gone ends with that name rather
than a gloo socket error.
"""

from __future__ import annotations

import pickle
import queue
import threading

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
                f"broadcasting from trainer rank {self.sender} to {who} (rollout ranks) failed: {e}"
            )
        return LinkError(f"receiving a broadcast from trainer rank {self.sender} failed: {e}")
