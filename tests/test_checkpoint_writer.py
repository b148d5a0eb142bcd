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

    from megarl.convert.checkpoint import fork_write_results_queue
    from megarl.trainer.run import init_distributed

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
