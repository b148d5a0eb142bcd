"""megatron-core's checkpoint writers report on a queue served by a multiprocessing manager;
without CUDA megarl forks that manager in `init_distributed`, before any model exists
(`fork_write_results_queue`), instead of letting megatron spawn a fresh interpreter at the
first save. Checked in a rank with a stop handler installed, as the trainer's ranks have: the
queue is megatron's own global, made once, served by a forked process that has the default
SIGTERM disposition (a stop request to the process group ends it), while the rank keeps its
handler. Saves through it are checked by every test that resumes
a run bit for bit (tests/test_faults.py)."""

from __future__ import annotations

import signal

from megarl.distributed.launch import spawn


def _caught(pid: int, sig: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        mask = next(line for line in f if line.startswith("SigCgt:")).split()[1]
    return bool(int(mask, 16) >> (sig - 1) & 1)


def _queue_job(rank, world):
    import os

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megarl.distributed.process_group import init_distributed
    from megarl.distributed.writer_queue import fork_write_results_queue

    signal.signal(signal.SIGTERM, lambda *_: None)  # as the trainer's stop handler does
    before = filesystem_async._results_queue
    init_distributed()
    queue = filesystem_async._results_queue
    fork_write_results_queue()
    queue.put({"rank": rank})
    server = queue._manager._process
    return {
        "megatron_had_none": before is None,
        "made_once": filesystem_async._results_queue is queue,
        "round_trip": queue.get(),
        "server": type(server).__name__,
        "server_catches_term": _caught(server.pid, signal.SIGTERM),
        "rank_catches_term": _caught(os.getpid(), signal.SIGTERM),
    }


def test_write_results_queue_is_megatrons_forked_with_default_signals():
    (res,) = spawn(_queue_job, 1)
    assert res == {
        "megatron_had_none": True,
        "made_once": True,
        "round_trip": {"rank": 0},
        "server": "ForkProcess",
        "server_catches_term": False,
        "rank_catches_term": True,
    }


def test_the_forked_manager_ends_with_a_rank_that_ends_without_atexit(tmp_path):
    """A rank killed, or ended by the hang watchdog's os._exit, cannot shut its manager down:
    the manager must notice and end (it would otherwise keep the rank's memory)."""
    import os
    import subprocess
    import sys
    import time

    code = (
        "import os\n"
        "from megatron.core.dist_checkpointing.strategies import filesystem_async as fa\n"
        "from megarl.distributed.process_group import init_distributed\n"
        "init_distributed()\n"
        "print(fa._results_queue._manager._process.pid, flush=True)\n"
        "os._exit(0)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "out.txt"
    with open(out, "w") as f:  # a file, not a pipe: a manager left alive would hold a pipe open
        proc = subprocess.run([sys.executable, "-c", code], cwd=root, stdout=f,
                              stderr=subprocess.STDOUT, timeout=300)  # fmt: skip
    text = out.read_text()
    assert proc.returncode == 0, text[-3000:]
    pid = int(text.split()[-1])

    def alive() -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 20
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(), f"manager {pid} outlived its rank"
