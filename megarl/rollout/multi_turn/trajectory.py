"""One multi-turn trajectory: the model and an environment taking turns, token-exact.

The trained sequence is built as it is sampled, never re-tokenized: the prompt (the
environment's initial messages rendered once), then per turn the sampled tokens (mask 1, with
vLLM's logprobs) and the environment's answer as its token delta (mask 0, logprob 0; see
`megarl.rollout.multi_turn.chat_format`). Each turn is sampled from exactly those ids.

A trajectory ends with finish reason
- `stop`: the environment said done (or, in the tools environment, the model answered without
  a tool call);
- `length`: a turn ran to its token limit without a stop token, or the token budget
  (`env.max_tokens`, and the engine's max_model_len) has no room for the next answer;
- `max_turns`: `env.max_turns` assistant turns and the environment not done;
- `env_error`: the environment raised or ran past `env.timeout_s` (or, with
  `env.on_tool_error: end`, the model's tool call could not be read). Its reward is 0.

Seeds: the trajectory at index i = (prompt position x n + k) samples turn 0 with exactly the seed
a single-turn rollout gives that sample (`megarl.rollout.seeds`), and turn t with an unrelated
one; its environment gets the turn-0 seed. Nothing depends on which rank or wave
ran it, so a resumed run's trajectories (and environments) replay a straight run's.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from megarl.envs.base import AssistantTurn, Observation
from megarl.envs.config import EnvConfig
from megarl.rollout.multi_turn.batcher import Client, TurnBatcher, TurnRequest
from megarl.rollout.multi_turn.chat_format import ChatFormat
from megarl.rollout.seeds import turn_seed

FINISH_REASONS = ("stop", "length", "max_turns", "env_error")


@dataclass
class TrajectoryRecord:
    """What a trajectory was, beside its tokens (samples, metrics, reward functions)."""

    messages: list[dict] = field(default_factory=list)
    """The whole conversation: initial messages, every assistant turn (its sampled text; its
    parsed tool calls under "tool_calls"), every observation message."""
    completion: str = ""
    """The last assistant turn's text: what reward functions score."""
    turns: int = 0
    finish_reason: str = "stop"
    turn_rewards: list[float | None] = field(default_factory=list)
    env_reward: float | None = None
    """The sum of the turns' rewards; None when the environment gave none; 0 on env_error."""
    info: dict[str, float] = field(default_factory=dict)
    """The environment's counts summed over turns (tool_calls, tool_errors, ...)."""
    malformed_calls: int = 0
    env_time_s: float = 0.0
    error: str | None = None
    retokenize_diff: bool | None = None
    """Whether the ids differ from one tokenization of the final conversation."""


@dataclass
class Tokens:
    """A trajectory's token sequence and what the trainer needs of each response token."""

    prompt: list[int] = field(default_factory=list)
    response: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """The policy version of each response token: the version that sampled it, an
    environment's token that of the turn before it."""

    def add(
        self, ids: list[int], logprobs: list[float] | None, version: int | list[int] | None = None
    ):
        """Append sampled tokens (with their logprobs and the policy version that sampled them:
        one for all, or one per token) or, with None, the environment's."""
        self.response += ids
        self.mask += [0 if logprobs is None else 1] * len(ids)
        self.logprobs += [0.0] * len(ids) if logprobs is None else list(logprobs)
        if version is None:
            version = self.versions[-1] if self.versions else 0
        if isinstance(version, int):
            version = [version] * len(ids)
        if len(version) != len(ids):
            raise ValueError(f"{len(version)} token versions for {len(ids)} tokens")
        self.versions += version


class EnvironmentFailed(Exception):
    """The environment raised or timed out (the trajectory ends with env_error)."""


@dataclass
class TurnLimits:
    max_tokens: int
    """Per turn (rollout.sampling.max_tokens or the call's override)."""
    max_model_len: int


