"""Continuous generation for many trajectories at once (`env.scheduler: stream`), the
alternative to waves (`megarl.rollout.multi_turn.waves`) behind the same trajectory-side API
(`client`, `ask`, `busy`, `finish`).

Every trajectory runs in a thread of its own, as with waves; the thread that owns the engine
runs vLLM's scheduler one step at a time. Before each step it submits every turn asked since the
last step, and after it answers every turn that finished in it. So a trajectory's next turn
starts as soon as its environment has answered, while the other trajectories' turns are still
decoding: no turn waits for a wave to fill or for the slowest sample of the previous one.

The price is determinism: which requests share a batch, and so the last bits of their logits,
depends on the threads' timing. The sampled tokens of a seeded request are the same whenever
its logits are; waves give the same batches on every run whatever the timing (with fast
environments), streams do not promise that. While the engine is idle (the first step) the
batcher waits, like a wave, for every live trajectory to ask or `wait_s`; after each step it
waits (at most `wait_s`) for the trajectories it just answered to ask again or enter their
environment, so a fast environment's next turn joins the next step. Time limits (`busy`) are
those of waves.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from megarl.rollout.multi_turn.batcher import Client, TurnBatcher, TurnRequest, TurnResult


class StreamBatcher(TurnBatcher):
    """Serves the turns of many trajectories by continuous batching (module docstring).

    `submit(key, request)` queues a turn in the engine, `step()` runs one scheduler step and
    returns `(key, TurnResult)` of the turns it finished, `has_unfinished()` says whether any
    submitted turn is still queued or running (`megarl.rollout.engine.engine.RolloutEngine.submit`).
    `waves` records the turns submitted before each step that submitted any.
    """

    def __init__(
        self,
        submit: Callable[[str, TurnRequest], None],
        step: Callable[[], list[tuple[str, TurnResult]]],
        has_unfinished: Callable[[], bool],
        wait_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ):
        super().__init__(wait_s, clock)
        self._submit, self._step, self._has_unfinished = submit, step, has_unfinished
        self._in_flight: dict[str, Client] = {}
        self._turns = 0

    # ---------------------------------------------------------------- engine side
    def serve(self) -> None:
        """Step the engine until every trajectory is done or abandoned (call from the thread
        that owns the engine)."""
        while True:
            new = self._collect()
            if new is None:
                return
            for c in new:
                key = f"turn-{self._turns}"
                self._turns += 1
                self._in_flight[key] = c
                self._submit(key, c.request)
                c.request = None
            if new:
                self.waves.append(len(new))
            answered = []
            for key, result in self._step():
                c = self._in_flight.pop(key)
                c.result = result
                answered.append(c)
                c._answered.set()
            self._settle(answered)
            if self._in_flight and not self._has_unfinished():
                raise RuntimeError(
                    f"the engine finished without answering turns {sorted(self._in_flight)}"
                )

    def _settle(self, answered: list[Client]) -> None:
        """Let the trajectories just answered reach their next request (or their environment,
        or their end) before the next step, for at most `wait_s`: a fast environment's next
        turn then joins the very next step instead of a later one, whatever the threads'
        timing."""
        if not answered:
            return
        until = self.clock() + self.wait_s
        with self.lock:
            while True:
                now = self.clock()
                moving = [
                    c for c in answered if not c.done and c.request is None and c.deadline is None
                ]
                if not moving or now >= until:
                    return
                self.lock.wait(until - now)

    def _collect(self) -> list[Client] | None:
        """The turns asked since the last step (while the engine is idle: once every live
        trajectory asked, or `wait_s` after the first); None when every trajectory is over."""
        with self.lock:
            while True:
                now = self.clock()
                self._expire(now)
                live = [c for c in self._clients if not c.done]
                if not live and not self._in_flight:
                    return None
                if self._in_flight:
                    return [c for c in live if c.request is not None]
                # the engine is idle: like a wave, the first step waits for every live
                # trajectory to ask, or wait_s after the first request
                wave = self._wave_or_wait(live, now)
                if wave is not None:
                    return wave
