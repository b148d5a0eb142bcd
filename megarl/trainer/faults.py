"""A run that survives its cluster: stop requests, time-based checkpoints, a hang watchdog.

Assumes SPMD ranks of one torch.distributed job that reach every step boundary together (the
loop's collectives make them), a run directory that every rank sees, and POSIX signals.
`RunGuard` is what the loop calls: `begin_step` at the top of a step, `end_step` after its
metrics; everything else here serves those two calls. docs/preemption.md is the user's view.

Stop requests. SIGTERM and SIGUSR1 only append to a list (`install_stop_signals`, called at
process start), so a signal can never interrupt a checkpoint's commit; the stop file
`RUN/STOP` (checked by rank 0) asks the same without a signal. At each step boundary the ranks
agree with one all-reduce (MAX) of [signal, stop file, time-based save due, time limit near],
so a request that reached one rank stops them all: they write a checkpoint of the finished step,
rank 0 writes `RUN/stopped.json` (step, reason, checkpoint, step and save seconds; what a batch
script reads to requeue the job, since torchrun reports any worker status but 0 as its own 1),
and `RunStopped` ends the run with `EXIT_STOPPED`. After every save the stop flags are agreed
once more, so a request that came during the save stops the run without another step. A request
before the first step stops without a checkpoint. While `RUN/STOP` exists a run does not start:
it stops before building anything (seconds, so a launcher that restarts it on a non-zero status
gives up quickly) and keeps the `stopped.json` of the attempt that saved; remove the stop file
to continue. A run that does start removes an earlier `stopped.json`.

Time. The clock starts when the process started (Linux: /proc/self/stat), not after setup.
`trainer.save_every_minutes` writes a checkpoint at the first boundary that long after the last
one; `trainer.time_limit_minutes` stops with a checkpoint at the first boundary where the time
left is shorter than the longest step plus the longest save so far (one more step's time while
nothing was saved yet). Each rank decides on its own clock; the all-reduce makes it one answer.

Hangs. With `trainer.step_timeout_minutes`, a daemon thread (`HangWatchdog`) is armed at each
step's start and disarmed after its checkpoint (the first step of a process gets twice the time:
it includes one-time warm-up such as vLLM's first generation). When a step overruns, it writes
every thread's Python stack (`faulthandler.dump_traceback`) with the step and the stage (the
loop's `StageTimer`) to `RUN/hang-rank{R}.txt`, logs the same, waits `HANG_GRACE_S` so that the
other ranks' watchdogs, which fire within the ranks' skew at the step start (milliseconds: the
previous step ended with collectives), dump too before a peer's exit breaks their collectives,
then `os._exit`s with `EXIT_HUNG`. It fires only while the main thread is still inside the
loop that armed it: a run already unwinding an exception is not reported as hung. The process
groups' collective timeout (`collective_timeout`: NCCL's watchdog aborts a collective that waits
longer) is set `COLLECTIVE_MARGIN` above the step timeout, so the watchdog, which names the
stage, fires first.

Dead ranks. torchrun `--max-restarts` starts the worker group again after a failure, and megarl
resumes from the newest checkpoint. Each attempt joins its process group under keys of its own
in torchrun's rendezvous store (`megarl.distributed.process_group.attempt_store`), so restarted
workers never meet the dead attempt's addresses.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from megarl.checkpoint.files import latest_checkpoint
from megarl.distributed.process_group import init_distributed

log = logging.getLogger("megarl")

EXIT_STOPPED = 4
"""Exit status: stopped early on request (signal, stop file, time limit); the newest checkpoint
holds the last finished step, and the same command with `--out RUN` continues the run (`megarl
train` prints it)."""
EXIT_HUNG = 5
"""Exit status: the hang watchdog ended a step that overran trainer.step_timeout_minutes."""
STOP_FILE = "STOP"
STOPPED_FILE = "stopped.json"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
COLLECTIVE_MARGIN = timedelta(minutes=5)
HANG_GRACE_S = 5.0

_received: list[int] = []  # stop signals received so far (appended by the handler, nothing else)


def _on_stop_signal(signum, frame) -> None:
    _received.append(signum)


def install_stop_signals() -> None:
    """Make SIGTERM / SIGUSR1 a stop request instead of the end of the process. Idempotent;
    call it again after setup in case a library installed its own handler (main thread only,
    as Python requires; elsewhere nothing is installed)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) is not _on_stop_signal:
            signal.signal(sig, _on_stop_signal)


