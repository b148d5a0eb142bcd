"""Which ranks of a torchrun job train and which only host vLLM engines.

`rollout.placement.mode: colocated` (the default): every rank trains and holds an engine; the
default process group is the whole job. `separate`: the last `rollout.placement.ranks` ranks of the
job host engines only. Megatron-core builds its groups over the default process group's world, so
the two roles get default groups of their own (the trainers' world is then exactly TP x PP x CP x
DP), made from torchrun's rendezvous store under different key prefixes; a third group, the link,
joins trainer rank 0 with every engine rank (member 0 = trainer rank 0, member 1 + i = engine i).
Prompts, samples and weights travel over the link (gloo on CPU; a raw `ProcessGroupGloo`, not
registered with torch.distributed, because its members are not one default world). Each other
trainer rank that sends weights gets a link of its own to the engines (`Job.sender_link`), made when
it first sends, in the same way.

`JobPlacement.split` is the arithmetic (pure); `init_job` makes the groups and returns the
`Job` that holds them: whoever starts the job owns it (a context manager).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from megarl.errors import UserError

PLACEMENTS = ("colocated", "separate")


class PlacementError(UserError, ValueError):
    """A placement the job's ranks cannot make; the message shows the arithmetic."""


@dataclass(frozen=True)
class JobPlacement:
    """This rank's role in the job and its rank within that role's default process group."""

    role: str
    """"train" or "rollout"."""
    job_rank: int
    job_world: int
    rank: int
    """Rank in the role's default process group."""
    world: int
    """Ranks of this role."""
    engines: int
    """Engine ranks in the job (0: colocated)."""

    @staticmethod
    def split(job_rank: int, job_world: int, placement: str, engines: int) -> JobPlacement:
        """The role of `job_rank` of `job_world` ranks; `engines`: `rollout.placement.ranks`
        (read with `separate` only)."""
        if placement not in PLACEMENTS:
            raise PlacementError(f"rollout.placement.mode={placement!r}; accepted: {PLACEMENTS}")
        if placement == "colocated":
            return JobPlacement("train", job_rank, job_world, job_rank, job_world, 0)
        if engines < 1 or job_world - engines < 1:
            raise PlacementError(
                f"rollout.placement.mode=separate with rollout.placement.ranks={engines} of a "
                f"{job_world}-rank job leaves {job_world - engines} trainer ranks; accepted: "
                f"1 <= ranks < the job's ranks (launch with torchrun --nproc-per-node <trainers + "
                f"{max(engines, 1)}>)"
            )
        trainers = job_world - engines
        if job_rank < trainers:
            return JobPlacement("train", job_rank, job_world, job_rank, trainers, engines)
        return JobPlacement("rollout", job_rank, job_world, job_rank - trainers, engines, engines)

    @property
    def separate(self) -> bool:
        return self.engines > 0

    @property
    def link_rank(self) -> int | None:
        """This rank's member index in the link (None: not a member)."""
        if self.role == "rollout":
            return 1 + self.rank
        return 0 if self.separate and self.rank == 0 else None


@dataclass
class Job:
    """This process's place in the job (`placement`) and the links it holds. Made by `init_job`
    (or `Job.of_world` for a world someone else made); `close()` drops the links."""

    placement: JobPlacement
    link: object | None = None
    """The link's process group on its members (trainer rank 0 and the engine ranks), else
    None."""
    store: object | None = None
    timeout: timedelta | None = None
    _senders: dict = field(default_factory=dict)

    @staticmethod
    def of_world() -> Job:
        """The job of the default process group as it is: every rank trains, engines colocated
        (one process when torch.distributed is not initialised)."""
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        return Job(JobPlacement("train", rank, world, rank, world, 0))

    def sender_link(self, trainer_rank: int):
        """The link between trainer rank `trainer_rank` (member 0) and every engine rank
        (member 1 + i); trainer rank 0's is `link`. Made on first use, by that trainer rank and
        every engine rank (each engine rank asks for the links in the same order: making one
        waits for all its members)."""
        if trainer_rank == 0:
            return self.link
        if trainer_rank not in self._senders:
            where = self.placement
            member = 0 if where.role == "train" else 1 + where.rank
            store = dist.PrefixStore(f"link-{trainer_rank}", self.store)
            self._senders[trainer_rank] = dist.ProcessGroupGloo(
                store, member, where.engines + 1, self.timeout
            )
        return self._senders[trainer_rank]

    def close(self) -> None:
        """Drop the links (gloo closes their sockets when the last reference goes)."""
        self.link = None
        self._senders.clear()

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def init_job(backend: str, placement: str, engines: int, store, timeout) -> Job:
    """This rank's default process group (its role's ranks) and, with `separate`, the link
    (module docstring). `store`: torchrun's rendezvous store, keys of this attempt prefixed;
    collective over the job."""
    env = os.environ
    where = JobPlacement.split(int(env["RANK"]), int(env["WORLD_SIZE"]), placement, engines)
    if store is None and where.separate:
        raise PlacementError(
            "rollout.placement.mode=separate needs the job's ranks from torchrun (or Slurm through "
            f"torchrun): launch with torchrun --nproc-per-node <trainers + {engines}>"
        )
    timeout = timeout or timedelta(minutes=30)
    kw = {} if store is None else {"store": dist.PrefixStore(where.role, store)}
    dist.init_process_group(backend, timeout=timeout, rank=where.rank, world_size=where.world, **kw)
    link = None
    if where.link_rank is not None:
        link = dist.ProcessGroupGloo(
            dist.PrefixStore("link", store), where.link_rank, engines + 1, timeout
        )
    return Job(where, link, store, timeout)
