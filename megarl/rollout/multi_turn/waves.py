"""Generation in waves for many trajectories at once: every trajectory (an environment's, or an
agent's session) runs in a thread of its own and asks for its next turn; the thread that owns
the engine serves the waiting requests in one `generate` call per wave.

When a wave starts: as soon as every live trajectory is waiting for the model, or `wait_s` after
the first request of the wave arrived, whichever comes first. So with environments that answer
fast every wave holds every live trajectory (the run is deterministic, whatever the threads'
timing), and a slow one (a tool that sleeps) holds the others back by at most `wait_s`: it
joins a later wave. vLLM's prefix cache keeps the KV blocks of a trajectory's earlier turns
between waves, so a turn prefills only the tokens appended since the last one.

Time limits: a trajectory marks the time it spends in environment code (`busy`); one past its
deadline is abandoned (`Client.timed_out`): the waves go on without it. Python cannot kill a
thread: the abandoned call keeps running in the background and its result is dropped (the
trajectory checks `timed_out` under the batcher's lock before it changes anything).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from megarl.rollout.multi_turn.batcher import Client, TurnBatcher, TurnRequest, TurnResult


class WaveBatcher(TurnBatcher):
    """Serves the turns of many trajectories in waves (module docstring)."""

    def __init__(
        self,
        generate: Callable[[list[TurnRequest]], list[TurnResult]],
        wait_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        super().__init__(wait_s, clock)
        self._generate = generate

    # ---------------------------------------------------------------- engine side
    def serve(self) -> None:
        """Generate waves until every trajectory is done or abandoned (call from the thread
        that owns the engine)."""
        while True:
            wave = self._next_wave()
            if wave is None:
                return
            requests = [c.request for c in wave]
            for c in wave:
                c.request = None
            results = self._generate(requests)
            self.waves.append(len(wave))
            for c, r in zip(wave, results, strict=True):
                c.result = r
                c._answered.set()

    def _next_wave(self) -> list[Client] | None:
        with self.lock:
            while True:
                now = self.clock()
                self._expire(now)
                live = [c for c in self._clients if not c.done]
                if not live:
                    return None
                wave = self._wave_or_wait(live, now)
                if wave is not None:
                    return wave