class EnvTrajectory:
    """Runs one trajectory against its environment in the calling thread (module docstring)."""

    def __init__(
        self,
        cfg: EnvConfig,
        make_env: Callable,
        fmt: ChatFormat,
        parse: Callable[[str], tuple] | None,
        decode: Callable[[list[int]], str],
        messages: list[dict],
        row: dict,
        base_seed: int,
        index: int,
        limits: TurnLimits,
    ):
        self.cfg, self.make_env, self.fmt, self.parse, self.decode = (
            cfg,
            make_env,
            fmt,
            parse,
            decode,
        )
        self.initial, self.row, self.base_seed, self.index = messages, row, base_seed, index
        self.limits = limits
        self.tokens = Tokens()
        self.record = TrajectoryRecord()
        self.bug: BaseException | None = None
        """An exception of megarl's own code (not the environment's): re-raised by the caller."""

    def run(self, batcher: TurnBatcher, client: Client) -> None:
        try:
            self._run(batcher, client)
        except EnvironmentFailed as e:
            self._end("env_error", str(e))
        except BaseException as e:  # noqa: BLE001 - handed to the engine's thread
            self.bug = e
        finally:
            batcher.finish(client)

    def _env_call(self, batcher: TurnBatcher, client: Client, fn, *args):
        """`fn(*args)` under the environment's time limit; EnvironmentFailed if it raises;
        None when the trajectory was abandoned meanwhile (it must then change nothing)."""
        t0 = time.perf_counter()
        failed = None
        try:
            with batcher.busy(client, self.cfg.timeout_s):
                out = fn(*args)
        except Exception as e:
            failed = e
        with batcher.lock:
            if client.timed_out:
                return None
            self.record.env_time_s += time.perf_counter() - t0
        if failed is not None:
            raise EnvironmentFailed(f"{type(failed).__name__}: {failed}") from failed
        return (out,)

    def abandoned(self) -> None:
        """Close the record of a trajectory whose environment ran past its time limit (call
        after the waves ended; its thread changes nothing more)."""
        self.record.env_time_s += self.cfg.timeout_s
        self._end(
            "env_error", f"the environment took longer than env.timeout_s={self.cfg.timeout_s}"
        )

    def sample(self, fallback_prompt: list[int]) -> Tokens:
        """The trajectory's tokens; an environment that failed before the first turn leaves
        only the data row's prompt (`fallback_prompt`), with no response."""
        if not self.tokens.prompt:
            return Tokens(prompt=list(fallback_prompt))
        return self.tokens

    def _run(self, batcher: TurnBatcher, client: Client) -> None:
        rec, tok, cfg = self.record, self.tokens, self.cfg
        seed = turn_seed(self.base_seed, 0, self.index)
        made = self._env_call(batcher, client, self._start, seed)
        if made is None:
            return
        env, messages = made[0]
        rec.messages = copy.deepcopy(messages)
        tok.prompt = self.fmt.prompt_ids(messages)
        last_stop = None
        for turn in range(cfg.max_turns):
            room = min(
                self.limits.max_tokens,
                cfg.max_tokens - len(tok.response),
                self.limits.max_model_len - len(tok.prompt) - len(tok.response),
            )
            if room < 1:
                return self._end("length")
            ask = TurnRequest(
                tok.prompt + tok.response, turn_seed(self.base_seed, turn, self.index), room
            )
            out = batcher.ask(client, ask)
            tok.add(out.ids, out.logprobs, out.version)
            rec.turns += 1
            text = self.decode(out.ids)
            content, calls, malformed = self.parse(text) if self.parse else (text, (), None)
            said = {"role": "assistant", "content": text}
            if calls:
                said["tool_calls"] = [
                    {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in calls
                ]
            rec.messages.append(said)
            rec.completion = text
            last_stop = out.ids[-1] if out.finish_reason == "stop" else None
            if out.finish_reason != "stop":
                return self._end("length", last_stop=last_stop)
            rec.malformed_calls += malformed is not None
            if malformed is not None and cfg.on_tool_error == "end":
                return self._end("env_error", f"malformed tool call: {malformed}", last_stop)
            said_turn = AssistantTurn(text, content, tuple(calls), malformed, turn)
            answered = self._env_call(batcher, client, env.step, said_turn)
            if answered is None:
                return
            obs = self._check(answered[0])
            rec.turn_rewards.append(obs.reward)
            for k, v in obs.info.items():
                rec.info[k] = rec.info.get(k, 0.0) + float(v)
            if cfg.on_tool_error == "end" and obs.info.get("tool_errors"):
                why = "a tool call failed (env.on_tool_error=end)"
                return self._end("env_error", why, last_stop)
            if obs.done:
                return self._end("stop", last_stop=last_stop)
            if turn == cfg.max_turns - 1:
                return self._end("max_turns", last_stop=last_stop)
            ids = self.fmt.observation_ids(obs.messages, last_stop)
            if len(tok.response) + len(ids) >= cfg.max_tokens:  # no room left to answer it
                return self._end("length", last_stop=last_stop)
            tok.add(ids, None)
            rec.messages += copy.deepcopy(obs.messages)
        return self._end("max_turns", last_stop=last_stop)

    def _start(self, seed: int):
        env = self.make_env()
        messages = env.reset(copy.deepcopy(self.initial), dict(self.row), seed)
        if not isinstance(messages, list) or not messages:
            raise TypeError(f"reset() returned {type(messages).__name__}; expected chat messages")
        return env, messages

    @staticmethod
    def _check(obs) -> Observation:
        if not isinstance(obs, Observation):
            raise EnvironmentFailed(
                f"step() returned {type(obs).__name__}; expected megarl.envs.Observation"
            )
        bad = [m for m in obs.messages if not isinstance(m, dict) or "role" not in m]
        if bad:
            raise EnvironmentFailed(f"step() returned messages without a role: {bad[:2]}")
        return obs

    def _end(self, reason: str, error: str | None = None, last_stop: int | None = None) -> None:
        rec = self.record
        rec.finish_reason, rec.error = reason, error
        given = [r for r in rec.turn_rewards if r is not None]
        rec.env_reward = 0.0 if reason == "env_error" else (float(sum(given)) if given else None)
        if rec.turns and reason != "env_error":
            again = self.fmt.retokenized(rec.messages, last_stop)
            rec.retokenize_diff = again != self.tokens.prompt + self.tokens.response
