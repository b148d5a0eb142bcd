"""Run a function on N local processes joined by a real torch.distributed group.

Used by the tests and benchmarks to exercise gloo collectives on one CPU machine. Each child is
*spawned* (not forked from the caller) so that no OpenMP/gloo state leaks from the parent. The
price of `start_method="spawn"` is one fresh interpreter per rank: importing torch and
megatron-core costs ~5 s of CPU each time. `start_method="forkserver"` forks every child from a
server process that imported them once (and nothing else: no threads, no process group), with
the caller's environment and working directory at the time of the call; the test suite uses it
(`MEGARL_SPAWN_METHOD`, set in tests/conftest.py), except where a child's memory is measured.

The child sets `MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK`, limits torch to
`cpu_count // world_size` threads, initialises the default process group and calls
`fn(rank, world_size, *args)`. Return values travel back pickled; an exception in any rank is
re-raised in the parent with that rank's traceback.
"""

from __future__ import annotations

import io
import os
import socket
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on loopback that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PRELOAD = ["torch", "megatron.core"]
"""What the forkserver imports once for all its children."""


def _child(rank: int, world_size: int, port: int, backend: str, fn, args, queue, env, cwd) -> None:
    # a forkserver child starts with the server's environment: take the caller's
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    # megatron warns at import about absent TE/Apex and deprecated collectives; keep logs readable
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        torch.distributed.init_process_group(backend, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # tensors travel as bytes: torch's shared-memory handles die with this process
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - forwarded to the parent with its traceback
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 900,
    start_method: str | None = None,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` processes; return results by rank.

    `fn` must be importable (a module-level function) because children are spawned.
    start_method: "spawn" or "forkserver" (see the module docstring); default
    `$MEGARL_SPAWN_METHOD`, else "spawn".
    """
    method = start_method or os.environ.get("MEGARL_SPAWN_METHOD") or "spawn"
    if method not in ("spawn", "forkserver"):
        raise ValueError(f"start_method={method!r}; accepted: 'spawn', 'forkserver'")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    queue = ctx.SimpleQueue()
    port = free_port()
    env, cwd = dict(os.environ), os.getcwd()
    procs = [
        ctx.Process(target=_child, args=(r, world_size, port, backend, fn, args, queue, env, cwd))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    for _ in range(world_size):
        rank, ok, payload = _get(queue, procs, timeout)
        if ok:
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        else:
            errors.append(f"rank {rank} failed:\n{payload}")
            break  # peers are likely blocked in a collective; do not wait for them
    for p in procs:
        p.join(timeout=5 if errors else timeout)
        if p.is_alive():
            p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]


def _get(queue, procs, timeout: float):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not queue.empty():
            return queue.get()
        dead = [p for p in procs if p.exitcode not in (None, 0)]
        if dead and queue.empty():
            time.sleep(0.5)
            if queue.empty():
                return (procs.index(dead[0]), False, f"process exited with code {dead[0].exitcode}")
        time.sleep(0.05)
    for p in procs:
        p.kill()
    raise TimeoutError(f"distributed job did not finish within {timeout:.0f} s")
