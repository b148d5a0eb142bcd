"""`torchrun ... -m tests.fault_worker train ...`: megarl's command line with faults injected at
named points of a run, for tests/test_faults.py (the style of crash_in_save.py: wrappers around
megarl's own functions, installed here before `main`; megarl reads none of this).

The test passes its plan in the environment: FAULT_PLAN, a JSON list of actions, and
FAULT_EVENTS, a directory where each process reports its pid (`pid-rank{R}-attempt{A}`), the
points it reached (`reached-{where}-step{N}-rank{R}`) and its exit status
(`exit-rank{R}-attempt{A}`). A is torchrun's restart count. An action:
  {"where": W, "step": N, "rank": R, "do": D, "attempt": A (default 0), "signal": "SIGTERM"}
W: a stage of the step (rollout, reward, logprobs, advantage, train; entered at its start),
"setup" (right after the run is built, before the first step) or "commit" (rank 0, a
checkpoint's commit point: every file written, not yet renamed into place). D:
  signal           send `signal` to this process, then go on
  signal_later     send it 0.2 s later from another thread (the stage is running by then)
  await_signal     report, then wait until a stop signal arrived (the test sends it)
  await_stop_file  report, then wait until RUN/STOP exists (the test writes it)
  await_kill       report, then sleep until the test kills this process

The `__main__` guard matters: megatron's checkpoint writer starts a multiprocessing manager
whose spawned process imports this module again and must not start a second run.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import threading
import time

WAIT_S = 300.0


def _env() -> tuple[list[dict], str, int, int]:
    plan = json.loads(os.environ.get("FAULT_PLAN", "[]"))
    events = os.environ["FAULT_EVENTS"]
    return (
        plan,
        events,
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
    )


def _touch(path: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(str(time.time()))
    os.replace(path + ".tmp", path)


def _wait(ready, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"fault_worker: waited {WAIT_S:.0f} s for {what}")
        time.sleep(0.05)


def _act(where: str, step: int, out_dir: str | None) -> None:
    from megarl.trainer import faults

    plan, events, rank, attempt = _env()
    for a in plan:
        if (a["where"], a["step"], a["rank"], a.get("attempt", 0)) != (where, step, rank, attempt):
            continue
        sig = getattr(signal, a.get("signal", "SIGTERM"))
        do = a["do"]
        if do == "signal":
            os.kill(os.getpid(), sig)
            continue
        if do == "signal_later":
            threading.Timer(0.2, os.kill, (os.getpid(), sig)).start()
            continue
        before = len(faults._received)
        _touch(os.path.join(events, f"reached-{where}-step{step}-rank{rank}"))
        if do == "await_signal":
            _wait(lambda n=before: len(faults._received) > n, "a signal")
        elif do == "await_stop_file":
            _wait(lambda: os.path.exists(os.path.join(out_dir, faults.STOP_FILE)), "RUN/STOP")
        elif do == "await_kill":
            _wait(lambda: False, "SIGKILL")
        else:
            raise ValueError(f"fault_worker: unknown action {do!r}")


def _at_stage(where: str, fn):
    @functools.wraps(fn)
    def wrapper(run, *args, **kwargs):
        _act(where, run.step + 1, run.out_dir)
        return fn(run, *args, **kwargs)

    return wrapper


def install() -> None:
    from megarl import console
    from megarl.checkpoint import training
    from megarl.trainer import loop, recipe

    _, events, rank, attempt = _env()
    os.makedirs(events, exist_ok=True)
    pid_file = os.path.join(events, f"pid-rank{rank}-attempt{attempt}")
    with open(pid_file + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(pid_file + ".tmp", pid_file)
    stages = {
        "rollout": "generate",
        "reward": "score",
        "logprobs": "forward_passes",
        "advantage": "advantages",
        "train": "update",
    }
    for where, name in stages.items():
        setattr(loop, name, _at_stage(where, getattr(loop, name)))

    build_run = recipe.build_run

    def build_then_act(cfg, out_dir, stage, job=None):
        run = build_run(cfg, out_dir, stage, job)
        _act("setup", 0, out_dir)
        return run

    recipe.build_run = build_then_act
    commit = training._commit

    def commit_with_faults(tmp: str, final: str) -> None:
        step = int(re.search(r"step_(\d+)$", final).group(1))
        _act("commit", step, os.path.dirname(os.path.dirname(final)))
        commit(tmp, final)

    training._commit = commit_with_faults
    end = console.end_process

    def record_exit(code: int):
        with open(os.path.join(events, f"exit-rank{rank}-attempt{attempt}"), "w") as f:
            f.write(str(code))
        end(code)

    console.end_process = record_exit


if __name__ == "__main__":
    from megarl import cli

    install()
    raise SystemExit(cli.main())
