"""From `env.name` / `env.agent` to the objects a multi-turn rollout runs.

`env.name` is a built-in (`BUILTINS`) or a plugin spec (`megarl.plugins`): a class, or any
callable returning an environment, called as `cls(**env.kwargs)` once per trajectory. One
object is built when the factory is made, so a bad name, a class without `step` or a
constructor that rejects `env.kwargs` fails before any model is built, as one
`EnvironmentLoadError` naming `env.name` and `env.kwargs`.

Two settings of the `env` section reach the constructor without being repeated in
`env.kwargs`: a constructor parameter named `tool_timeout_s` or `on_tool_error` gets
`env.tool_timeout_s` / `env.on_tool_error`, unless `env.kwargs` sets it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial
from typing import Any

from megarl.envs.base import Environment
from megarl.envs.config import EnvConfig
from megarl.errors import UserError
from megarl.plugins import FORMS, PluginError, load_object, parse_spec

BUILTINS = {"retry": "megarl.envs.retry:RetryEnv", "tools": "megarl.envs.tools:ToolsEnv"}
"""Built-in environment names -> their plugin specs."""
INJECTED = ("tool_timeout_s", "on_tool_error")
"""`env` settings passed to a constructor that has a parameter of that name."""


class EnvironmentLoadError(UserError, ValueError):
    """An environment or agent that cannot be loaded or built; names `env.name` / `env.agent`,
    `env.kwargs` and the cause."""


def environment_factory(cfg: EnvConfig) -> Callable[[], Environment]:
    """A function building a new environment per call: `cls(**kwargs)`, where `kwargs` is
    `cfg.kwargs` plus the injected settings (module docstring).

    One environment is built here and dropped (the check). Raises `EnvironmentLoadError` when
    `cfg.name` is null or does not resolve, names something not callable or a class without a
    `step` method, or when building it raises.
    """
    name = cfg.name
    if name is None:
        raise EnvironmentLoadError("env.name is null; set a built-in, or a class path " + FORMS)
    spec = BUILTINS.get(name, name)
    if parse_spec(spec) is None:
        raise EnvironmentLoadError(
            f"env.name {name!r} is neither a built-in ({', '.join(BUILTINS)}) nor a class "
            f"path {FORMS}"
        )
    try:
        cls = load_object(spec, what="env.name")
    except PluginError as err:
        raise EnvironmentLoadError(str(err)) from err
    if not callable(cls):
        raise EnvironmentLoadError(
            f"env.name {name!r} is a {type(cls).__name__}; accepted: an environment class (or "
            "a callable returning an environment)"
        )
    if inspect.isclass(cls) and not callable(getattr(cls, "step", None)):
        raise EnvironmentLoadError(
            f"env.name {name!r}: class {cls.__name__} has no step() method; an environment "
            "needs step(turn) -> Observation (see megarl.envs.base.Environment)"
        )
    kwargs = dict(cfg.kwargs)
    accepted = _parameters(cls)
    for key in INJECTED:
        if key in accepted and key not in kwargs:
            kwargs[key] = getattr(cfg, key)
    try:
        env = cls(**kwargs)
    except Exception as err:
        params = f"; its parameters: ({', '.join(accepted)})" if accepted else ""
        raise EnvironmentLoadError(
            f"env.name {name!r} with env.kwargs={dict(cfg.kwargs)!r}: building the environment "
            f"raised {type(err).__name__}: {err}{params}"
        ) from err
    if not callable(getattr(env, "step", None)):
        raise EnvironmentLoadError(
            f"env.name {name!r} built a {type(env).__name__} without a step() method; an "
            "environment needs step(turn) -> Observation (see megarl.envs.base.Environment)"
        )
    return partial(cls, **kwargs)


def load_agent(cfg: EnvConfig) -> Callable[..., Any]:
    """The function `cfg.agent` names, called as fn(row, base_url, seed) -> reward | None.

    Raises `EnvironmentLoadError` when `cfg.agent` is null, does not resolve or is not
    callable.
    """
    spec = cfg.agent
    if spec is None:
        raise EnvironmentLoadError("env.agent is null; set a function path " + FORMS)
    try:
        fn = load_object(spec, what="env.agent")
    except PluginError as err:
        raise EnvironmentLoadError(str(err)) from err
    if not callable(fn):
        raise EnvironmentLoadError(
            f"env.agent {spec!r} is a {type(fn).__name__}, not callable; accepted: a function "
            "fn(row, base_url, seed) -> reward | None"
        )
    return fn


def _parameters(cls) -> list[str]:
    """The named parameters of `cls(...)` ([] when Python cannot tell)."""
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in signature.parameters.values() if p.kind in kinds]
