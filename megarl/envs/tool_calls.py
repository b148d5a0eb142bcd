"""Tool calls: reading them from the model's text, describing tools, running them.

- `ToolCallParser` reads a turn's calls with vLLM's own tool parser (`env.tool_parser`), the
  one vLLM's OpenAI server uses for the same model, so a model's format is read as it would be
  served. It assumes the non-streaming `extract_tool_calls(text, request)` of
  `vllm.tool_parsers` (vLLM 0.32) and that the parser keeps no state between calls (true of
  the non-streaming path). vLLM gives calls random ids; megarl numbers them `call00000`,
  `call00001`, ... within the turn, so a resumed run's conversations replay a straight run's.
- `tool_schema`, `template_renders_tools`, `tools_system_message`, `with_tools`: the tools'
  OpenAI function schemas and how they reach the prompt. A chat template that ignores
  `tools=` (SmolLM2's) gets them in a system message in Hermes format instead, which the
  `hermes` parser reads.
- `call_tool`: one call under a time limit. A Python thread cannot be killed: a tool that
  runs past its limit keeps running in the background (a daemon thread) and its result is
  dropped.
"""

from __future__ import annotations

import inspect
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from megarl.envs.base import ToolCall
from megarl.errors import UserError

START_MARKERS = ("tool_call_start_token", "bot_token")
"""Attributes of vLLM parsers holding the text a tool call starts with."""
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "megarl_probe_tool",
        "description": "A probe.",
        "parameters": {"type": "object", "properties": {}},
    },
}


class ToolSetupError(UserError, ValueError):
    """A tool parser, tool schema or tool that cannot be used; names the setting or function."""


class _Quiet(logging.Filter):
    """Drops the records of the threads that are inside `ToolCallParser.parse`."""

    def __init__(self):
        super().__init__()
        self.local = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(self.local, "on", False)


_QUIET = _Quiet()


class ToolCallParser:
    """vLLM's tool parser `name` over `tokenizer` (module docstring).

    name: a name of `vllm.tool_parsers.ToolParserManager` (hermes, llama3_json, mistral,
    pythonic, ...). tools: the OpenAI function schemas the model may call (some parsers read
    them, e.g. to type arguments). Raises `ToolSetupError` for an unknown name, a schema vLLM
    rejects, or a parser that cannot work with this tokenizer (llama3_json needs
    `<|python_tag|>` in the vocabulary).
    """

    def __init__(self, name: str, tokenizer, tools: list[dict] | None):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers import ToolParserManager

        self.name = name
        try:
            cls = ToolParserManager.get_tool_parser(name)
        except KeyError:
            raise ToolSetupError(
                f"env.tool_parser={name!r} is not one of vLLM's tool parsers; accepted: "
                f"{', '.join(ToolParserManager.list_registered())}"
            ) from None
        except ImportError as err:
            raise ToolSetupError(f"env.tool_parser={name!r} cannot be imported: {err}") from err
        try:
            self.request = ChatCompletionRequest(messages=[], model="megarl", tools=tools or None)
        except ValueError as err:  # pydantic's ValidationError
            raise ToolSetupError(
                f"the environment's tools are not OpenAI function schemas "
                f"({{'type': 'function', 'function': {{'name', 'parameters', ...}}}}): {err}"
            ) from err
        try:
            if "tools" in inspect.signature(cls).parameters:
                self.parser = cls(tokenizer, self.request.tools)
            else:
                self.parser = cls(tokenizer)
        except Exception as err:
            raise ToolSetupError(
                f"env.tool_parser={name!r} ({cls.__name__}) does not work with the policy's "
                f"tokenizer: {type(err).__name__}: {err}; choose the parser of the model's "
                "tool-call format"
            ) from err
        self.markers = tuple(
            m for m in (getattr(self.parser, a, None) for a in START_MARKERS) if isinstance(m, str)
        )
        """The texts a call starts with, when the parser names them."""
        for klass in type(self.parser).__mro__:
            if klass.__module__.startswith("vllm."):
                logging.getLogger(klass.__module__).addFilter(_QUIET)  # once: a set, in effect

    def parse(self, text: str) -> tuple[str, tuple[ToolCall, ...], str | None]:
        """`(content, calls, malformed)` of one assistant turn's text.

        content: the text without the calls (`text` when there are none). calls: the calls
        whose arguments are a JSON object, ids `call00000`, `call00001`, ... malformed: why a
        call could not be read (the parser found none but the text has a call's start marker,
        or a call's arguments are not a JSON object); None otherwise. vLLM's parsers log a
        traceback for a call they cannot read: those records are dropped while parsing, since
        the caller counts malformed calls itself.
        """
        _QUIET.local.on = True
        try:
            info = self.parser.extract_tool_calls(text, self.request)
        finally:
            _QUIET.local.on = False
        if not info.tools_called:
            found = [m for m in self.markers if m in text]
            malformed = (
                f"the {self.name} tool parser found no readable call after {found[0]!r}"
                if found
                else None
            )
            return text, (), malformed
        calls: list[ToolCall] = []
        problems: list[str] = []
        for call in info.tool_calls:
            fn = call.function
            try:
                arguments = json.loads(fn.arguments) if fn.arguments else {}
            except json.JSONDecodeError as err:
                problems.append(f"the arguments of {fn.name!r} are not JSON ({err})")
                continue
            if not isinstance(arguments, dict):
                problems.append(
                    f"the arguments of {fn.name!r} are a {type(arguments).__name__}, not a "
                    "JSON object"
                )
                continue
            calls.append(ToolCall(fn.name, arguments, f"call{len(calls):05d}"))
        content = info.content if info.content is not None else ""
        return content, tuple(calls), "; ".join(problems) or None


