"""One engine's trajectories: the environments (or agents) of a share of prompts, n
trajectories each, run to their end, every trajectory a thread of its own
(`megarl.rollout.multi_turn.trajectory`), its turns served by a scheduler of `env.scheduler`:
waves (`WaveBatcher`, one batch call per wave of turns) or stream (`StreamBatcher`, continuous
batching, one scheduler step at a time).

The runner generates through a small protocol (`TurnGenerator`), which the worker that owns the
engine implements (`megarl.rollout.placement.worker`): it stamps each turn's tokens with the
policy version that sampled them and lands weight updates between waves or steps. With an
instance of several ranks (GPU, rollout.engine.tensor_parallel > 1, waves only), its first rank runs
the trajectories and sends every wave's requests to the others, which generate the same
requests (vLLM's SPMD executor needs every rank to submit them).

A sample's response is everything after the prompt: sampled tokens and the environment's
(`Samples.turns` tells them apart and holds the conversations).
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch.distributed as dist

from megarl.envs.config import EnvConfig
from megarl.rollout.multi_turn.batcher import TurnRequest, TurnResult
from megarl.rollout.multi_turn.stream import StreamBatcher
from megarl.rollout.multi_turn.trajectory import TurnLimits
from megarl.rollout.multi_turn.waves import WaveBatcher
from megarl.rollout.samples import Samples, Turns, Versions


class TurnGenerator(Protocol):
    """What a runner asks of the engine's side (module docstring)."""

    n: int
    """Trajectories per prompt when a call does not say."""
    max_tokens: int
    """Tokens per turn when a call does not say."""
    max_model_len: int

    def turns(self, requests: list[TurnRequest], sampling: dict) -> list[TurnResult]:
        """One wave: every request sampled once (`sampling`: greedy, temperature)."""

    def submit_turn(self, key: str, request: TurnRequest, sampling: dict) -> None:
        """Queue one turn for continuous generation."""

    def step_turns(self) -> list[tuple[str, TurnResult]]:
        """One scheduler step: the queued turns that finished in it."""

    def has_unfinished(self) -> bool:
        """Whether queued turns are still running."""

    def between_turns(self) -> None:
        """Before each wave or scheduler step: where weight updates that arrived land."""


class Trajectories(Protocol):
    """Makes the step's trajectories: an environment's (`multi_turn.sources.EnvTrajectories`)
    or an agent's (`megarl.rollout.agents.agent.AgentTrajectories`)."""

    def make(self, item: dict, seed: int, index: int, limits: TurnLimits):
        """Trajectory `index` of a call with base seed `seed`, from `item`
        (`multi_turn.sources.trajectory_items`)."""

    def close(self) -> None:
        """Release what the trajectories share (an agent endpoint)."""


class TrajectoryRunner:
    """One engine's trajectories (module docstring)."""

    def __init__(self, generator: TurnGenerator, cfg: EnvConfig, trajectories: Trajectories):
        self.generator, self.cfg, self.trajectories = generator, cfg, trajectories
        self.last_waves: list[int] = []
        """Turns per wave (or per step's new turns) of the last `run`."""

    def run(
        self,
        items: list[dict],
        positions: list[int],
        seed: int,
        *,
        group=None,
        n: int | None = None,
        greedy: bool = False,
        temperature: float | None = None,
        max_tokens: int | None = None,
    ) -> Samples:
        """The trajectories of `items`, n per item, prompt-major; `positions`: each item's place
        in the step's global batch (with `seed`, its samples' seeds); `group`: the instance's
        process group when it has other ranks (this one is its first: they `follow`)."""
        gen = self.generator
        n = gen.n if n is None else n
        sampling = dict(greedy=greedy, temperature=temperature)
        limits = TurnLimits(max_tokens or gen.max_tokens, gen.max_model_len)
        runs = [
            self.trajectories.make(item, seed, pos * n + k, limits)
            for item, pos in zip(items, positions, strict=True)
            for k in range(n)
        ]
        batcher = self._batcher(group, sampling)
        clients = [batcher.client() for _ in runs]
        threads = [
            threading.Thread(target=r.run, args=(batcher, c), daemon=True, name=f"trajectory-{i}")
            for i, (r, c) in enumerate(zip(runs, clients, strict=True))
        ]
        for t in threads:
            t.start()
        out = None
        try:
            batcher.serve()
            for r, c in zip(runs, clients, strict=True):
                if c.timed_out:
                    r.abandoned()
            for r in runs:
                if r.bug is not None:
                    raise r.bug
            self.last_waves = list(batcher.waves)
            out = _collect(runs, items, n)
        finally:
            if group is not None:  # the samples (or the failure) to the instance's other ranks
                msg = ("done", out) if out is not None else ("failed", None)
                dist.broadcast_object_list([msg], src=dist.get_rank(), group=group)
        return out

    def follow(
        self, group, src: int, *, greedy: bool = False, temperature: float | None = None, **_
    ) -> Samples:
        """A non-first rank of a multi-rank instance: generate every wave its first rank
        (`src`) sends, then take the samples it sends at the end."""
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=src, group=group)
            kind, payload = box[0]
            if kind == "done":
                return payload
            if kind == "failed":
                raise RuntimeError(
                    f"the multi-turn rollout failed on rank {src} (its log says why)"
                )
            self.generator.turns(payload, dict(greedy=greedy, temperature=temperature))

    def close(self) -> None:
        self.trajectories.close()

    def _batcher(self, group, sampling) -> WaveBatcher | StreamBatcher:
        """The scheduler of `env.scheduler` over the generator."""
        gen = self.generator
        if self.cfg.scheduler == "stream":

            def step():
                gen.between_turns()
                return gen.step_turns()

            def submit(key, request):
                gen.submit_turn(key, request, sampling)

            return StreamBatcher(submit, step, gen.has_unfinished, self.cfg.wave_wait_s)

        def wave(requests):
            gen.between_turns()
            if group is not None:  # the instance's other ranks generate the same requests
                dist.broadcast_object_list([("wave", requests)], src=dist.get_rank(), group=group)
            return gen.turns(requests, sampling)

        return WaveBatcher(wave, self.cfg.wave_wait_s)


def _collect(runs: list, items: list[dict], n: int) -> Samples:
    """The trajectories' samples, prompt-major (trajectory j is sample k = j % n of item
    j // n)."""
    out = Samples.empty()
    out.turns, out.versions = Turns([], []), Versions([])
    for j, r in enumerate(runs):
        tok = r.sample(items[j // n]["prompt_ids"])
        out.prompt_index.append(j // n)
        out.prompt_ids.append(tok.prompt)
        out.response_ids.append(tok.response)
        out.response_logprobs.append(tok.logprobs)
        out.finish_reason.append(r.record.finish_reason)
        out.turns.mask.append(tok.mask)
        out.turns.records.append(r.record)
        out.versions.tokens.append(tok.versions)
    return out
