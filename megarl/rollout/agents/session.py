"""One agent trajectory's state on the endpoint (`AgentSession`): the requests an agent sends
through the OpenAI-compatible endpoint (`megarl.rollout.agents.endpoint`), served on the
endpoint's threads, each one turn through the `TurnBatcher`, token-exact. The trajectory that
opens it: `megarl.rollout.agents.agent.AgentTrajectory`, the agent counterpart of
`megarl.rollout.multi_turn.trajectory.EnvTrajectory`.

The token sequence is built as in `EnvTrajectory`, never re-tokenized: the first request's
messages (and tools) rendered once with the generation prompt; per request the sampled tokens
(mask 1, vLLM's logprobs); per later request the messages it adds after the last assistant turn
(tool / user) as their token delta (`ChatFormat.observation_ids`, mask 0, logprob 0). What this
assumes of the agent:
- A session is one conversation: each request resends the conversation so far (the roles and
  contents the session recorded; an assistant turn's content as it was returned, compared
  without whitespace, its tool calls free to come back re-serialized) and adds tool / user
  messages. Anything else is refused (400); an agent with several conversations opens one
  trajectory per conversation.
- One request at a time (a second one while the first runs gets 409).
- The first request's `tools` fix the session's tools (a later request must send the same).

Limits: the (max_turns + 1)-th request is refused (400) and the trajectory ends with finish
reason `max_turns`; a request that leaves no room for an answer under `env.max_tokens` (or the
engine's max_model_len) is refused and it ends with `length`. Every later request is refused the
same way. Time: the agent's own time between requests counts against `env.timeout_s`, per step
(the clock restarts after every answer); the time its requests wait for the model does not.

A trajectory ends with finish reason
- `max_turns` / `length`: a request was refused for that limit (whatever the agent did next:
  an agent that lets the `openai.BadRequestError` raise keeps the limit's reason, with no
  reward);
- `env_error`: the agent raised, ran past `env.timeout_s`, returned something other than a
  number or None, or never asked the model anything. Its reward is 0;
- `length`, too: the last turn ran to its token limit without a stop token;
- `stop`: otherwise (the agent returned).

A failure of megarl's own code while serving a request (a chat template without support, an
unknown `env.tool_parser`) is answered with 500 and kept in `bug`: the caller re-raises it.

Seeds: turn t of the trajectory at index i samples with `turn_seed(base, t, i)` as an
environment's does, and the agent gets the turn-0 seed.
"""

from __future__ import annotations

import copy
import secrets
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack

from megarl.rollout.agents.endpoint import ChatAnswer, ChatEndpoint, ChatRequest, EndpointError
from megarl.rollout.multi_turn.batcher import Client, TurnBatcher, TurnRequest
from megarl.rollout.multi_turn.trajectory import Tokens, TrajectoryRecord, TurnLimits
from megarl.rollout.seeds import turn_seed

NOT_EXTENDING = (
    "messages do not extend this session's conversation (a session is one token sequence; "
    "start a new session for a new conversation)"
)
OBSERVATION_ROLES = ("tool", "user")
"""The roles a request may add after the session's last assistant turn."""


def _squash(text: str) -> str:
    return "".join(text.split())


def _preview(text: str, n: int = 40) -> str:
    return text if len(text) <= n else text[:n] + "..."


