"""Watching a run: `megarl show RUN` (status derived from the run directory's files), `megarl plot
RUN` for any run directory, and the plots redrawn during a run (`LivePlots`, through the metrics
logger), whose failures never end the run."""

from __future__ import annotations

import json
import os
import time

import pytest

from megarl import cli
from megarl.metrics.plots import LivePlots, plot_run
from megarl.metrics.sinks import MetricsLogger
from megarl.trainer.watch import describe, read_status

PNG = b"\x89PNG\r\n\x1a\n"


def _run_dir(path, steps=10, logged=(), *, max_bad=3, samples=(), checkpoint=None, age_s=0.0):
    """A run directory as the trainer leaves it: config.yaml, metrics.jsonl (records), samples,
    a checkpoint; its files written `age_s` seconds ago."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.yaml").write_text(f"trainer:\n  steps: {steps}\n  max_bad_steps: {max_bad}\n")
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in logged))
    if samples:
        (path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in samples))
    if checkpoint is not None:
        ckpt = path / "checkpoints" / f"step_{checkpoint:06d}"
        ckpt.mkdir(parents=True)
        (ckpt / "trainer_state.json").write_text("{}")
    then = time.time() - age_s
    for f in path.iterdir():
        os.utime(f, (then, then))
    return path


def _step(i, reward=0.5, loss=0.1, **extra):
    return {"step": i, "reward_mean": reward, "kl": 0.002, "loss": loss,
            "time_s": {"step": 2.0}, **extra}  # fmt: skip


def _sample(step, pick, reward):
    return {"step": step, "pick": pick, "prompt": "copy 371=", "completion": "371",
            "reward": reward, "advantage": 0.5, "length": 4, "finish_reason": "stop"}  # fmt: skip


def test_show_reports_step_metrics_samples_plots_and_a_running_status(tmp_path):
    run = _run_dir(
        tmp_path / "r",
        logged=[_step(1, 0.1), _step(2, 0.2), _step(3, 0.531)],
        samples=[_sample(2, "best", 1.0), _sample(3, "best", 1.0), _sample(3, "worst", 0.0)],
        checkpoint=2,
    )
    s = read_status(str(run))
    assert (s.status, s.step, s.total, s.checkpoint[0]) == ("running", 3, 10, 2)
    text = describe(s)
    assert "step        3/10 (30%), 2.00 s/step, about 14 s left" in text
    assert "reward_mean 0.531 | kl 0.002 | loss 0.100" in text
    assert "samples     step 3" in text and text.count("'copy 371=' -> '371'") == 2
    assert "worst reward 0.000" in text
    assert "checkpoints/step_000002 (step 2)" in text
    assert f"plots       none yet (redraw: megarl plot {run})" in text


@pytest.mark.parametrize(
    "status, logged, extra",
    [
        ("finished", [_step(1), _step(2)], None),
        ("diverged", [_step(1), _step(2, loss=None), _step(3, loss=None, skipped_steps=1)], None),
        ("stopped", [_step(1)], "stopped.json"),
        ("hung", [_step(1)], "hang-rank1.txt"),
        ("interrupted", [_step(1)], "old"),
    ],
)
def test_show_derives_each_end_from_the_files_the_trainer_writes(tmp_path, status, logged, extra):
    steps = 2 if status == "finished" else 10
    age = 3600.0 if extra == "old" else 0.0
    run = _run_dir(tmp_path / "r", steps, logged, max_bad=2, age_s=age)
    if extra == "stopped.json":
        (run / extra).write_text(json.dumps({"step": 1, "reason": "SIGTERM received"}))
    elif extra == "hang-rank1.txt":
        (run / extra).write_text("stacks")
    s = read_status(str(run))
    assert s.status == status, s.why
    text = describe(s)
    assert f"status      {status}" in text
    if status in ("stopped", "hung", "interrupted"):
        assert f"--out {run} (or --resume)" in text
    if status == "stopped":
        assert "SIGTERM received" in text


def test_megarl_show_and_plot_on_the_command_line(tmp_path, capsys):
    """`megarl show RUN` prints the report; `megarl plot RUN` draws reward.png for an RL run and
    loss.png for an offline one (atomically: no temporary file left); a directory that is not a
    run is a one-line error (exit 2) naming it."""
    rl = _run_dir(tmp_path / "rl", logged=[_step(1, 0.1), _step(2, 0.4)])
    losses = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]
    offline = _run_dir(tmp_path / "sft", logged=losses)
    assert cli.run_command(cli.parse_args(["plot", str(rl)])) == 0
    assert (rl / "reward.png").read_bytes()[:8] == PNG
    assert cli.run_command(cli.parse_args(["plot", str(offline)])) == 0
    assert (offline / "loss.png").read_bytes()[:8] == PNG
    assert not [p for p in os.listdir(rl) if p.endswith(".tmp")]
    assert cli.run_command(cli.parse_args(["show", str(rl), "--samples", "0"])) == 0
    out = capsys.readouterr().out
    assert "step        2/10" in out and f"plots       {rl / 'reward.png'}" in out
    (tmp_path / "empty").mkdir()
    for command in ("show", "plot"):
        assert cli.run_command(cli.parse_args([command, str(tmp_path / "empty")])) == 2
        assert f"megarl: error: megarl {command}: {tmp_path / 'empty'}" in capsys.readouterr().err


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_live_plots_redraw_every_few_minutes_and_never_raise(tmp_path, caplog):
    clock, drawn = _Clock(), []
    plots = LivePlots(tmp_path, every_s=180.0, clock=clock, draw=drawn.append)
    clock.now = 179.0
    assert not plots.maybe_redraw() and drawn == []
    clock.now = 181.0
    assert plots.maybe_redraw() and drawn == [tmp_path]
    clock.now = 300.0
    assert not plots.maybe_redraw()  # 119 s after the last draw

    def broken(run_dir):
        raise ValueError("no step has a numeric 'reward_mean' to plot")

    failing = LivePlots(tmp_path, every_s=1.0, clock=clock, draw=broken)
    with caplog.at_level("WARNING"):
        for t in (400.0, 500.0):
            clock.now = t
            assert failing.maybe_redraw() is False
    assert caplog.text.count("could not redraw the plot") == 1  # once per kind of failure


def test_the_metrics_logger_redraws_the_plot_during_a_run_on_rank_0_only(tmp_path):
    main = MetricsLogger(tmp_path / "a", rank=0, plot_every_s=1e-9)
    other = MetricsLogger(tmp_path / "b", rank=1, plot_every_s=1e-9)
    for log in (main, other):
        log.log(1, {"reward_mean": 0.2})
        log.log(2, {"reward_mean": 0.4})
        log.close()
    assert (tmp_path / "a" / "reward.png").read_bytes()[:8] == PNG
    assert not (tmp_path / "b").exists()
    # a run whose metrics cannot be drawn still logs every step
    quiet = MetricsLogger(tmp_path / "c", rank=0, plot_every_s=1e-9)
    quiet.log(1, {"note": "no reward, no loss"})
    quiet.close()
    assert (tmp_path / "c" / "metrics.jsonl").read_text().count("\n") == 1
    with pytest.raises(ValueError, match="no step has a numeric 'loss'"):
        plot_run(tmp_path / "c")
