"""Loading a user's Python object (an environment class, an agent, a reward function, a tool)
from a string in the config.

Three forms are accepted:

- `package.module:attr` (the module on the Python path; `attr` may be dotted, `Class.method`);
- `package.module.attr` (the last dot separates the attribute);
- `path/to/file.py:attr` (a file, relative to the current directory or absolute).

A file is loaded once per process under a module name derived from its absolute path
(`megarl_plugin_<stem>_<hash>`) and registered in `sys.modules`, so dataclasses, pickling and
`isinstance` checks work within the process, and loading the same file again returns the same
objects. Another process that unpickles its objects must load the same spec first (the module
name is the same there). The file's folder is not added to `sys.path`: its own imports resolve
as any module's do.

Failures raise `PluginError` (a `UserError` and a `ValueError`) naming the config key
(`what`), the spec and what would be accepted.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Any

from megarl.errors import UserError

FORMS = "'package.module:name', 'package.module.name' or 'path/to/file.py:name'"
"""The accepted spellings, for error messages."""


class PluginError(UserError, ValueError):
    """A plugin spec that does not resolve; names the config key, the spec and the cause."""


@dataclass(frozen=True)
class PluginSpec:
    """A spec split into where the object lives and its attribute path."""

    target: str
    """A dotted module name, or a file path (`is_file`)."""
    attr: str
    """The attribute in the module, possibly dotted (`Class.method`)."""
    is_file: bool


def parse_spec(spec: str) -> PluginSpec | None:
    """`spec` split into module or file and attribute; None when it has none of the accepted
    forms (`FORMS`)."""
    if not isinstance(spec, str):
        return None
    if ":" in spec:
        target, _, attr = spec.rpartition(":")
        is_file = target.endswith(".py") or "/" in target or os.sep in target
    else:
        target, _, attr = spec.rpartition(".")
        is_file = False
    if not target or not attr or not all(part.isidentifier() for part in attr.split(".")):
        return None
    if not is_file and not all(part.isidentifier() for part in target.split(".")):
        return None
    return PluginSpec(target, attr, is_file)


def load_object(spec: str, *, what: str) -> Any:
    """The object `spec` names (module docstring for the forms).

    what: the config key the spec came from (e.g. "env.name"), used in error messages.
    Raises `PluginError` for a malformed spec, a module that cannot be imported, a file that is
    missing or raises while loading, and a missing attribute. The object itself is not checked
    (callers check that it is callable, a class, ...).
    """
    parsed = parse_spec(spec)
    if parsed is None:
        raise PluginError(f"{what} {spec!r} is not a plugin path; accepted: {FORMS}")
    if parsed.is_file:
        module = _load_file(parsed.target, spec, what)
        where = f"file {parsed.target}"
    else:
        try:
            module = importlib.import_module(parsed.target)
        except ImportError as err:
            raise PluginError(
                f"{what} {spec!r}: cannot import {parsed.target!r}: {err} (a module must be on "
                "the Python path; a file is written 'path/to/file.py:name')"
            ) from err
        where = f"module {parsed.target!r}"
    obj: Any = module
    for part in parsed.attr.split("."):
        if not hasattr(obj, part):
            raise PluginError(
                f"{what} {spec!r}: {where} has no {parsed.attr!r}; it defines: "
                f"{_public_names(module)}"
            )
        obj = getattr(obj, part)
    return obj


def _load_file(path: str, spec: str, what: str):
    """The module of the Python file `path`, loaded once per process (module docstring)."""
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise PluginError(
            f"{what} {spec!r}: no file {path!r} (relative paths are read from {os.getcwd()})"
        )
    stem = "".join(c if c.isalnum() else "_" for c in os.path.splitext(os.path.basename(full))[0])
    digest = hashlib.sha1(full.encode()).hexdigest()[:12]
    name = f"megarl_plugin_{stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, full)
    if module_spec is None or module_spec.loader is None:
        raise PluginError(f"{what} {spec!r}: {path!r} cannot be loaded as a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # before running it: dataclasses look their module up there
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise PluginError(
            f"{what} {spec!r}: loading file {path} raised {type(err).__name__}: {err}"
        ) from err
    return module


def _public_names(module) -> str:
    names = sorted(n for n in vars(module) if not n.startswith("_"))
    if not names:
        return "nothing public"
    shown = ", ".join(names[:20])
    return shown + (f", ... ({len(names)} names)" if len(names) > 20 else "")
