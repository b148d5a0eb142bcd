"""The multi-turn rollout component: every sample a trajectory of turns between the policy and
an environment (`env.name`) or an agent (`env.agent`, served by `megarl.rollout.endpoint`),
behind the same interface as the single-turn rollout (`megarl.rollout.colocated.RolloutComponent`).

With colocated engines the engines, the weight sync and the dispatcher are the
`ColocatedRollout`'s; the dispatcher hands each vLLM instance its share of the prompts, and
the instance runs their trajectories (n per prompt) to the end (`TrajectoryRunner`; with
`rollout.placement: separate` each engine rank runs one, `megarl.rollout.engine_rank`, and the
trainer's `SeparateRollout` sends it `trajectory_items`): every trajectory a thread
(`megarl.rollout.trajectory.EnvTrajectory`), served by a `WaveBatcher` (one `generate` call
per wave of turns) or, with `env.scheduler: stream`, a `StreamBatcher` (vLLM's continuous
batching, one scheduler step at a time). With a vLLM instance of several ranks (GPU,
rollout.tensor_parallel > 1), its first rank runs the environments and sends every wave's
requests to the others, which generate the same requests (vLLM's SPMD executor needs every
rank to submit them; waves only); on CPU instances have one rank.

A sample's response is everything after the prompt: sampled tokens and the environment's
(`Rollout.response_mask` tells them apart, `Rollout.trajectories` holds the conversation).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from megarl.data.dataset import prompt_messages
from megarl.envs.config import EnvConfig
from megarl.envs.registry import environment_factory, load_agent
from megarl.envs.tool_calls import ToolCallParser
from megarl.metrics.reduce import LocalMetrics
from megarl.rollout.agent import AgentTrajectory
from megarl.rollout.chat_format import ChatFormat
from megarl.rollout.colocated import ColocatedRollout
from megarl.rollout.endpoint import ChatEndpoint
from megarl.rollout.engine import Rollout, RolloutEngine
from megarl.rollout.staleness import token_versions
from megarl.rollout.stream import StreamBatcher
from megarl.rollout.trajectory import FINISH_REASONS, EnvTrajectory, TurnLimits
from megarl.rollout.waves import TurnResult, WaveBatcher

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MultiTurnSetup:
    """What a multi-turn rollout reads from the config, loaded and checked before any model
    is built (`load_multi_turn`)."""

    cfg: EnvConfig
    make_env: Callable | None
    """A new environment per trajectory (None with `env.agent`)."""
    fmt: ChatFormat
    parser: ToolCallParser | None
    """The tool-call parser, when the environment declares tools."""
    agent: Callable | None = None
    """The agent function of `env.agent` (its tools come with its requests)."""


def load_multi_turn(cfg: EnvConfig, tokenizer) -> MultiTurnSetup:
    """The environment's factory (one environment built now: a bad name, class or kwargs fails
    here), the chat format and, when it declares tools, vLLM's tool parser `env.tool_parser`;
    or, with `env.agent`, the agent function (and the chat format built once, so that a
    template that cannot render a conversation fails here, not on the first request)."""
    if cfg.agent is not None:
        return MultiTurnSetup(cfg, None, ChatFormat(tokenizer, None), None, load_agent(cfg))
    make_env = environment_factory(cfg)
    tools = getattr(make_env(), "tools", None) or None
    fmt = ChatFormat(tokenizer, tools)
    parser = ToolCallParser(cfg.tool_parser, tokenizer, tools) if tools else None
    return MultiTurnSetup(cfg, make_env, fmt, parser)


def trajectory_items(prompts, system_prompt: str | None) -> list[dict]:
    """What a trajectory starts from, per prompt of `prompts` (a `PromptBatch`): its chat
    messages, its dataset row (the environment's `reset` reads it) and its token ids."""
    return [
        {
            "messages": prompt_messages(p, system_prompt, "prompt"),
            "row": {"prompt": p, **{k: v[i] for k, v in prompts.columns.items()}},
            "prompt_ids": prompts.prompt_ids[i],
        }
        for i, p in enumerate(prompts.prompts)
    ]


class MultiTurnRollout:
    """Trajectories with an environment, on the colocated engines (module docstring)."""

    def __init__(
        self, colocated: ColocatedRollout, setup: MultiTurnSetup, tokenizer, system_prompt
    ):
        self.colocated = colocated
        self.runner = TrajectoryRunner(colocated.engine, setup, tokenizer)
        self.system_prompt = system_prompt

    @property
    def last_waves(self) -> list[int]:
        """Turns per wave of the last `generate` on this rank."""
        return self.runner.last_waves

    def generate(
        self, prompts, positions: list[int], seed: int, *, upcoming=(), **sampling
    ) -> Rollout:
        """This DP rank's trajectories of `prompts` (a `PromptBatch`), n per prompt; see
        `RolloutComponent.generate` (`upcoming`: always empty, the engines are colocated)."""
        if upcoming:
            raise ValueError("multi-turn rollouts generate one step at a time (upcoming=())")
        dispatcher = self.colocated.dispatcher
        group = dispatcher.instance_group

        def produce(share, pos):
            if group is not None and not dispatcher.instance_leader:
                src = min(dispatcher.plan.instances[dispatcher.instance])
                return self.runner.follow(group, src, **sampling)
            return self.runner.run(share, pos, seed, group=group, **sampling)

        items = trajectory_items(prompts, self.system_prompt)
        return dispatcher.dispatch(items, positions, produce)

    def release(self) -> None:
        self.colocated.release()

    def sync_weights(self) -> dict:
        return self.colocated.sync_weights()

    def samples_generated(self) -> int:
        return self.colocated.samples_generated()

    def close(self) -> None:
        self.runner.close()
        self.colocated.close()


class TrajectoryRunner:
    """One vLLM instance's trajectories: the environments (or agents) of a share of prompts,
    n trajectories each, run to their end on `engine` (module docstring). The colocated
    rollout runs one in every trainer rank; with `rollout.placement: separate` every engine
    rank runs one (`megarl.rollout.engine_rank`)."""

    def __init__(self, engine: RolloutEngine, setup: MultiTurnSetup, tokenizer):
        self.engine = engine
        self.cfg, self.make_env, self.fmt = setup.cfg, setup.make_env, setup.fmt
        self.parser, self.agent = setup.parser, setup.agent
        self.endpoint: ChatEndpoint | None = None
        """The agents' OpenAI-compatible endpoint (started on first use, closed by `close`)."""
        self.tokenizer = tokenizer
        self.last_waves: list[int] = []
        """Turns per wave of the last `run`."""
        self.version: Callable[[], int] | None = None
        """Separate engines: the policy version the engine's weights hold, stamped on each
        sampled token (`Rollout.response_versions`); None: no stamps (colocated)."""
        self.before_generate: Callable[[], None] | None = None
        """Called before each wave (`env.scheduler: waves`) or scheduler step (`stream`): where
        an engine rank with `rollout.inflight_updates` loads the updates that arrived meanwhile
        (a stream's running turns go on with the new weights, `version` tells them apart)."""

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
    ) -> Rollout:
        """The trajectories of `items` (`trajectory_items`), n per item, prompt-major;
        `positions`: each item's place in the step's global batch (with `seed`, its samples'
        seeds); `group`: the instance's process group when it has other ranks (this one is its
        first: they `follow`)."""
        n = self.engine.cfg.n if n is None else n
        sampling = dict(greedy=greedy, temperature=temperature)
        limits = TurnLimits(max_tokens or self.engine.cfg.max_tokens, self.engine.max_model_len)
        runs = [
            self._trajectory(item, seed, pos * n + k, limits)
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
            out = self._collect(runs, items, n)
        finally:
            if group is not None:  # the samples (or the failure) to the instance's other ranks
                msg = ("done", out) if out is not None else ("failed", None)
                dist.broadcast_object_list([msg], src=dist.get_rank(), group=group)
        return out

    def follow(
        self, group, src: int, *, greedy: bool = False, temperature: float | None = None, **_
    ) -> Rollout:
        """A non-first rank of a multi-rank vLLM instance: generate every wave its first rank
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
            self._generate(payload, dict(greedy=greedy, temperature=temperature))

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()

    def _batcher(self, group, sampling) -> WaveBatcher | StreamBatcher:
        """The scheduler of `env.scheduler` over this instance's engine."""
        if self.cfg.scheduler == "stream":
            engine = self.engine
            # per running turn, (token index, version) of each version it sampled with
            switches: dict[str, list[tuple[int, int]]] = {}

            def submit(key, r):
                engine.submit(key, r.ids, seed=r.seed, max_tokens=r.max_tokens, **sampling)
                switches[key] = [(0, self._version())]

            def step():
                before = self._version()
                if self.before_generate is not None:
                    self.before_generate()
                    if self._version() != before:  # the tokens drawn so far: the old weights'
                        drawn = engine.progress()
                        for key, sw in switches.items():
                            sw.append((drawn.get(key, 0), self._version()))
                out = []
                for key, ids, lps, fin in engine.step():
                    sw = switches.pop(key)
                    versions = sw[0][1] if len(sw) == 1 else token_versions(sw, len(ids))
                    out.append((key, TurnResult(ids, lps, fin, versions)))
                return out

            return StreamBatcher(submit, step, engine.has_unfinished, self.cfg.wave_wait_s)

        def wave(requests):
            if self.before_generate is not None:
                self.before_generate()
            if group is not None:  # the instance's other ranks generate the same requests
                dist.broadcast_object_list([("wave", requests)], src=dist.get_rank(), group=group)
            return self._generate(requests, sampling)

        return WaveBatcher(wave, self.cfg.wave_wait_s)

    def _trajectory(self, item: dict, seed: int, index: int, limits: TurnLimits):
        """Trajectory `index` of the step: an environment's, or an agent's."""
        if self.agent is None:
            parse = self.parser.parse if self.parser is not None else None
            return EnvTrajectory(
                self.cfg, self.make_env, self.fmt, parse, self._decode,
                item["messages"], item["row"], seed, index, limits,
            )  # fmt: skip
        if self.endpoint is None:
            self.endpoint = ChatEndpoint(self.tokenizer, self.cfg)
            self.endpoint.start()
        row = {**item["row"], "messages": item["messages"]}
        return AgentTrajectory(self.cfg, self.agent, self.endpoint, row, seed, index, limits)

    def _collect(
        self, runs: list[EnvTrajectory | AgentTrajectory], items: list[dict], n: int
    ) -> Rollout:
        out = Rollout.empty()
        out.response_mask, out.trajectories = [], []
        versions = []
        for j, r in enumerate(runs):
            tok = r.sample(items[j // n]["prompt_ids"])
            out.prompt_index.append(j // n)
            out.prompt_ids.append(tok.prompt)
            out.response_ids.append(tok.response)
            out.response_logprobs.append(tok.logprobs)
            out.response_mask.append(tok.mask)
            out.finish_reason.append(r.record.finish_reason)
            out.trajectories.append(r.record)
            versions.append(tok.versions)
        if self.version is not None:
            out.response_versions = versions
        return out

    def _generate(self, requests, sampling) -> list[TurnResult]:
        ro = self.engine.generate(
            [r.ids for r in requests],
            n=1,
            seeds=[r.seed for r in requests],
            max_tokens=[r.max_tokens for r in requests],
            **sampling,
        )
        v = self._version()
        return [
            TurnResult(ids, lps, fin, v)
            for ids, lps, fin in zip(
                ro.response_ids, ro.response_logprobs, ro.finish_reason, strict=True
            )
        ]

    def _version(self) -> int:
        return self.version() if self.version is not None else 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def trajectory_metrics(rollout: Rollout, prefix: str = "rollout") -> LocalMetrics:
    """Per-step figures of multi-turn samples (none for single-turn ones): turns, tool calls,
    tool errors and environment time per trajectory, environment errors and malformed tool
    calls (counts), the share of each finish reason, and `retokenize_diff` (the share of
    trajectories whose ids differ from one tokenization of their final conversation)."""
    m = LocalMetrics()
    recs = rollout.trajectories
    if recs is None:
        return m
    b = len(recs)
    m.add_ratio(f"{prefix}/turns", sum(r.turns for r in recs), b)
    m.add_ratio(f"{prefix}/tool_calls", sum(r.info.get("tool_calls", 0) for r in recs), b)
    m.add_ratio(f"{prefix}/tool_errors", sum(r.info.get("tool_errors", 0) for r in recs), b)
    m.add_ratio(f"{prefix}/env_time_s", sum(r.env_time_s for r in recs), b)
    m.add_sum(f"{prefix}/env_errors", sum(r.finish_reason == "env_error" for r in recs))
    m.add_sum(f"{prefix}/malformed_tool_calls", sum(r.malformed_calls for r in recs))
    for reason in FINISH_REASONS:
        m.add_ratio(f"{prefix}/finish_{reason}", sum(r.finish_reason == reason for r in recs), b)
    checked = [r.retokenize_diff for r in recs if r.retokenize_diff is not None]
    m.add_ratio(f"{prefix}/retokenize_diff", sum(checked), len(checked))
    return m
