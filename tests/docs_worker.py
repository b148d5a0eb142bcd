"""The child process of the docs check (`tests/docs_check.py`): the checks that need megarl's
command line, all in one interpreter so that the imports are paid once.

`python -m tests.docs_worker JOBS.json RESULTS.json` reads a list of jobs (`{"id", "kind":
"megarl" | "tool" | "python" | "cli", ...}`), runs each with its output captured, and writes
`{id: [ok, text, seconds]}` (`in_one_process` starts it). megarl's `train --print-config`,
`train --dry-run`, `plan`, `config` and `prepare-data` run for real (`prepare-data` into a
scratch directory), "cli" jobs as they are (tests/test_examples.py); every other
command is parsed by its own argparse parser with `parse_args` stopped right after parsing
(`_parse_only`), so nothing after the parser runs.
"""

from __future__ import annotations

import argparse
import contextlib
import doctest
import functools
import io
import json
import logging
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from tests.docs_check import ROOT, key_problem


class _Parsed(Exception):
    def __init__(self, namespace):
        super().__init__("parsed")
        self.namespace = namespace


@contextlib.contextmanager
def _parse_only():
    """Every argparse `parse_args` raises `_Parsed` right after parsing: the command's own
    parser checks the arguments and nothing after it runs."""
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    argparse.ArgumentParser.parse_args = parse_args
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = original


def _captured(fn) -> tuple[int | None, str, object]:
    """(exit status or None, stdout + stderr, the value or `_Parsed`) of `fn()`."""
    out = io.StringIO()
    code, value = None, None
    # the root logger's handlers keep the stream they were made with (the first job's buffer):
    # point them at this job's for its duration
    handlers = [h for h in logging.getLogger().handlers if type(h) is logging.StreamHandler]
    streams = [h.stream for h in handlers]
    for handler in handlers:
        handler.setStream(out)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            value = fn()
            code = value if isinstance(value, int) else 0
        except _Parsed as p:
            value, code = p, 0
        except SystemExit as e:
            code = 0 if e.code is None else e.code if isinstance(e.code, int) else 2
        except Exception as e:  # noqa: BLE001 - reported as the check's failure
            print(f"{type(e).__name__}: {e}", file=out)
            code = 1
        finally:
            for handler, stream in zip(handlers, streams, strict=True):
                handler.setStream(stream)
    return code, out.getvalue(), value


@functools.cache
def subcommands() -> frozenset[str]:
    """The subcommands `megarl --help` lists."""
    from megarl import cli

    _, text, _ = _captured(lambda: cli.parse_args(["--help"]))
    names = re.search(r"\{([^}]+)\}", text)
    return frozenset(names.group(1).split(",") if names else ())


def _args_check(argv: list[str]) -> tuple[bool, str]:
    from megarl import cli

    with _parse_only():
        code, text, value = _captured(lambda: cli.main(list(argv)))
    if isinstance(value, _Parsed):
        ns = value.namespace
        for o in getattr(ns, "overrides", None) or []:
            problem = key_problem(o.split("=", 1)[0])
            if problem:
                return False, problem
        if argv[0] == "bench" and getattr(ns, "suite", None):
            from megarl.benchmarks import SUITE_MODULES

            if ns.suite != "all" and ns.suite not in SUITE_MODULES:
                return False, f"--suite {ns.suite}: suites are {sorted(SUITE_MODULES)} and all"
        return True, "arguments parse"
    return False, f"exit status {code}: {text.strip()[-1500:]}"


