"""What a trajectory and the engine's side exchange, whatever the scheduler: a trajectory thread
asks for its next turn (`TurnRequest`) and waits for it (`TurnResult`); `TurnBatcher` is the
trajectory side the schedulers share (`megarl.rollout.multi_turn.waves`,
`megarl.rollout.multi_turn.stream`), which answer the turns on the thread that owns the engine.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class TurnRequest:
    """One turn to sample: from the trajectory's whole token sequence so far."""

    ids: list[int]
    seed: int
    max_tokens: int


@dataclass(frozen=True)
class TurnResult:
    ids: list[int]
    """The sampled tokens (the stop token included when one ended the turn)."""
    logprobs: list[float]
    """The sampler's logprob of each."""
    finish_reason: str
    """"stop" or "length" (the turn's max_tokens)."""
    version: int | list[int] = 0
    """The policy version that sampled the turn (separate engines; 0 otherwise), or one per
    token when a weight update reached the turn while it generated (in flight, `stream`)."""


class Client:
    """A trajectory's handle in the batcher (read its flags under `WaveBatcher.lock`)."""

    def __init__(self) -> None:
        self.request: TurnRequest | None = None
        self.asked_at = 0.0
        self.result: TurnResult | None = None
        self.deadline: float | None = None
        self.done = False
        self.timed_out = False
        self._answered = threading.Event()


class TurnBatcher:
    """The trajectory side shared by the schedulers (`WaveBatcher`, and
    `megarl.rollout.multi_turn.stream.StreamBatcher`): trajectories register, ask for turns,
    mark their environment time and finish; a subclass's `serve` answers the turns."""

    def __init__(self, wait_s: float, clock: Callable[[], float] = time.monotonic):
        self.wait_s = wait_s
        self.clock = clock
        self.lock = threading.Condition()
        self._clients: list[Client] = []
        self.waves: list[int] = []
        """The number of turns in each batch served so far."""

    def client(self) -> Client:
        """Register a trajectory (before `serve` starts)."""
        c = Client()
        with self.lock:
            self._clients.append(c)
        return c

    def ask(self, client: Client, request: TurnRequest) -> TurnResult:
        """The next turn of `client`'s trajectory (blocks until it is generated)."""
        with self.lock:
            client._answered.clear()
            client.request, client.asked_at = request, self.clock()
            self.lock.notify_all()
        client._answered.wait()
        return client.result

    @contextmanager
    def busy(self, client: Client, timeout_s: float):
        """Around environment code: past `timeout_s` the trajectory is abandoned."""
        with self.lock:
            client.deadline = self.clock() + timeout_s
            self.lock.notify_all()
        try:
            yield
        finally:
            with self.lock:
                client.deadline = None

    def finish(self, client: Client) -> None:
        """The trajectory is over (it asks for nothing more)."""
        with self.lock:
            client.done = True
            self.lock.notify_all()

    def _expire(self, now: float) -> None:
        """Abandon the trajectories past their deadline (call under the lock)."""
        for c in self._clients:
            if not c.done and c.deadline is not None and now > c.deadline:
                c.done = c.timed_out = True

    def _wave_or_wait(self, live: list[Client], now: float) -> list[Client] | None:
        """The asking clients once a wave is due: every `live` trajectory asked, or `wait_s`
        passed since the first asked. Otherwise wait on the lock until then, the next deadline
        or a notify, and return None (call under the lock, in a loop)."""
        pending = [c for c in live if c.request is not None]
        wake = math.inf
        if pending:
            first = min(c.asked_at for c in pending)
            if len(pending) == len(live) or now - first >= self.wait_s:
                return pending
            wake = first + self.wait_s
        deadlines = [c.deadline for c in live if c.deadline is not None]
        wake = min([wake, *deadlines])
        self.lock.wait(None if wake == math.inf else max(wake - now, 1e-3))
        return None