def tool_schema(fn: Callable) -> dict:
    """The OpenAI function schema of `fn` ({"type": "function", "function": {"name",
    "description", "parameters"}}), from its type hints and Google-style docstring
    (`transformers.utils.get_json_schema`). Raises `ToolSetupError` naming the function when
    an argument lacks a type hint or a description under `Args:`."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as err:  # DocstringParsingException, TypeHintParsingException
        where = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
        raise ToolSetupError(
            f"tool {where}: cannot describe it to the model: {err}; a tool needs a type hint on "
            "every argument and a docstring with a summary line and an 'Args:' section "
            "describing each argument"
        ) from err


def template_renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template writes `tools=` into the prompt: a probe
    conversation rendered with a probe tool differs from the same without (False when the
    template raises on tools)."""
    probe = [{"role": "user", "content": "MEGARL-PROBE-USER"}]
    plain = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
    try:
        with_probe = tokenizer.apply_chat_template(
            probe, tools=[_PROBE_TOOL], tokenize=False, add_generation_prompt=True
        )
    except Exception:  # noqa: BLE001 - a template that cannot render tools does not
        return False
    return with_probe != plain


def tools_system_message(schemas: list[dict]) -> str:
    """The system text describing `schemas` for a template without tool support, in Hermes
    format (the schemas as JSON lines inside <tools></tools>, calls as
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), as Qwen2.5's template writes
    it."""
    lines = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
    return (
        "# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def with_tools(messages: list[dict], schemas: list[dict]) -> list[dict]:
    """`messages` with `tools_system_message(schemas)` appended to the first system message
    (after a blank line), or as a system message inserted first; `messages` is not changed."""
    text = tools_system_message(schemas)
    out = list(messages)
    for i, m in enumerate(out):
        if m.get("role") == "system":
            content = m.get("content")
            if isinstance(content, list):  # content parts
                content = [*content, {"type": "text", "text": text}]
            else:
                content = f"{content}\n\n{text}" if content else text
            out[i] = {**m, "content": content}
            return out
    return [{"role": "system", "content": text}, *out]


def call_tool(fn: Callable, arguments: dict, timeout_s: float) -> tuple[str, str | None]:
    """`fn(**arguments)` in a daemon thread, waited for at most `timeout_s` seconds.

    Returns `(result, None)`, the result as text (a str as is, anything else as JSON), or
    `("", error)` when the arguments do not fit `fn`'s signature, `fn` raises
    (`"ValueError: ..."`) or runs past the limit (`"timed out after 10 s"`). A timed-out call
    cannot be stopped: its thread keeps running in the background and its result is dropped.
    """
    if not isinstance(arguments, dict):
        return "", f"the arguments are a {type(arguments).__name__}, not a JSON object"
    try:
        inspect.signature(fn).bind(**arguments)
    except TypeError as err:
        return "", f"bad arguments {sorted(arguments)}: {err}"
    except ValueError:  # no signature to check (a builtin): the call tells
        pass
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = fn(**arguments)
        except BaseException as err:  # noqa: BLE001 - reported to the model
            outcome["error"] = err

    worker = threading.Thread(target=run, name=f"tool-{getattr(fn, '__name__', 'fn')}")
    worker.daemon = True
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        return "", f"timed out after {timeout_s:g} s"
    if "error" in outcome:
        err = outcome["error"]
        return "", f"{type(err).__name__}: {err}"
    result = outcome.get("result")
    if isinstance(result, str):
        return result, None
    return json.dumps(result, ensure_ascii=False, default=str), None
