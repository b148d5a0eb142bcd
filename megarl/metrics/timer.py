"""Wall-clock seconds per named stage of a training step.

    timer = StageTimer()
    with timer("rollout"):
        ...
    metrics["time_s"] = timer.step_times()   # {"rollout": 1.93, ...}
    timer.reset()

On GPU the clock is read after `torch.cuda.synchronize()` (at entry and exit), so a stage is
charged for the kernels it launched rather than for whatever the next stage waits on. This costs
the overlap between stages, which is what a per-stage breakdown measures anyway. On CPU (or with
`sync=False`) it is plain `time.perf_counter()`. Stages may nest; each accumulates its own time,
and a stage entered several times in a step accumulates all of them. `current` names the stage
the loop is in now (read by the hang watchdog from its own thread, `megarl.trainer.faults`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from megarl.distributed import device


class StageTimer:
    """Accumulates seconds per stage name until `reset()`."""

    def __init__(self, *, sync: bool | None = None) -> None:
        """sync: synchronise CUDA around each reading; None = when megarl runs on a GPU."""
        if sync is None:
            sync = device.use_gpu()
        self.sync = sync
        self._times: dict[str, float] = {}
        self._active: list[str] = []

    def _now(self) -> float:
        if self.sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self._times.setdefault(name, 0.0)  # keeps the order of first entry
        self._active.append(name)
        start = self._now()
        try:
            yield
        finally:
            self._times[name] += self._now() - start
            self._active.pop()

    @property
    def current(self) -> str | None:
        """The stage being timed now ('train/inner' when nested), None between stages."""
        return "/".join(self._active) or None

    def step_times(self) -> dict[str, float]:
        """Seconds per stage since the last reset, in order of first use."""
        return dict(self._times)

    def reset(self) -> None:
        self._times.clear()
