"""One engine's generation, the same wherever the engine runs: the colocated placement drives a
worker in every trainer rank, the separate placement one on every engine rank, over a link.

`RolloutWorker` owns what happens around the engine's calls:
- generation: single-turn samples (`RolloutEngine.generate`) or trajectories with an
  environment or an agent (`megarl.rollout.multi_turn.runner`, for which the worker is the
  `TurnGenerator`);
- per-token versions: `version` counts the weight updates the engine has loaded, and every
  sampled token is stamped with the version that sampled it (`Samples.versions`);
- in-flight updates: continuous requests (`submit` / `step`, or a trajectory's stream of turns)
  keep running across an update (`update`): the tokens each drew so far were the old version's,
  the next the new one's (the engine recomputes their KV with the new weights). Between two
  waves or scheduler steps of trajectories the worker calls `poll`, where its driver lands
  updates that arrived meanwhile.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from megarl.envs.config import EnvConfig
from megarl.rollout.agents.agent import AgentTrajectories
from megarl.rollout.engine.engine import RolloutEngine
from megarl.rollout.multi_turn.batcher import TurnRequest, TurnResult
from megarl.rollout.multi_turn.runner import Trajectories, TrajectoryRunner
from megarl.rollout.multi_turn.sources import EnvTrajectories
from megarl.rollout.samples import Samples, Versions, token_versions

log = logging.getLogger(__name__)


def load_trajectories(cfg: EnvConfig, tokenizer) -> Trajectories:
    """What drives a run's trajectories: the agent of `env.agent`, else the environment of
    `env.name`; loaded and checked now (a bad name, class, kwargs or chat template fails here,
    before any model is built)."""
    if cfg.agent is not None:
        return AgentTrajectories(cfg, tokenizer)
    return EnvTrajectories(cfg, tokenizer)


@dataclass
class InflightRequest:
    """A generate request served continuously: its prompts, each prompt's sample keys, and each
    finished sample's (ids, logprobs, finish reason, token versions)."""

    prompts: list
    keys: list[list[str]]
    done: dict[str, tuple] = field(default_factory=dict)
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.error is not None or len(self.done) == sum(map(len, self.keys))

    def samples(self) -> Samples:
        """The samples, prompt-major, each prompt's in order (as `RolloutEngine.generate`)."""
        out = Samples.empty()
        out.versions = Versions([])
        for i, keys in enumerate(self.keys):
            for key in keys:
                ids, lps, finish, versions = self.done[key]
                out.prompt_index.append(i)
                out.prompt_ids.append(list(self.prompts[i]))
                out.response_ids.append(ids)
                out.response_logprobs.append(lps)
                out.finish_reason.append(finish)
                out.versions.tokens.append(_per_token(versions, len(ids)))
        return out


