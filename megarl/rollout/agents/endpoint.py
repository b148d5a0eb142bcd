"""An OpenAI-compatible chat endpoint in front of the policy: an agent written against the
`openai` client is the environment of its trajectory (`env.agent`).

`ChatEndpoint` is a stdlib `ThreadingHTTPServer` on 127.0.0.1 (a free port), served from a
daemon thread. Each trajectory opens a session (`Session`; the agent's,
`megarl.rollout.agents.agent.AgentSession`, the token-exact state of one trajectory) and gets
its own base URL, `http://127.0.0.1:PORT/s/<random token>/v1`, so an unmodified
`openai.OpenAI(base_url=url, api_key="x")` talks to that session alone. Routes:

- `POST /s/<token>/v1/chat/completions`: one assistant turn (non-streaming);
- `GET /s/<token>/v1/models` (and `/models/megarl-policy`): the one model, "megarl-policy".

What the endpoint assumes and simplifies:
- A session is one token sequence: every request after the first must resend the
  conversation so far and add tool / user messages (`AgentSession` checks it).
- Sampling is the trainer's, on-policy: the request's `temperature`, `top_p`, `stop`,
  `seed`, `logprobs`, `response_format` and `model` are ignored; `max_tokens` /
  `max_completion_tokens` can only lower a turn's limit; `tool_choice: "none"` turns tool-call
  parsing off (other values are read as "auto": sampling cannot be forced to call a tool);
  `stream: true` and `n > 1` are refused.
- Errors are OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with status
  400 (a request this session cannot serve), 404 (no such route or session), 409 (a request
  while another of the session is running, or a session that is over) and 500 (a bug in
  megarl: the trajectory re-raises it). Every error carries `x-should-retry: false`, so the
  `openai` client does not resend a request that would fail the same way.
- The chat format (`megarl.rollout.multi_turn.chat_format.ChatFormat`) and the tool parser
  (`megarl.envs.tool_calls.ToolCallParser`) of a list of tools are built once and shared by
  every session that sends the same tools (vLLM's non-streaming parsers keep no state).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from megarl.envs.config import EnvConfig
from megarl.envs.tool_calls import ToolCallParser
from megarl.rollout.multi_turn.chat_format import ChatFormat

log = logging.getLogger(__name__)

MODEL_ID = "megarl-policy"
"""The one model the endpoint lists (requests may name any model)."""
_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    409: "conflict_error",
    500: "server_error",
}


class EndpointError(Exception):
    """A request the endpoint answers with an OpenAI-style error (status 400, 404 or 409)."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": _ERROR_TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }


def _bad(message: str, code: str = "invalid_request", param: str | None = None) -> EndpointError:
    return EndpointError(400, message, code, param)


@dataclass(frozen=True)
class ChatRequest:
    """What the endpoint reads of a `/chat/completions` body (module docstring)."""

    messages: list[dict]
    """The conversation, each message's content as plain text."""
    tools: list[dict] | None
    tools_key: str
    """The tools as canonical JSON ("null" without tools): the cache key of their format."""
    parse_tools: bool
    """False for `tool_choice: "none"`."""
    max_tokens: int | None

    @staticmethod
    def from_json(body: Any) -> ChatRequest:
        """The request in `body` (a decoded JSON object); EndpointError (400) naming the key."""
        if not isinstance(body, dict):
            raise _bad(f"the request body is a JSON {type(body).__name__}; expected an object")
        if body.get("stream"):
            raise _bad(
                "stream=true is not supported: this endpoint answers whole completions "
                "(call without stream, or stream=False)",
                "stream_unsupported",
                "stream",
            )
        if body.get("n") not in (None, 1):
            raise _bad(f"n={body['n']!r}; accepted: 1 (a session is one token sequence)", param="n")
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw:
            raise _bad("messages: expected a non-empty list of chat messages", param="messages")
        messages = [_message(m, i) for i, m in enumerate(raw)]
        tools = body.get("tools") or None
        if tools is not None and not (
            isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
        ):
            raise _bad("tools: expected a list of OpenAI function schemas", param="tools")
        limits = []
        for key in ("max_tokens", "max_completion_tokens"):
            value = body.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise _bad(f"{key}={value!r}; accepted: an integer >= 1", param=key)
            limits.append(value)
        return ChatRequest(
            messages=messages,
            tools=tools,
            tools_key=json.dumps(tools, sort_keys=True),
            parse_tools=body.get("tool_choice") != "none",
            max_tokens=min(limits) if limits else None,
        )


