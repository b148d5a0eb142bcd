"""What the terminal shows: user errors once (rank 0) and in torchrun's error file; a normal run
shows megarl's lines and the progress line, not vLLM's INFO lines nor the nanobind leak dump."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megarl import console
from megarl.config import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fail(exc: BaseException):
    def body() -> int:
        raise exc

    return body


def test_user_error_is_one_line_on_rank0_and_in_torchruns_error_file(tmp_path, monkeypatch, capsys):
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("RANK", "0")
    assert console.run_guarded(_fail(ConfigError("trainer.steps='x': expected an integer"))) == 2
    err = capsys.readouterr().err
    assert err == "megarl: error: trainer.steps='x': expected an integer\n"
    record = json.loads(error_file.read_text())["message"]
    assert record["message"] == "megarl: error: trainer.steps='x': expected an integer"
    assert "py_callstack" not in record["extraInfo"]  # torchrun then shows the message itself

    monkeypatch.setenv("RANK", "1")
    error_file.unlink()
    assert console.run_guarded(_fail(ConfigError("same on every rank"))) == 2
    assert capsys.readouterr().err == ""  # printed by rank 0 only
    assert "same on every rank" in error_file.read_text()


def test_a_bug_keeps_its_traceback(tmp_path, monkeypatch, capsys):
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    assert console.run_guarded(_fail(KeyError("oops"))) == 1
    assert "Traceback" in capsys.readouterr().err
    assert "KeyError" in json.loads(error_file.read_text())["message"]["extraInfo"]["py_callstack"]


def test_debug_prints_the_traceback_then_the_message(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    assert console.run_guarded(_fail(ConfigError("bad")), debug=True) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.endswith("megarl: error: bad\n")


def test_expected_vllm_warnings_are_filtered():
    import logging

    def record(name, level, msg):
        return logging.LogRecord(name, level, __file__, 1, msg, (), None)

    hidden = record("vllm.engine.arg_utils", logging.WARNING, "Enforce eager set, disabling ...")
    assert console._expected_library_record(hidden)
    assert not console._expected_library_record(
        record("vllm.x", logging.WARNING, "KV cache is too small")
    )
    assert not console._expected_library_record(
        record("vllm.x", logging.ERROR, "Enforce eager set")  # errors always show
    )
    assert not console._expected_library_record(record("megarl", logging.WARNING, "Triton is not"))


def _train(out, *args):
    cmd = [sys.executable, "-m", "megarl", "train", "--set", "trainer.steps=1", "--set",
           "logging.wandb=false", "--out", str(out), *args]
    return subprocess.run(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600
    )


@pytest.mark.slow
def test_a_normal_run_is_quiet_unless_verbose(tmp_path):
    proc = _train(tmp_path / "quiet")
    text = proc.stdout
    assert proc.returncode == 0, text[-3000:]
    lines = text.splitlines()
    assert any("megarl.progress INFO step 1/1 | reward_mean" in ln for ln in lines), text
    assert lines[-1].startswith("megarl: run directory "), text
    assert "nanobind" not in text and "Traceback" not in text, text
    library = [ln for ln in lines if " vllm" in ln or "Warning" in ln or "(MainProcess" in ln]
    assert library == [], library
    assert len(lines) <= 12, text  # measured: 8 lines (103 before the console was quietened)

    proc = _train(tmp_path / "verbose", "--verbose")
    text = proc.stdout
    assert proc.returncode == 0, text[-3000:]
    assert "INFO" in text and "Resolved architecture" in text  # vLLM's own INFO lines
    assert "nanobind: leaked" in text  # the interpreter's normal exit, as before


def test_exit_does_not_wait_forever_on_an_idle_thread_pool():
    """torch and vLLM leave idle ThreadPoolExecutor workers; the CLI's exit must stop them as
    interpreter shutdown does (a plain join of non-daemon threads hung a real run)."""
    code = (
        "import concurrent.futures\n"
        "from megarl.console import end_process\n"
        "concurrent.futures.ThreadPoolExecutor(2).submit(lambda: 1).result()\n"
        "end_process(3)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, timeout=60)
    assert proc.returncode == 3