class AgentSession:
    """The token-exact state of one agent trajectory, served by a `ChatEndpoint` (module
    docstring). The trajectory's thread calls `begin`, `end_agent`, `conclude`; the endpoint's
    threads call `chat`; the engine's thread calls `abandon` for a timed-out agent."""

    def __init__(self, endpoint: ChatEndpoint, base_seed: int, index: int, limits: TurnLimits):
        self.endpoint, self.cfg = endpoint, endpoint.cfg
        self.base_seed, self.index, self.limits = base_seed, index, limits
        self.token = secrets.token_hex(16)
        """The session's part of its URL (`/s/<token>/v1`)."""
        self.tokens = Tokens()
        self.record = TrajectoryRecord()
        self.fmt = None
        """The ChatFormat of the first request's tools (None before it)."""
        self.parser = None
        self.bug: BaseException | None = None
        """An exception of megarl's own code while serving a request (answered with 500)."""
        self.model_time_s = 0.0
        self._tools_key: str | None = None
        self._seen: list[tuple[str, str]] = []
        """(role, content) of every message the agent must resend, in order."""
        self._last_stop: int | None = None
        self._last_finish: str | None = None
        self._limit: tuple[str, str, str] | None = None
        """(finish reason, message, code) of the refusal that ended the session."""
        self._batcher: TurnBatcher | None = None
        self._client: Client | None = None
        self._cond = threading.Condition()
        self._in_flight = False
        self._closed = False
        self._agent_clock = ExitStack()
        self._began = 0.0

    # ------------------------------------------------------------------ trajectory side
    def begin(self, batcher: TurnBatcher, client: Client) -> None:
        """The agent starts now: its time limit runs (`batcher.busy`)."""
        self._batcher, self._client = batcher, client
        self._began = time.perf_counter()
        self._agent_clock.enter_context(batcher.busy(client, self.cfg.timeout_s))

    def end_agent(self) -> bool:
        """The agent returned: refuse further requests, wait for one still running, stop the
        clock. Returns whether the agent ran past its time limit (the session then changes
        nothing more: `abandon` closes the record)."""
        with self._cond:
            self._closed = True
            while self._in_flight:
                self._cond.wait()
        self._agent_clock.close()
        with self._batcher.lock:
            if self._client.timed_out:
                return True
        self.record.env_time_s = time.perf_counter() - self._began - self.model_time_s
        return False

    def conclude(self, error: str | None, reward: float | None) -> None:
        """The record's finish reason, reward and retokenize_diff, after `end_agent`;
        `error`: why the agent failed (None: it returned `reward`)."""
        rec = self.record
        if self._limit is not None:
            reason, error = self._limit[0], None
        elif error is not None:
            reason = "env_error"
        elif not rec.turns:
            reason, error = "env_error", "the agent returned without a request to its base_url"
        elif self._last_finish != "stop":
            reason = "length"
        else:
            reason = "stop"
        rec.finish_reason, rec.error = reason, error
        rec.env_reward = 0.0 if reason == "env_error" else reward
        if rec.turns and reason != "env_error":
            again = self.fmt.retokenized(rec.messages, self._last_stop)
            rec.retokenize_diff = again != self.tokens.prompt + self.tokens.response

    def abandon(self) -> None:
        """Close the record of an agent that ran past `env.timeout_s` (engine thread, after
        the waves ended; the agent's thread may still be running)."""
        with self._cond:
            self._closed = True
        self.endpoint.close_session(self.token)
        rec = self.record
        rec.env_time_s += self.cfg.timeout_s
        rec.finish_reason, rec.env_reward, rec.retokenize_diff = "env_error", 0.0, None
        rec.error = f"the agent took longer than env.timeout_s={self.cfg.timeout_s} for one step"

    # ------------------------------------------------------------------ endpoint side
    def chat(self, request: ChatRequest) -> ChatAnswer:
        """One assistant turn for `request`; EndpointError when it cannot be served."""
        with self._cond:
            if self._closed:
                raise EndpointError(409, "this session is over (its agent returned)", "closed")
            if self._in_flight:
                raise EndpointError(
                    409,
                    "another request of this session is still running; a session takes one "
                    "request at a time",
                    "session_busy",
                )
            self._in_flight = True
        try:
            return self._turn(request)
        except EndpointError:
            raise
        except BaseException as e:
            self.bug = e
            with self._cond:
                self._closed = True
            raise
        finally:
            with self._cond:
                self._in_flight = False
                self._cond.notify_all()

    def _turn(self, req: ChatRequest) -> ChatAnswer:
        cfg, tok = self.cfg, self.tokens
        if self._limit is not None:
            raise EndpointError(400, self._limit[1], self._limit[2])
        first = self.fmt is None
        if first:
            fmt = self.endpoint.chat_format(req.tools)
            parser = self.endpoint.tool_parser(req.tools)
            tail = copy.deepcopy(req.messages)
            added = self._rendered(lambda: fmt.prompt_ids(tail))
            prompt, used = added, 0
        else:
            fmt, parser = self.fmt, self.parser
            if req.tools_key != self._tools_key:
                raise EndpointError(
                    400,
                    "tools differ from this session's first request's (the prompt rendered "
                    "those once); send the same tools on every request",
                    "tools_changed",
                    "tools",
                )
            tail = self._tail(req.messages)
            if self.record.turns >= cfg.max_turns:
                self._refuse(
                    "max_turns",
                    f"this session had its env.max_turns={cfg.max_turns} assistant turns; no "
                    "more are sampled (the trajectory ends with finish reason max_turns)",
                    "max_turns_exceeded",
                )
            added = self._rendered(lambda: fmt.observation_ids(tail, self._last_stop))
            prompt, used = tok.prompt, len(tok.response) + len(added)
        room = min(
            self.limits.max_tokens,
            cfg.max_tokens - used,
            self.limits.max_model_len - len(prompt) - used,
            req.max_tokens or self.limits.max_tokens,
        )
        if room < 1:
            start = (fmt, parser, req.tools_key, prompt, tail) if first else None
            self._refuse(
                "length",
                f"no room for another turn: with this request's messages the trajectory holds "
                f"{used} response tokens of env.max_tokens={cfg.max_tokens} and "
                f"{len(prompt) + used} tokens of max_model_len={self.limits.max_model_len} "
                "(the trajectory ends with finish reason length)",
                "token_budget_exceeded",
                start,
            )
        self._stop_agent_clock()
        try:
            if first:
                self._start(fmt, parser, req.tools_key, prompt, tail)
            else:
                tok.add(added, None)
                self.record.messages += tail
                self._seen += [(m["role"], m["content"]) for m in tail]
            ids = tok.prompt + tok.response
            ask = TurnRequest(ids, turn_seed(self.base_seed, self.record.turns, self.index), room)
            t0 = time.perf_counter()
            out = self._batcher.ask(self._client, ask)
            self.model_time_s += time.perf_counter() - t0
            return self._said(out, parser if req.parse_tools else None, len(ids))
        finally:  # the agent's next step has a time limit of its own
            self._agent_clock.enter_context(self._batcher.busy(self._client, cfg.timeout_s))

    def _tail(self, messages: list[dict]) -> list[dict]:
        """The messages of a later request after the recorded ones (checked to extend them)."""
        n = len(self._seen)
        if len(messages) < n:
            raise EndpointError(
                400,
                f"{NOT_EXTENDING}: the request has {len(messages)} messages, the session's "
                f"conversation {n}",
                "not_extending",
                "messages",
            )
        for i, (role, content) in enumerate(self._seen):
            m = messages[i]
            if m["role"] != role or _squash(m["content"]) != _squash(content):
                raise EndpointError(
                    400,
                    f"{NOT_EXTENDING}: messages[{i}] is {m['role']} "
                    f"{_preview(m['content'])!r}, the session's is {role} {_preview(content)!r}",
                    "not_extending",
                    f"messages[{i}]",
                )
        tail = copy.deepcopy(messages[n:])
        roles = [m["role"] for m in tail]
        if not tail or any(r not in OBSERVATION_ROLES for r in roles):
            raise EndpointError(
                400,
                f"the messages after the session's last assistant turn have roles {roles}; "
                f"accepted: one or more of {', '.join(OBSERVATION_ROLES)} (the model's turns "
                "are sampled here, never sent)",
                "unexpected_roles",
                "messages",
            )
        return tail

    @staticmethod
    def _rendered(render: Callable[[], list[int]]) -> list[int]:
        try:
            return render()
        except Exception as e:  # noqa: BLE001 - the request's messages: the agent's to fix
            raise EndpointError(
                400,
                f"the policy's chat template / tokenizer cannot render these messages: "
                f"{type(e).__name__}: {e}",
                "unrenderable_messages",
                "messages",
            ) from e

    def _refuse(self, reason: str, message: str, code: str, start: tuple | None = None):
        """End the trajectory for a limit (`start`: the first request's format and prompt,
        recorded too) and raise the 400 every later request gets as well."""
        with self._batcher.lock:
            if self._client.timed_out:
                raise self._timed_out()
            if start is not None:
                self._start(*start)
            self._limit = (reason, message, code)
        raise EndpointError(400, message, code)

    def _timed_out(self) -> EndpointError:
        return EndpointError(
            409,
            f"this session is over: its agent took longer than env.timeout_s="
            f"{self.cfg.timeout_s} for one step",
            "session_timed_out",
        )

    def _stop_agent_clock(self) -> None:
        """Off the agent's clock while the model answers; a request that comes after the
        deadline is refused (the trajectory was abandoned: change nothing)."""
        self._agent_clock.close()
        with self._batcher.lock:
            if self._client.timed_out:
                raise self._timed_out()

    def _start(self, fmt, parser, tools_key: str, prompt: list[int], messages: list[dict]):
        self.fmt, self.parser, self._tools_key = fmt, parser, tools_key
        self.tokens.prompt = prompt
        self.record.messages = messages
        self._seen = [(m["role"], m["content"]) for m in messages]

    def _said(self, out, parser, prompt_tokens: int) -> ChatAnswer:
        """Record the sampled turn `out` (a TurnResult) and answer it."""
        rec = self.record
        self.tokens.add(out.ids, out.logprobs, out.version)
        turn = rec.turns
        rec.turns += 1
        text = self.endpoint.tokenizer.decode(out.ids, skip_special_tokens=True)
        content, calls, malformed = parser.parse(text) if parser is not None else (text, (), None)
        rec.malformed_calls += malformed is not None
        # ids numbered over the whole conversation: a template may render them
        calls = [
            {"id": f"call_{turn}_{k}", "name": c.name, "arguments": c.arguments}
            for k, c in enumerate(calls)
        ]
        said = {"role": "assistant", "content": text}
        if calls:
            said["tool_calls"] = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for c in calls
            ]
            rec.info["tool_calls"] = rec.info.get("tool_calls", 0.0) + len(calls)
        rec.messages.append(said)
        rec.completion = text
        self._seen.append(("assistant", content))
        self._last_finish = out.finish_reason
        self._last_stop = out.ids[-1] if out.finish_reason == "stop" else None
        if out.finish_reason != "stop":
            finish = "length"
        else:
            finish = "tool_calls" if calls else "stop"
        return ChatAnswer(content, calls, finish, prompt_tokens, len(out.ids))