def _tool_check(argv: list[str]) -> tuple[bool, str]:
    import importlib.util

    path = ROOT / argv[0]
    if not path.is_file():
        return False, f"{argv[0]}: no such file"
    spec = importlib.util.spec_from_file_location(f"_doc_tool_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with _parse_only():
        code, text, value = _captured(lambda: module.main(list(argv[1:])))
    if isinstance(value, _Parsed):
        return True, "arguments parse"
    return False, f"exit status {code}: {text.strip()[-1500:]}"


def _without(argv: list[str], option: str) -> list[str]:
    out, skip = [], False
    for w in argv:
        if skip:
            skip = False
        elif w == option:
            skip = True
        elif not w.startswith(option + "="):
            out.append(w)
    return out


def _run_megarl(argv: list[str], accept=(0,)) -> tuple[bool, str]:
    from megarl import cli

    code, text, _ = _captured(lambda: cli.run_command(cli.parse_args(list(argv))))
    return code in accept, f"exit status {code}: {text.strip()[-1500:]}"


def run_megarl_check(c: dict, scratch: str) -> tuple[bool, str]:
    argv, mode = list(c["argv"]), c["mode"]
    if argv and argv[0] not in subcommands() and not argv[0].startswith("-"):
        return False, f"megarl has no subcommand {argv[0]!r} (it has {sorted(subcommands())})"
    if mode == "help":
        from megarl import cli

        code, text, _ = _captured(lambda: cli.main(list(argv)))
        return code == 0 and "usage:" in text, f"exit status {code}: {text.strip()[-1500:]}"
    if mode == "args":
        return _args_check(argv)
    if mode == "dry-run":
        return _run_megarl(argv)
    if mode == "print-config":
        argv = _without(_without(argv, "--out"), "--verbose") + ["--print-config"]
        ok, text = _run_megarl(argv)
        if ok and c.get("world"):
            ok, text = _dry_run_at(argv[:-1], c["world"])
        return ok, text
    if argv[0] == "plan":
        return _run_megarl(argv, accept=(0, 1))
    if argv[0] == "prepare-data":
        out = os.path.join(scratch, f"prepared_{abs(hash(tuple(argv)))}.jsonl")
        from megarl import cli

        argv = _without(argv, "--out") + ["--out", out]
        code, text, _ = _captured(lambda: cli.main(argv))
        return code == 0 and os.path.exists(out), f"exit status {code}: {text.strip()[-1500:]}"
    return _run_megarl(argv)


def _dry_run_at(argv: list[str], world: int) -> tuple[bool, str]:
    """A torchrun command's layout at its world size, when the model's shape is at hand."""
    from megarl.config import load_config

    config = argv[1] if len(argv) > 1 and not argv[1].startswith("-") else None
    overrides = [argv[i + 1] for i, w in enumerate(argv[:-1]) if w == "--set"]
    cfg = load_config(config, overrides)
    if cfg.model.config is None and not (cfg.model.hf and (ROOT / cfg.model.hf).exists()):
        return True, "resolved (the model's shape is not in the repository: no dry run)"
    return _run_megarl([*argv, "--dry-run", "--world-size", str(world)])


SKETCH = "# sketch"  # a block that starts so needs the reader's own files: compiled, not run


def run_python(code: str) -> tuple[bool, str]:
    if code.lstrip().startswith(SKETCH):
        try:
            compile(code, "doc", "exec")
        except SyntaxError as e:
            return False, f"SyntaxError: {e}"
        return True, "compiled (a sketch of the reader's own paths: not run)"
    if ">>>" in code:
        test = doctest.DocTestParser().get_doctest(code, {}, "doc", "doc", 0)
        runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
        out = io.StringIO()
        runner.run(test, out=out.write)
        return runner.failures == 0, out.getvalue()[-1500:]
    status, text, _ = _captured(lambda: exec(compile(code, "doc", "exec"), {"__name__": "doc"}))
    return status == 0, text[-1500:]


def in_one_process(jobs: list[dict], tmp: Path, timeout: float = 600) -> dict:
    """Run `jobs` in one child interpreter (`python -m tests.docs_worker`): {id: [ok, text,
    seconds]}. Kind "cli": `{"id", "kind": "cli", "argv": [...], "status": 0}`, a megarl command
    line run as it is, ok = its exit status is `status`, text = everything it printed (logging
    included) and then `[exit status N]`."""
    import subprocess

    (tmp / "jobs.json").write_text(json.dumps(jobs))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.docs_worker", str(tmp / "jobs.json"), str(tmp / "out.json")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return json.loads((tmp / "out.json").read_text())


def main(argv: list[str]) -> int:
    """`python -m tests.docs_check JOBS.json RESULTS.json`: run the jobs, write
    {id: [ok, text, seconds]}."""
    os.chdir(ROOT)
    jobs, results_path = json.loads(Path(argv[0]).read_text()), Path(argv[1])
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for job in jobs:
            t0 = time.perf_counter()
            try:
                if job["kind"] == "megarl":
                    ok, text = run_megarl_check(job, scratch)
                elif job["kind"] == "cli":  # a plain command: its status and all its output
                    from megarl import cli

                    line = list(job["argv"])
                    code, text, _ = _captured(lambda: cli.run_command(cli.parse_args(line)))  # noqa: B023
                    ok = code == job.get("status", 0)
                    text = f"{text}[exit status {code}]"
                elif job["kind"] == "tool":
                    ok, text = _tool_check(job["argv"])
                else:
                    ok, text = run_python(job["code"])
            except Exception as e:  # noqa: BLE001 - one job's failure, reported with it
                ok, text = False, f"{type(e).__name__}: {e}"
            results[job["id"]] = (ok, text, round(time.perf_counter() - t0, 2))
    results_path.write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
