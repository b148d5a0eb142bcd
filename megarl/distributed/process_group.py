"""The default process group of a run: torchrun's environment or a one-process group.

`init_distributed` is what every entry point (the trainer, `megarl evaluate`, the GPU checks and
tools) calls before anything else that is collective. It selects the device (`device.setup`),
forks the CPU checkpoint-writer queue before the group's sockets exist
(`writer_queue.fork_write_results_queue`), and, under torchrun, gives each restart attempt its
own keys in torchrun's rendezvous store (`attempt_store`).

Restarted attempts: torch 2.13's agent keeps one TCP store for every attempt (the static
rendezvous, and the c10d one while it shares its store), so the workers that torchrun
`--max-restarts` starts again find the keys the dead attempt's process groups wrote there and
connect to addresses that no longer exist: they hang or fail at their first process group.
`attempt_store` prefixes this attempt's keys with torchrun's restart count.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

from megarl.distributed import device
from megarl.distributed.launch import free_port
from megarl.distributed.placement import Job, init_job
from megarl.distributed.writer_queue import fork_write_results_queue


def attempt_store(timeout: timedelta | None):
    """For a worker under torchrun: the rendezvous store of `MASTER_ADDR:MASTER_PORT`, its keys
    prefixed with torchrun's restart count (module doc); None outside torchrun (torch's env://
    rendezvous as before)."""
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return None
    env = os.environ
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    agent_hosts = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        env["MASTER_ADDR"],
        int(env["MASTER_PORT"]),
        world,
        is_master=rank == 0 and not agent_hosts,
        timeout=timeout or timedelta(minutes=30),
        multi_tenant=True,
    )
    prefix = f"megarl/attempt_{env['TORCHELASTIC_RESTART_COUNT']}"
    return dist.PrefixStore(prefix, store)


def init_distributed(
    timeout: timedelta | None = None, *, placement: str = "colocated", engines: int = 0
) -> Job:
    """torch.distributed from torchrun's environment, or a one-process group when run plainly.
    `timeout`: of every collective on the default group (None: torch's default;
    `megarl.trainer.faults.collective_timeout` keeps it above the hang watchdog's).
    `placement` / `engines`: `rollout.placement.mode` / `.ranks`; with "separate" the
    default group holds this rank's role only (`megarl.distributed.placement`). Returns the
    job, which the caller owns (its links); when the default group exists already, the job of
    that world as it is (`Job.of_world`: every rank trains)."""
    if dist.is_initialized():
        _checkpoint_queue()  # a group made by the caller (made once: a no-op after ours)
        return Job.of_world()
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
        )
    device.setup()
    _checkpoint_queue()  # before the group's sockets exist: the forked manager holds none
    return init_job(device.backend(), placement, engines, attempt_store(timeout), timeout)


def _checkpoint_queue() -> None:
    """On CPU, megatron's checkpoint-writer queue forked before any model exists
    (`fork_write_results_queue` says why)."""
    if not device.use_gpu():
        fork_write_results_queue()
