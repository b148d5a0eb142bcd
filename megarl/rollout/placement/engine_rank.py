"""An engine rank of `rollout.placement.mode: separate`: a `RolloutWorker` driven over the link by
trainer rank 0 (the protocol: `megarl.rollout.placement.separate`).

Every answer names the request it answers (`op`). Generate requests are answered in the order
they arrived; a weight or adapter update is answered as soon as it is loaded, which with
in-flight updates is before the samples it reached (the trainer verifies an update before it
takes a sample with a token of its version). Two ways to generate:

- Whole requests (the default): a generate request runs to its end before the next message is
  read, so an update sent meanwhile waits for it.
- In-flight updates (`rollout.placement.inflight_updates`): every sample is its own continuous
  request (`RolloutWorker.submit`; a request sent while another still decodes joins it), the loop
  reads the next message between scheduler steps, where a weight update lands
  (`RolloutWorker.update`). With trajectories the worker polls for updates between two waves
  of turns or two scheduler steps (`poll`); a message other than a weight update waits for the
  request to end. An adapter update waits for the running requests: vLLM swaps an adapter only
  between requests.
"""

from __future__ import annotations

import logging
import tempfile
from collections import deque

from megarl.distributed.consensus import failed_ranks
from megarl.distributed.link import Inbox, Outbox
from megarl.distributed.placement import Job
from megarl.rollout.engine.engine import RolloutEngine, write_model_dir
from megarl.rollout.placement.worker import InflightRequest, RolloutWorker, load_trajectories
from megarl.rollout.sync.receiver import Receiver
from megarl.rollout.sync.separate import UPDATES

log = logging.getLogger(__name__)


def serve(job: Job) -> int:
    """An engine rank's life: answer trainer rank 0 until it says stop; returns the exit status
    it sends (the trainer's)."""
    # vLLM reads the model's config.json from a directory: this rank's own, gone when it ends
    with tempfile.TemporaryDirectory(prefix="megarl-engine-") as model_dir:
        rank = EngineRank(job, model_dir)
        try:
            return rank.serve()
        finally:
            rank.close()


class EngineRank:
    """One engine rank's loop: its worker (built by the start request), the receiving side of
    the weight sync, and the answers owed to trainer rank 0, oldest first (a dict, or an
    `InflightRequest` still generating)."""

    def __init__(self, job: Job, model_dir: str):
        self.model_dir = model_dir
        self.receiver = Receiver(job)
        self.worker: RolloutWorker | None = None
        self.inflight = False
        self.outbox = Outbox(job.link)
        self.inbox = Inbox(
            job.link, 0, last=lambda msg: msg["op"] == "stop", prepare=self.receiver.receive_ahead
        )
        self.deferred: deque = deque()
        """Messages that arrived while a request with trajectories ran, to handle after it."""
        self._owed: deque = deque()
        self._done: deque = deque()
        """Answers to updates, sent ahead of `_owed`."""

    def serve(self) -> int:
        while True:
            busy = self.worker is not None and self.worker.busy
            msg = self.deferred.popleft() if self.deferred else self.inbox.get(block=not busy)
            if msg is None:  # nothing new: the running requests one step on
                self.worker.step()
            elif msg["op"] == "stop":  # the trainer took every answer before it sent this
                self.outbox.flush()
                return int(msg["exit"])
            else:
                self.handle(msg)
            self.send_ready()

    def handle(self, msg: dict) -> None:
        op = msg["op"]
        try:
            if op == "generate" and self.inflight and self.worker.runner is None:
                self._owed.append(self.worker.submit(
                    msg["prompts"], msg["positions"], msg["seed"], **msg["sampling"]
                ))  # fmt: skip
                return
            reply = self._answer(op, msg)
        except Exception as e:  # the trainer reports it; the engine waits for the next request
            log.exception("engine request %r failed", op)
            reply = {"error": f"{type(e).__name__}: {e}"}
        reply["op"] = op
        (self._done if op in UPDATES else self._owed).append(reply)

    def _answer(self, op: str, msg: dict) -> dict:
        worker = self.worker
        if op == "start":
            self.worker = worker = self._start(msg)
            self.receiver.attach(worker.engine)
            return {"ok": True}
        if op == "generate":
            out = worker.generate(msg["prompts"], msg["positions"], msg["seed"], **msg["sampling"])
            return {"rollout": out, "version": worker.version}
        if op == "adapters":  # vLLM swaps an adapter only between requests
            worker.drain()
            answer = worker.update(lambda: self.receiver.adapters(msg), msg["version"])
            return {**answer, "version": worker.version}
        if op == "weights":
            answer = worker.update(lambda: self.receiver.weights(msg), msg["version"])
            return {**answer, "version": worker.version}
        return {"error": f"unknown request {op!r}"}

    def _start(self, msg: dict) -> RolloutWorker:
        cfg, env = msg["cfg"], msg.get("env")
        trajectories = None
        if env is not None:  # builds one environment before vLLM: a bad one fails the start
            trajectories = _agreed(lambda: load_trajectories(env, msg["tokenizer"]), env)
        write_model_dir(self.model_dir, msg["arch"])
        self.inflight = cfg.placement.inflight_updates
        engine = RolloutEngine(
            self.model_dir, msg["arch"], cfg.sampling, cfg.engine, dtype=msg["dtype"],
            lora_rank=msg.get("lora_rank", 0), updates_between_steps=self.inflight,
        )  # fmt: skip
        worker = RolloutWorker(engine, trajectories, env)
        if trajectories is not None and self.inflight:
            worker.poll = self.between_turns
        return worker

    def between_turns(self) -> None:
        """In flight, with trajectories, before each wave or scheduler step: load the weight
        updates that arrived meanwhile and answer them at once; keep any other message for
        after the request (module docstring)."""
        while (msg := self.inbox.get(block=False)) is not None:
            if msg["op"] == "weights":
                self.handle(msg)
            else:
                self.deferred.append(msg)
        self.send_ready()  # the updates' answers: the request's own is not owed yet

    def send_ready(self) -> None:
        """Send the answers that can go now: the updates', then the owed ones up to the first
        still generating."""
        while self._done:
            self.outbox.send(self._done.popleft(), 0)  # completes when the trainer asks for it
        while self._owed and _ready(self._owed[0]):
            owed = self._owed.popleft()
            if isinstance(owed, InflightRequest):
                owed = _answer_inflight(owed, self.worker.version)
            self.outbox.send(owed, 0)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


def _agreed(load, env):
    """`load()` (the environments' check) with one verdict for every engine rank: vLLM's start,
    next, is collective over them, so a rank whose environment failed must not leave the others
    waiting in it. Raises this rank's error, or one naming the ranks that failed."""
    try:
        out, error = load(), None
    except Exception as e:  # raised below, once every rank knows
        out, error = None, e
    failed = failed_ranks(error is not None)
    if error is not None:
        raise error
    if failed:
        what = f"env.agent {env.agent!r}" if env.agent is not None else f"env.name {env.name!r}"
        raise RuntimeError(f"{what} failed to load on engine ranks {failed} (their logs say why)")
    return out


def _ready(owed) -> bool:
    return not isinstance(owed, InflightRequest) or owed.finished


def _answer_inflight(request: InflightRequest, version: int) -> dict:
    if request.error is not None:
        return {"op": "generate", "error": request.error}
    return {"op": "generate", "rollout": request.samples(), "version": version}
