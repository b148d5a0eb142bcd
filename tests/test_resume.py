"""Resuming is one step: `megarl train CONFIG --resume` continues the newest runs/<config>-<time>/
(or `--out DIR`), a clear error names where it looked when there is none, and a stopped run
prints the exact command that continues it."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from megarl import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_newest_run_dir_is_the_newest_time_of_that_config(tmp_path):
    runs = tmp_path / "runs"
    for name in ("grpo-20261201-090000", "grpo-20261202-080000", "grpo-x-20261203-000000",
                 "grpo_tiny-20261204-000000", "grpo-20261205-000000.log", "other"):  # fmt: skip
        (runs / name).mkdir(parents=True)
    (runs / "grpo-20261209-000000").write_text("a file, not a run")
    assert cli.newest_run_dir("grpo", str(runs)) == str(runs / "grpo-20261202-080000")
    assert cli.newest_run_dir("grpo-x", str(runs)) == str(runs / "grpo-x-20261203-000000")
    assert cli.newest_run_dir("ppo", str(runs)) is None
    assert cli.newest_run_dir("grpo", str(tmp_path / "nowhere")) is None


def test_resume_without_a_run_names_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as e:
        cli.resume_dir(None, "grpo_tiny_cpu", "examples/grpo_tiny_cpu.yaml")
    where = os.path.join(str(tmp_path), "runs", "grpo_tiny_cpu") + "-<YYYYmmdd-HHMMSS>/"
    assert "megarl train examples/grpo_tiny_cpu.yaml --resume: no run to resume" in str(e.value)
    assert where in str(e.value)
    with pytest.raises(ValueError, match="--resume --out runs/x: no such run directory"):
        cli.resume_dir("runs/x", "default", None)
    (tmp_path / "runs" / "default-20261201-000000").mkdir(parents=True)
    assert cli.resume_dir(None, "default", None) == os.path.join("runs", "default-20261201-000000")
    assert cli.resume_dir("runs", "default", None) == "runs"


def test_the_continue_command_is_the_same_command_with_out():
    plain = cli.continue_command(
        "examples/grpo_tiny_cpu.yaml", ["trainer.steps=8", "data.path=my data.jsonl"], True,
        "runs/grpo_tiny_cpu-20261201-000000", env={},
    )  # fmt: skip
    assert plain == (
        "megarl train examples/grpo_tiny_cpu.yaml --set trainer.steps=8 --set 'data.path=my "
        "data.jsonl' --show-samples --out runs/grpo_tiny_cpu-20261201-000000"
    )
    launched = cli.continue_command(
        None, [], False, "runs/d", env={"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "2",
                                        "WORLD_SIZE": "2"},
    )  # fmt: skip
    assert launched == "torchrun --nproc_per_node 2 -m megarl train --out runs/d"
    nodes = cli.continue_command(None, [], False, "r", env={"LOCAL_WORLD_SIZE": "8",
                                                            "WORLD_SIZE": "32"})  # fmt: skip
    assert nodes.startswith("torchrun --nnodes 4 --nproc_per_node 8 -m megarl train")


def test_print_config_and_dry_run_ignore_resume(capsys):
    """`--resume` chooses a directory only for a real run (the docs check resolves documented
    `megarl train ... --resume` lines with --print-config, where no run exists)."""
    assert cli.run_command(cli.parse_args(["train", "--resume", "--print-config"])) == 0
    assert "trainer:" in capsys.readouterr().out


def test_resume_without_a_run_is_an_input_error_on_the_command_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.run_command(cli.parse_args(["train", "--resume"])) == 2
    err = capsys.readouterr().err
    assert "megarl: error: megarl train (the default run) --resume: no run to resume" in err
    assert f"no directory {tmp_path / 'runs' / 'default'}-<YYYYmmdd-HHMMSS>/" in err


@pytest.mark.slow
def test_a_stopped_run_prints_how_to_continue_and_resume_finds_it(tmp_path):
    """A real default run (no torchrun) stopped by trainer.time_limit_minutes after step 1:
    status 4, its message ends with the command that continues it, the live plot drew
    reward.png although the run never reached its end, and `megarl show` reads it as stopped
    at 1/2. Then `megarl train --resume` finds that directory (not an older one) and, with its
    stop file present, stops before setup (seconds) printing the same kind of command."""
    from megarl.trainer.watch import read_status

    env = {**os.environ, "PYTHONPATH": ROOT, "WANDB_MODE": "disabled"}
    (tmp_path / "runs" / "default-20000101-000000").mkdir(parents=True)  # older: not chosen
    quick = ["--set", "trainer.steps=2", "--set", "logging.progress=false"]
    train = [sys.executable, "-m", "megarl", "train", *quick]
    first = [*train, "--set", "trainer.time_limit_minutes=0.01",
             "--set", "logging.plot_every_minutes=0.00001"]  # fmt: skip
    proc = subprocess.run(first, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 4, proc.stderr[-3000:]
    run = re.search(r"to continue: megarl train (.*) --out (runs/default-\d{8}-\d{6})$",
                    proc.stderr, re.M)  # fmt: skip
    assert run, proc.stderr[-3000:]
    assert run.group(1) == " ".join(first[4:])
    out = tmp_path / run.group(2)
    assert "stopped at step 1: trainer.time_limit_minutes=0.01 is near; checkpoint" in proc.stderr
    assert (out / "reward.png").read_bytes()[:4] == b"\x89PNG"  # drawn during the run
    status = read_status(str(out))
    assert (status.status, status.step, status.total) == ("stopped", 1, 2)
    (out / "STOP").write_text("")
    proc = subprocess.run([*train, "--resume"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert f"megarl: resuming {run.group(2)}" in proc.stderr
    assert f"; to continue: megarl train {' '.join(quick)} --out {run.group(2)}" in proc.stderr