class RolloutWorker:
    """One engine's generation (module docstring). `trajectories` (with `env`): the samples are
    trajectories driven by them (`load_trajectories`)."""

    def __init__(
        self,
        engine: RolloutEngine,
        trajectories: Trajectories | None = None,
        env: EnvConfig | None = None,
    ):
        self.engine = engine
        self.runner = TrajectoryRunner(self, env, trajectories) if trajectories else None
        self.version = 0
        """Weight updates the engine has loaded: the policy version it generates with."""
        self.poll: Callable[[], None] | None = None
        """Called between two waves or scheduler steps of trajectories (`between_turns`)."""
        self._switches: dict[str, list[tuple[int, int]]] = {}
        """Per running continuous request: (token index, version) of each version it sampled
        with, oldest first."""
        self._owners: dict[str, InflightRequest] = {}
        self._requests = 0

    # ------------------------------------------------------------------ requests
    def generate(self, items: list, positions: list[int], seed: int, *, instance=None,
                 **sampling) -> Samples:  # fmt: skip
        """The samples of `items` (token-id prompts; trajectory items with `trajectories`),
        each token stamped with its version. `instance`: (its process group, its first rank,
        whether this rank is it) of a multi-rank vLLM instance running trajectories, whose
        first rank runs them and the others follow."""
        if self.runner is not None:
            group, first, leader = instance or (None, None, True)
            if not leader:
                return self.runner.follow(group, first, **sampling)
            return self.runner.run(items, positions, seed, group=group, **sampling)
        out = self.engine.generate(items, positions=positions, seed=seed, **sampling)
        out.versions = Versions([[self.version] * len(r) for r in out.response_ids])
        return out

    def submit(self, items: list, positions: list[int], seed: int, **sampling) -> InflightRequest:
        """`generate`'s single-turn samples as continuous requests: `step` runs them, a weight
        update may land in between (`update`); the request is `finished` once every sample
        is."""
        key = f"r{self._requests}"
        self._requests += 1
        keys = self.engine.submit_prompts(key, items, positions=positions, seed=seed, **sampling)
        request = InflightRequest(items, keys)
        for k in (k for ks in keys for k in ks):
            self._switches[k] = [(0, self.version)]
            self._owners[k] = request
        return request

    @property
    def busy(self) -> bool:
        """Whether submitted samples are still running."""
        return bool(self._owners)

    def step(self) -> None:
        """One scheduler step of the submitted samples; a failure fails every request they
        belong to and drops them from the engine."""
        try:
            for key, ids, lps, finish, versions in self._step():
                self._owners.pop(key).done[key] = (ids, lps, finish, versions)
        except Exception as e:  # the driver answers each request with the error
            log.exception("generating in flight failed")
            for key, request in self._owners.items():
                request.error = f"{type(e).__name__}: {e}"
                self._switches.pop(key, None)
            self.engine.abort_submitted()
            self._owners.clear()

    def drain(self) -> None:
        """Step until no submitted sample is running."""
        while self._owners:
            self.step()

    # ------------------------------------------------------------------ weights
    def update(self, load: Callable, version: int):
        """Run `load()` (it writes new weights into the engine) and make `version` the one
        every later token is stamped with; running continuous requests go on with it (the
        tokens they drew so far keep the old version). Returns what `load` returns."""
        drawn = self.engine.progress()  # tokens each running request drew with the old weights
        result = load()
        self.version = version
        for key, switches in self._switches.items():
            switches.append((drawn.get(key, 0), version))
        return result

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()
        self.engine.close()

    # ------------------------------------------------------------------ TurnGenerator
    @property
    def n(self) -> int:
        return self.engine.sampling.n

    @property
    def max_tokens(self) -> int:
        return self.engine.sampling.max_tokens

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def turns(self, requests: list[TurnRequest], sampling: dict) -> list[TurnResult]:
        out = self.engine.generate(
            [r.ids for r in requests],
            n=1,
            seeds=[r.seed for r in requests],
            max_tokens=[r.max_tokens for r in requests],
            **sampling,
        )
        rows = zip(out.response_ids, out.response_logprobs, out.finish_reason, strict=True)
        return [TurnResult(ids, lps, fin, self.version) for ids, lps, fin in rows]

    def submit_turn(self, key: str, request: TurnRequest, sampling: dict) -> None:
        self.engine.submit(
            key, request.ids, seed=request.seed, max_tokens=request.max_tokens, **sampling
        )
        self._switches[key] = [(0, self.version)]

    def step_turns(self) -> list[tuple[str, TurnResult]]:
        return [(k, TurnResult(ids, lps, fin, v)) for k, ids, lps, fin, v in self._step()]

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def between_turns(self) -> None:
        if self.poll is not None:
            self.poll()

    def _step(self) -> list[tuple]:
        """One scheduler step: (key, ids, logprobs, finish reason, versions) of each continuous
        request that finished in it; versions one for all its tokens, or one per token when an
        update reached it while it ran."""
        out = []
        for key, ids, lps, finish in self.engine.step():
            sw = self._switches.pop(key)
            versions = sw[0][1] if len(sw) == 1 else token_versions(sw, len(ids))
            out.append((key, ids, lps, finish, versions))
        return out


def _per_token(versions: int | list[int], length: int) -> list[int]:
    return [versions] * length if isinstance(versions, int) else versions