def process_start() -> float:
    """`time.monotonic()` at the start of this process (Linux: /proc/self/stat; elsewhere the
    time this module was first imported, early in `megarl train`)."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - started_ticks / os.sysconf("SC_CLK_TCK")
        return time.monotonic() - max(age, 0.0)
    except (OSError, ValueError, IndexError):
        return _IMPORTED


_IMPORTED = time.monotonic()


def collective_timeout(trainer) -> timedelta | None:
    """Timeout for the collectives of every process group: `COLLECTIVE_MARGIN` above
    `trainer.step_timeout_minutes` (a collective waits at most for the slowest rank's step);
    None when the watchdog is off (torch's and megatron's defaults stay)."""
    if not trainer.step_timeout_minutes:
        return None
    return timedelta(minutes=trainer.step_timeout_minutes) + COLLECTIVE_MARGIN


class RunStopped(Exception):
    """The run stopped on request after its checkpoint (or before its first step, with none);
    exit with `EXIT_STOPPED`."""


# ------------------------------------------------------------------ when to save, when to stop
class Deadlines:
    """The time rules of `RunGuard`, on an injectable clock (seconds, monotonic)."""

    def __init__(self, trainer, *, start: float) -> None:
        self.save_every_s = trainer.save_every_minutes * 60.0
        self.limit_s = trainer.time_limit_minutes * 60.0
        self.start = start
        self.last_save = start
        self.longest_step = 0.0
        self.longest_save: float | None = None

    def step_done(self, seconds: float) -> None:
        self.longest_step = max(self.longest_step, seconds)

    def saved(self, seconds: float, now: float) -> None:
        self.longest_save = max(self.longest_save or 0.0, seconds)
        self.last_save = now

    def save_due(self, now: float) -> bool:
        return self.save_every_s > 0 and now - self.last_save >= self.save_every_s

    def time_up(self, now: float) -> bool:
        """Whether one more step and its save may not fit before the time limit."""
        if self.limit_s <= 0:
            return False
        save = self.longest_save if self.longest_save is not None else self.longest_step
        return now - self.start + self.longest_step + save > self.limit_s


@dataclass(frozen=True)
class _Agreed:
    """The stop flags every rank agreed on (MAX over ranks)."""

    signal: int  # the largest stop signal number received by any rank, 0 = none
    stop_file: bool
    save_due: bool = False
    time_up: bool = False

    def reason(self, out_dir: str, limit_minutes: float) -> str | None:
        if self.signal:
            return f"{signal.Signals(self.signal).name} received"
        if self.stop_file:
            return f"{os.path.join(out_dir, STOP_FILE)} exists"
        if self.time_up:
            return f"trainer.time_limit_minutes={limit_minutes:g} is near"
        return None


class RunGuard:
    """Stop requests, time-based saves and the hang watchdog of one training process (module
    doc). `start` before the run is built; then `begin_step` / `end_step` around each step."""

    def __init__(
        self,
        trainer,
        out_dir: str,
        *,
        clock: Callable[[], float] = time.monotonic,
        start: float | None = None,
    ) -> None:
        """clock / start: the seconds the time rules read, and the process start on that clock
        (default: `time.monotonic` and `process_start()`; tests pass a fake clock)."""
        import torch.distributed as dist

        self.trainer = trainer
        self.out_dir = out_dir
        self.clock = clock
        self.rank = dist.get_rank()
        self.deadlines = Deadlines(trainer, start=process_start() if start is None else start)
        self.watchdog = None
        if trainer.step_timeout_minutes:
            self.watchdog = HangWatchdog(
                trainer.step_timeout_minutes * 60.0, out_dir, self.rank, clock=clock
            )
        self._timer = None
        self._started = False
        self._step_start = 0.0
        self._where: str | None = None  # a stage of the guard's own: the checkpoint save

    @classmethod
    def start(cls, trainer, out_dir: str, **kwargs) -> RunGuard:
        """Install the stop signals and join the process group (collective). Raise `RunStopped`
        when a stop is already requested; it keeps an earlier attempt's `stopped.json` (or
        writes one), so a launcher that restarted the run still sees why it stopped. Otherwise
        remove that file: this attempt runs."""
        install_stop_signals()
        init_distributed(collective_timeout(trainer))
        guard = cls(trainer, out_dir, **kwargs)
        marker = os.path.join(out_dir, STOPPED_FILE)
        why = guard._agree().reason(out_dir, trainer.time_limit_minutes)
        if why:
            if guard.rank == 0 and not os.path.exists(marker):
                guard._write_stopped(None, f"{why} before setup", None)
            remove = " (remove it to continue the run)" if STOP_FILE in why else ""
            raise RunStopped(f"stopped before setup: {why}{remove}; nothing was written")
        if guard.rank == 0 and os.path.exists(marker):
            os.remove(marker)
        return guard

    # ------------------------------------------------------------------ the loop's two calls
    def begin_step(self, run, timer) -> None:
        """At the top of each step: arm the watchdog (naming `timer`'s stage when it fires).
        The first call also stops a run asked to stop during setup, without a checkpoint."""
        first = not self._started
        if first:
            self._started = True
            self._timer = timer
            install_stop_signals()  # vLLM or another library may have replaced the handlers
            why = self._agree().reason(self.out_dir, self.trainer.time_limit_minutes)
            if why:
                self._stop(run, f"{why} before the first step", None)
        self._step_start = self.clock()
        if self.watchdog is not None:
            scale = 2.0 if first else 1.0  # warm-up (module doc)
            self.watchdog.arm(run.step + 1, self._stage, owner=sys._getframe(1), scale=scale)

    def end_step(self, run) -> None:
        """After the step's metrics: write a checkpoint when one is due (trainer.save_every,
        save_every_minutes, the last step, a stop request) and raise `RunStopped` after it
        when a stop was requested (collective: every rank calls it at every step)."""
        now = self.clock()
        self.deadlines.step_done(now - self._step_start)
        agreed = self._agree(
            save_due=self.deadlines.save_due(now), time_up=self.deadlines.time_up(now)
        )
        last = run.step >= self.trainer.steps
        why = None if last else agreed.reason(self.out_dir, self.trainer.time_limit_minutes)
        every = self.trainer.save_every
        path = None
        if last or why or agreed.save_due or (every and run.step % every == 0):
            path = self._save(run)
            if not (last or why):  # a request that came while the checkpoint was written
                why = self._agree().reason(self.out_dir, self.trainer.time_limit_minutes)
        if self.watchdog is not None:
            self.watchdog.disarm()
        if why:
            self._stop(run, why, path)

    # ------------------------------------------------------------------ helpers
    def _stage(self) -> str:
        if self._where is not None:
            return self._where
        current = self._timer.current if self._timer is not None else None
        return current or "between stages"

    def _agree(self, *, save_due: bool = False, time_up: bool = False) -> _Agreed:
        """One all-reduce (MAX) of this rank's stop flags."""
        import torch
        import torch.distributed as dist

        stop_file = self.rank == 0 and os.path.exists(os.path.join(self.out_dir, STOP_FILE))
        local = [max(_received, default=0), stop_file, save_due, time_up]
        # a host tensor: on GPU the default group routes CPU tensors through gloo
        flags = torch.tensor([float(x) for x in local], dtype=torch.float64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        sig, stop, save, up = (int(x) for x in flags.tolist())
        return _Agreed(sig, bool(stop), bool(save), bool(up))

    def _save(self, run) -> str:
        self._where = "checkpoint"
        start = self.clock()
        path = run.save()
        end = self.clock()
        self.deadlines.saved(end - start, end)
        self._where = None
        if self.rank == 0:
            log.info(
                "step %d: checkpoint written in %.1f s (longest step so far %.1f s; a stop "
                "request needs about their sum as lead time)",
                run.step,
                end - start,
                self.deadlines.longest_step,
            )
        return path

    def _write_stopped(self, step: int | None, why: str, path: str | None) -> None:
        """`RUN/stopped.json` (rank 0): what a batch script reads to requeue the job."""
        d = self.deadlines
        record = {
            "step": step,
            "reason": why,
            "checkpoint_written": path is not None,
            "checkpoint": path or latest_checkpoint(self.out_dir),
            "longest_step_s": round(d.longest_step, 3),
            "longest_save_s": None if d.longest_save is None else round(d.longest_save, 3),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        os.makedirs(self.out_dir, exist_ok=True)
        _write_json(os.path.join(self.out_dir, STOPPED_FILE), record)

    def _stop(self, run, why: str, path: str | None) -> None:
        import torch.distributed as dist

        if self.rank == 0:
            self._write_stopped(run.step, why, path)
        run.close()  # metrics, wandb and tensorboard flushed
        dist.barrier()
        if path is None:
            raise RunStopped(f"stopped at step {run.step}: {why}; no new checkpoint written")
        raise RunStopped(f"stopped at step {run.step}: {why}; checkpoint {path} written")


def _write_json(path: str, data: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


# ------------------------------------------------------------------ hang watchdog
class HangWatchdog:
    """A daemon thread that ends the process when an armed step overruns (module doc)."""

    def __init__(
        self,
        timeout_s: float,
        out_dir: str,
        rank: int,
        *,
        grace_s: float = HANG_GRACE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout_s = timeout_s
        self.path = os.path.join(out_dir, f"hang-rank{rank}.txt")
        self.rank = rank
        self.grace_s = grace_s
        self.clock = clock
        self._cond = threading.Condition()
        self._deadline: float | None = None
        self._limit = timeout_s
        self._step = 0
        self._stage: Callable[[], str] = lambda: "?"
        self._owner = None
        self._thread: threading.Thread | None = None

    def arm(self, step: int, stage: Callable[[], str], *, owner=None, scale: float = 1.0) -> None:
        """Start the clock of `step` (`scale` x the timeout); `stage()` names where it is when
        it fires. `owner`: the frame of the loop (it fires only while that frame is on the main
        thread's stack)."""
        with self._cond:
            self._limit = self.timeout_s * scale
            self._deadline = self.clock() + self._limit
            self._step, self._stage, self._owner = step, stage, owner
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._watch, name="megarl-hang-watchdog", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self._deadline, self._owner = None, None
            self._cond.notify()

    def _watch(self) -> None:
        while True:
            with self._cond:
                while self._deadline is None:
                    self._cond.wait()
                left = self._deadline - self.clock()
                if left > 0:
                    self._cond.wait(min(left, 60.0))
                    continue
                if not self._owner_running():
                    self._deadline, self._owner = None, None
                    continue
                step, stage = self._step, self._stage()
            self._fire(step, stage)

    def _owner_running(self) -> bool:
        if self._owner is None:
            return True
        frame = sys._current_frames().get(threading.main_thread().ident)
        while frame is not None:
            if frame is self._owner:
                return True
            frame = frame.f_back
        return False

    def _fire(self, step: int, stage: str) -> None:
        minutes = self.timeout_s / 60.0
        header = (
            f"megarl: rank {self.rank}: step {step} ran longer than {self._limit:.0f} s "
            f"(trainer.step_timeout_minutes={minutes:g}) in stage {stage!r}; the Python stack "
            "of every thread follows (most recent call first)\n\n"
        )
        try:
            tmp = f"{self.path}.tmp"
            with open(tmp, "w") as f:
                f.write(header)
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
            os.replace(tmp, self.path)
            where = self.path
        except OSError as e:  # the stacks still go to stderr
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            where = f"stderr ({self.path}: {e})"
        log.error(
            "rank %d: step %d hung in stage %r for over %.0f s (trainer.step_timeout_minutes="
            "%g); stacks in %s; exiting with status %d",
            self.rank,
            step,
            stage,
            self._limit,
            minutes,
            where,
            EXIT_HUNG,
        )
        for handler in logging.getLogger().handlers:
            handler.flush()
        time.sleep(self.grace_s)
        os._exit(EXIT_HUNG)
