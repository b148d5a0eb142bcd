"""The results queue of megatron-core's checkpoint writer processes, forked instead of spawned.

megatron-core's `filesystem_async` writers report on a queue served by a multiprocessing manager
that megatron starts with "spawn" at the first `dist_checkpointing.save` (a CUDA context does
not survive a fork): a fresh interpreter that imports torch to unpickle the first results,
2-3 s of every run's first save on CPU. Without CUDA, `fork_write_results_queue` forks that
manager instead. Assumes megatron-core keeps the queue in `filesystem_async._results_queue`
(0.16); with another megatron-core, or with CUDA initialised, it changes nothing.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from multiprocessing.managers import SyncManager

import torch


def _serve_for_parent() -> None:
    """The forked manager's initializer: the default stop signals (not the rank's handlers),
    and an exit as soon as the process that forked it is gone. A rank that ends without its
    atexit hooks (SIGKILL, the hang watchdog's `os._exit`) cannot shut its manager down, and a
    forked manager left behind would keep the rank's memory."""
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="megarl-parent-watch", daemon=True).start()


def fork_write_results_queue() -> None:
    """The queue on which megatron-core's checkpoint writer processes report
    (`filesystem_async`) is served by a multiprocessing manager that megatron starts with
    "spawn" at the first `dist_checkpointing.save` (a CUDA context does not survive a fork): a
    fresh interpreter that imports torch to unpickle the first results, 2-3 s of every run's
    first save on CPU. Without CUDA it is forked here instead: the same queue for the same
    writers (which megatron forks anyway), with the default signal handlers and ending when the
    rank is gone (`_serve_for_parent`). The trainer calls this in `init_distributed`
    (`megarl.distributed.process_group`), before any model exists: a manager forked later would
    keep a copy-on-write snapshot of every page the run writes afterwards (its weights,
    optimizer states). The converter calls it before its one save, at its end. Nothing changes
    with CUDA initialised, or with a megatron-core that has no such queue."""
    if torch.cuda.is_initialized():
        return
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is not None:
        return  # made already (by megatron or here), or not this megatron-core
    manager = SyncManager(ctx=mp.get_context("fork"))
    manager.start(initializer=_serve_for_parent)
    filesystem_async._results_queue = manager.Queue()  # the proxy keeps the manager alive
