"""The `tools` environment: Python functions as tools; a turn without a call is the answer.

`tools` lists built-in tools (`BUILTIN_TOOLS`: `calculator`) or plugin specs of functions
(`megarl.plugins`: 'pkg.module:fn', 'path/to/file.py:fn'); each function needs type hints and
a Google-style docstring (`megarl.envs.tool_calls.tool_schema`), and is called with the
model's JSON arguments as keywords. Each call gets one tool message: the result as text, or
"error: ..." for an unknown tool, bad arguments, a raise or a call past `tool_timeout_s`
(`call_tool`; such a call keeps running in the background). With `on_tool_error="end"` the
first error (or a malformed call) ends the trajectory instead.

The final answer (a turn without a call) ends the trajectory with no reward of its own:
reward functions score it. With `answer_key` set, it is also checked against the row's
column like `retry` does (last number, exactly): reward 1.0 or 0.0.
"""

from __future__ import annotations

import ast
import copy
import math
import operator
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from megarl.envs.base import AssistantTurn, Environment, Observation, ToolCall
from megarl.envs.config import ON_TOOL_ERROR
from megarl.envs.retry import row_answer
from megarl.envs.tool_calls import ToolSetupError, call_tool, tool_schema
from megarl.plugins import PluginError, load_object
from megarl.rewards.builtins import last_number

MAX_EXPRESSION_CHARS = 1000
MAX_RESULT_BITS = 10_000
"""Largest integer `calculator` computes (about 3,000 digits), checked before a power."""

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: Numbers combined with + - * / // % ** and parentheses, e.g. "(2 + 3) * 4".
    """
    if not isinstance(expression, str):
        raise ValueError(f"expression must be a string; got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"not an arithmetic expression: {expression!r} ({err.msg})") from None
    return str(_evaluate(tree.body))


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"only numbers are allowed; got {value!r}")
        return value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            value = _BINARY[type(node.op)](left, right)
        except OverflowError:
            raise ValueError("the result is too large") from None
        if isinstance(value, int) and value.bit_length() > MAX_RESULT_BITS:
            raise ValueError("the result is too large")
        if isinstance(value, complex):
            raise ValueError("the result is not a real number")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError("the result is too large")
        return value
    allowed = "numbers, + - * / // % ** and parentheses"
    raise ValueError(f"{ast.unparse(node)!r} is not allowed; allowed: {allowed}")


def _check_power(base: int | float, exponent: int | float) -> None:
    """Refuses a power whose integer result would pass `MAX_RESULT_BITS` (before computing)."""
    if isinstance(base, int) and isinstance(exponent, int) and abs(base) > 1:
        if exponent > MAX_RESULT_BITS or (base.bit_length() - 1) * exponent > MAX_RESULT_BITS:
            raise ValueError(f"the exponent {exponent} is too large")


BUILTIN_TOOLS: dict[str, Callable[..., Any]] = {"calculator": calculator}
"""Built-in tool names -> functions."""


@lru_cache(maxsize=256)
def _resolve(spec: str) -> tuple[Callable[..., Any], dict]:
    """A tool spec's function and schema, loaded once per process (one environment is made per
    trajectory)."""
    if spec in BUILTIN_TOOLS:
        fn = BUILTIN_TOOLS[spec]
    else:
        try:
            fn = load_object(spec, what="env.kwargs.tools")
        except PluginError as err:
            raise ToolSetupError(f"{err}; built-in tools: {', '.join(BUILTIN_TOOLS)}") from err
        if not callable(fn):
            raise ToolSetupError(
                f"env.kwargs.tools {spec!r} is a {type(fn).__name__}; accepted: a function"
            )
    return fn, tool_schema(fn)


class ToolsEnv(Environment):
    """Runs the model's tool calls; a turn without one is the final answer (module docstring).

    tools: built-in names or plugin specs (or the functions themselves). tool_timeout_s: the
    longest one call may run (`env.tool_timeout_s`). on_tool_error: "message" (the error goes
    back as the tool's answer) or "end" (the trajectory ends at the first error;
    `env.on_tool_error`). answer_key: a column to check the final answer against, or None.
    """

    def __init__(
        self,
        tools: list[str] | tuple = ("calculator",),
        tool_timeout_s: float = 10.0,
        on_tool_error: str = "message",
        answer_key: str | None = None,
    ):
        if isinstance(tools, str) or not tools:
            raise ToolSetupError(
                f"env.kwargs.tools={tools!r}; accepted: a non-empty list of built-in tools "
                f"({', '.join(BUILTIN_TOOLS)}) or function paths 'pkg.module:fn'"
            )
        if on_tool_error not in ON_TOOL_ERROR:
            raise ToolSetupError(
                f"on_tool_error={on_tool_error!r}; accepted: {' or '.join(ON_TOOL_ERROR)}"
            )
        if not tool_timeout_s > 0:
            raise ToolSetupError(f"tool_timeout_s={tool_timeout_s!r}; accepted: > 0")
        self.functions: dict[str, Callable[..., Any]] = {}
        self.tools: list[dict] = []
        for item in tools:
            fn, schema = (item, tool_schema(item)) if callable(item) else _resolve(item)
            name = schema["function"]["name"]
            if name in self.functions:
                raise ToolSetupError(f"env.kwargs.tools: two tools are named {name!r}")
            self.functions[name] = fn
            self.tools.append(copy.deepcopy(schema))
        self.tool_timeout_s = float(tool_timeout_s)
        self.on_tool_error = on_tool_error
        self.answer_key = answer_key
        self.answer = None

    def reset(self, messages: list[dict], row: dict[str, Any], seed: int) -> list[dict]:
        """Remembers the number in the row's `answer_key` column (when set; `row_answer`
        raises when it is missing or holds none); the conversation is unchanged."""
        if self.answer_key is not None:
            self.answer = row_answer(row, self.answer_key, "tools")
        return messages

    def step(self, turn: AssistantTurn) -> Observation:
        """Tool messages for the turn's calls, or the end (final answer / first error)."""
        end = self.on_tool_error == "end"
        messages: list[dict] = []
        errors = 0
        if turn.malformed:
            errors += 1
            if end:
                return Observation(done=True, info=_counts(0, errors))
            messages.append({"role": "tool", "content": f"error: {turn.malformed}"})
        if not turn.tool_calls and not turn.malformed:
            return Observation(reward=self._score(turn), done=True, info=_counts(0, 0))
        for k, call in enumerate(turn.tool_calls, start=1):
            result, error = self._run(call)
            errors += error is not None
            if error is not None and end:
                return Observation(done=True, info=_counts(k, errors))
            messages.append(
                {
                    "role": "tool",
                    "name": call.name,
                    "tool_call_id": call.id,
                    "content": result if error is None else f"error: {error}",
                }
            )
        return Observation(messages=messages, info=_counts(len(turn.tool_calls), errors))

    def _run(self, call: ToolCall) -> tuple[str, str | None]:
        fn = self.functions.get(call.name)
        if fn is None:
            return "", f"unknown tool {call.name!r}; the tools: {', '.join(self.functions)}"
        return call_tool(fn, call.arguments, self.tool_timeout_s)

    def _score(self, turn: AssistantTurn) -> float | None:
        if self.answer_key is None:
            return None
        return float(last_number(turn.content) == self.answer)


def _counts(calls: int, errors: int) -> dict[str, float]:
    return {"tool_calls": calls, "tool_errors": errors}
