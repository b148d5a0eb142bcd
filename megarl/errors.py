"""User errors: mistakes in what a person gave megarl, reported as one line instead of a traceback.

A user error is one the person running megarl can fix from the message alone, without reading
megarl's code: a config key, value or override, a data file, a model / tokenizer / checkpoint
directory, a reward function's import path, a parallel layout that does not fit the world size
or the model, an optional package that is not installed, an output path that already holds
files. Each is raised as a subclass of `UserError` whose message names the file, key or value and
what would be accepted. The subclasses also derive from the built-in type callers already catch
(`ConfigError` is a `ValueError`, `OutputExistsError` a `FileExistsError`, ...), so library code
that catches those keeps working.

This class is the one place that decides what is a user error: the command-line tools
(`megarl`, `tools/convert.py`, through `megarl.console.run_guarded`) print a `UserError` as
`megarl: error: <message>` and exit with status 2; any other exception is a bug in megarl or a
library and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """An error in the user's input; the message alone says what to change."""


class MissingDependencyError(UserError, ImportError):
    """An optional package that a chosen feature needs is not installed; names what to install."""


class OutputExistsError(UserError, FileExistsError):
    """An output path that already holds files; names the option that replaces it."""


class ConfigError(UserError, ValueError):
    """A config key or value that cannot be used; names the dotted key (`megarl.config`)."""