def message_text(content: Any, where: str) -> str:
    """A message's content as text: a string, text parts joined, None as ""."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise _bad(
        f"{where}.content: expected a string or a list of text parts "
        '([{"type": "text", "text": ...}]); images and audio are not supported',
        param=f"{where}.content",
    )


def _message(m: Any, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise _bad(f"{where}: expected an object with a string 'role'", param=where)
    return {**m, "content": message_text(m.get("content"), where)}


@dataclass(frozen=True)
class ChatAnswer:
    """One assistant turn, as the session hands it to the endpoint."""

    content: str
    tool_calls: list[dict]
    """[{"id", "name", "arguments": dict}] in the order the model made them."""
    finish_reason: str
    """"tool_calls", "stop" or "length" (the turn ran to its token limit: it wins)."""
    prompt_tokens: int
    completion_tokens: int


def completion_json(answer: ChatAnswer, completion_id: str, created: int) -> dict:
    """The `chat.completion` object of `answer`."""
    message: dict[str, Any] = {"role": "assistant", "content": answer.content}
    if answer.tool_calls:
        message["tool_calls"] = [
            {
                "id": c["id"],
                "type": "function",
                "function": {
                    "name": c["name"],
                    "arguments": json.dumps(c["arguments"], ensure_ascii=False),
                },
            }
            for c in answer.tool_calls
        ]
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": MODEL_ID,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": answer.finish_reason,
                "logprobs": None,
            }
        ],
        "usage": {
            "prompt_tokens": answer.prompt_tokens,
            "completion_tokens": answer.completion_tokens,
            "total_tokens": answer.prompt_tokens + answer.completion_tokens,
        },
    }


MODELS_JSON = {
    "object": "list",
    "data": [{"id": MODEL_ID, "object": "model", "created": 0, "owned_by": "megarl"}],
}


class Session(Protocol):
    """One trajectory's state as the endpoint serves it (the agent's: `AgentSession`): its
    requests arrive under its token, each answered by `chat` (on the endpoint's threads)."""

    token: str

    def chat(self, request: ChatRequest) -> ChatAnswer:
        """One assistant turn; raises `EndpointError` to answer with an HTTP error."""


class ChatEndpoint:
    """The HTTP server and its sessions (module docstring). Use `start()` before
    `open_session`, `close()` at the end (or `with ChatEndpoint(...) as endpoint:`)."""

    def __init__(self, tokenizer, cfg: EnvConfig):
        self.tokenizer, self.cfg = tokenizer, cfg
        self._sessions: dict[str, Session] = {}
        self._formats: dict[str, ChatFormat] = {}
        self._parsers: dict[str, ToolCallParser] = {}
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ server
    def start(self) -> None:
        if self._server is not None:
            return
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        server.daemon_threads = True
        server.endpoint = self
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, name="megarl-chat-endpoint", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Stop serving (requests still running get no answer) and forget every session."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        self._server = self._thread = None
        with self._lock:
            self._sessions.clear()

    def __enter__(self) -> ChatEndpoint:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def url(self) -> str:
        """`http://127.0.0.1:PORT` (once started)."""
        if self._server is None:
            raise RuntimeError("ChatEndpoint.url: the endpoint is not started (call start())")
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    # ------------------------------------------------------------------ sessions
    def open_session(self, session: Session) -> str:
        """Serve `session` under its token; returns the base URL of an OpenAI client."""
        with self._lock:
            if session.token in self._sessions:
                raise ValueError(f"session {session.token} is open already")
            self._sessions[session.token] = session
        return f"{self.url}/s/{session.token}/v1"

    def close_session(self, token: str) -> None:
        """Requests to `token` get 404 from now on (closing twice is fine)."""
        with self._lock:
            self._sessions.pop(token, None)

    def chat_format(self, tools: list[dict] | None) -> ChatFormat:
        """The chat format of conversations with `tools` (built once per list of tools)."""
        key = json.dumps(tools or None, sort_keys=True)
        with self._lock:
            fmt = self._formats.get(key)
        if fmt is None:
            fmt = ChatFormat(self.tokenizer, tools or None)
            with self._lock:
                fmt = self._formats.setdefault(key, fmt)
        return fmt

    def tool_parser(self, tools: list[dict] | None) -> ToolCallParser | None:
        """`env.tool_parser` over `tools` (built once per list of tools); None without tools."""
        if not tools:
            return None
        key = json.dumps(tools, sort_keys=True)
        with self._lock:
            parser = self._parsers.get(key)
        if parser is None:
            parser = ToolCallParser(self.cfg.tool_parser, self.tokenizer, tools)
            with self._lock:
                parser = self._parsers.setdefault(key, parser)
        return parser

    # ------------------------------------------------------------------ requests
    def handle(self, method: str, path: str, body: bytes) -> tuple[int, dict]:
        """(status, JSON) of one HTTP request (the handler's only call)."""
        try:
            return 200, self._route(method, path.split("?", 1)[0], body)
        except EndpointError as e:
            return e.status, e.body()
        except Exception as e:  # noqa: BLE001 - a bug: the session keeps it for its trajectory
            log.exception("chat endpoint: %s %s failed", method, path)
            err = EndpointError(500, f"megarl failed on this request: {type(e).__name__}: {e}", "")
            return 500, err.body()

    def _route(self, method: str, path: str, body: bytes) -> dict:
        parts = path.strip("/").split("/")
        if len(parts) < 3 or parts[0] != "s" or parts[2] != "v1":
            raise EndpointError(
                404,
                f"no route {method} {path}; this endpoint serves POST /s/<session>/v1/chat/"
                "completions and GET /s/<session>/v1/models (use the base URL of a session)",
                "unknown_route",
            )
        with self._lock:
            session = self._sessions.get(parts[1])
        if session is None:
            raise EndpointError(
                404, f"no open session {parts[1]!r} (it ended, or never existed)", "unknown_session"
            )
        rest = "/".join(parts[3:])
        if method == "GET" and rest == "models":
            return MODELS_JSON
        if method == "GET" and rest == f"models/{MODEL_ID}":
            return MODELS_JSON["data"][0]
        if method == "POST" and rest == "chat/completions":
            try:
                decoded = json.loads(body or b"null")
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise _bad(f"the request body is not JSON: {e}", "invalid_json") from None
            answer = session.chat(ChatRequest.from_json(decoded))
            return completion_json(answer, f"chatcmpl-{uuid.uuid4().hex}", int(time.time()))
        raise EndpointError(
            404,
            f"no route {method} /v1/{rest}; accepted: POST /v1/chat/completions, GET /v1/models",
            "unknown_route",
        )


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the openai client reuses its connection

    def _serve(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        status, out = self.server.endpoint.handle(method, self.path, body)
        data = json.dumps(out).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status != 200:
            self.send_header("x-should-retry", "false")
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._serve("GET")

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self._serve("POST")

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - http.server's name
        log.debug("chat endpoint: " + format, *args)
