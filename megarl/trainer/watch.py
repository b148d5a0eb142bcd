"""`megarl show RUN`: where a run is, read only from the files its trainer writes in RUN (no lock,
no write: a running run is not disturbed).

What it reads: `config.yaml` (trainer.steps, trainer.max_bad_steps), `metrics.jsonl` (the last
step and its metrics, the step times), `checkpoints/` (the newest complete checkpoint),
`stopped.json` (a stop on request, `megarl.trainer.faults`), `hang-rank*.txt` (the hang
watchdog's dumps), the tail of `samples.jsonl` and the plots beside them.

The status is derived, in this order:
- stopped: `stopped.json` exists (a run that starts again removes it);
- hung: a `hang-rank*.txt` is newer than the last metrics line;
- diverged: the last trainer.max_bad_steps steps all had a non-finite loss (null in
  metrics.jsonl) or a skipped update (`megarl.trainer.finish.stop_if_diverged` ended the run);
- finished: the last logged step is trainer.steps;
- running: metrics.jsonl (before the first step: config.yaml) was written less than
  `stale_after_s` ago (10 minutes, or 3x the slowest step so far if longer);
- interrupted: none of these: the process was killed or crashed without writing a record. It
  assumes the run directory's files carry the writer's clock (one machine or synchronised
  clocks).
"""

from __future__ import annotations

import glob
import json
import math
import os
import time
from dataclasses import dataclass, field

import yaml

from megarl.checkpoint.files import list_checkpoints
from megarl.metrics.plots import LOSS_PNG, REWARD_PNG, read_metrics
from megarl.metrics.progress import format_sample, format_value
from megarl.metrics.sinks import METRICS_FILE, SAMPLES_FILE
from megarl.trainer.faults import STOPPED_FILE

STALE_S = 600.0
"""A run whose files are older than this (or 3x its slowest step) is not running."""
KEY_METRICS = (
    "reward_mean",
    "reward_std",
    "kl",
    "loss",
    "response_len",
    "logprob_mismatch",
    "grad_norm",
    "tokens_per_s",
    "eval/pass@1",
    "eval/loss",
)
"""The metrics `megarl show` prints, in this order, when the last step logged them."""


@dataclass
class RunStatus:
    run_dir: str
    status: str
    """stopped, hung, diverged, finished, running or interrupted (module doc)."""
    why: str
    """What the status was derived from, for people."""
    step: int | None
    """The last logged step (None: none yet)."""
    total: int | None
    """trainer.steps from config.yaml (None: unknown)."""
    last: dict = field(default_factory=dict)
    """The last metrics record."""
    step_s: float | None = None
    """The mean seconds per step over the last few steps."""
    checkpoint: tuple[int, str] | None = None
    samples: list[dict] = field(default_factory=list)
    plots: list[str] = field(default_factory=list)


def read_status(run_dir: str, *, now: float | None = None, samples: int = 2) -> RunStatus:
    """What `run_dir` says about its run (module doc). now: the current time (default
    `time.time()`, the clock of the files' modification times). Raises FileNotFoundError when
    `run_dir` is not a run directory."""
    now = time.time() if now is None else now
    config_path = os.path.join(run_dir, "config.yaml")
    metrics_path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isdir(run_dir) or not (
        os.path.exists(config_path) or os.path.exists(metrics_path)
    ):
        raise FileNotFoundError(
            f"{run_dir}: not a run directory (no config.yaml or {METRICS_FILE}); a run "
            "directory is the --out of megarl train, or runs/<config>-<time>/"
        )
    trainer = _trainer_config(config_path)
    total, max_bad = trainer.get("steps"), trainer.get("max_bad_steps")
    records = read_metrics(metrics_path) if os.path.exists(metrics_path) else []
    trained = [r for r in records if r["step"] > 0]  # step 0: the evaluation before training
    last = records[-1] if records else {}
    step = last.get("step")
    times = [_step_seconds(r) for r in trained[-5:]]
    times = [t for t in times if t is not None]
    status, why = _status(run_dir, trained, total, max_bad, times, now)
    checkpoints = list_checkpoints(run_dir)
    return RunStatus(
        run_dir=run_dir,
        status=status,
        why=why,
        step=step,
        total=total if isinstance(total, int) else None,
        last=last,
        step_s=sum(times) / len(times) if times else None,
        checkpoint=checkpoints[-1] if checkpoints else None,
        samples=latest_samples(os.path.join(run_dir, SAMPLES_FILE), samples),
        plots=[
            os.path.join(run_dir, p)
            for p in (REWARD_PNG, LOSS_PNG)
            if os.path.exists(os.path.join(run_dir, p))
        ],
    )


def _status(run_dir, trained, total, max_bad, times, now) -> tuple[str, str]:
    stopped = os.path.join(run_dir, STOPPED_FILE)
    if os.path.exists(stopped):
        record = _read_json(stopped)
        return "stopped", f"{STOPPED_FILE}: {record.get('reason', '?')}"
    metrics_path = os.path.join(run_dir, METRICS_FILE)
    written = _mtime(metrics_path) or _mtime(os.path.join(run_dir, "config.yaml")) or 0.0
    hangs = sorted(glob.glob(os.path.join(run_dir, "hang-rank*.txt")))
    if hangs and max(_mtime(h) or 0.0 for h in hangs) >= written:
        return "hung", f"{os.path.basename(hangs[0])}: the hang watchdog ended a step"
    if isinstance(max_bad, int) and max_bad > 0 and len(trained) >= max_bad:
        if all(_bad(r) for r in trained[-max_bad:]):
            return "diverged", f"the last {max_bad} steps had a NaN/Inf loss"
    if trained and isinstance(total, int) and trained[-1]["step"] >= total:
        return "finished", f"step {trained[-1]['step']} of {total} logged"
    stale = max(STALE_S, 3 * max(times, default=0.0))
    age = now - written
    if age < stale:
        return "running", f"last written {_ago(age)}"
    return "interrupted", f"no record of an end; last written {_ago(age)} (killed or crashed?)"


def _bad(record: dict) -> bool:
    """A step whose update was dropped: a non-finite loss (null) or a skipped step."""
    skipped = (record.get("skipped_steps") or 0) + (record.get("value_skipped_steps") or 0)
    losses = [record.get(k, 0.0) for k in ("loss", "value_loss")]
    return bool(skipped) or any(
        not isinstance(x, (int, float)) or not math.isfinite(x) for x in losses
    )


def latest_samples(path: str, n: int) -> list[dict]:
    """Up to `n` rows of the last step in a samples.jsonl (its tail only is read)."""
    if n <= 0 or not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - (1 << 20)))
        lines = f.read().decode("utf-8", "replace").splitlines()
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # the cut first line, or a torn last one
        if isinstance(row, dict) and "step" in row:
            rows.append(row)
    if not rows:
        return []
    step = rows[-1]["step"]
    return [r for r in rows if r["step"] == step][:n]


def describe(s: RunStatus) -> str:
    """The report `megarl show` prints."""
    total = s.total if s.total is not None else "?"
    lines = [f"run         {s.run_dir}", f"status      {s.status} ({s.why})"]
    if s.step is None:
        lines.append(f"step        none logged yet (of {total})")
    else:
        progress = f"step        {s.step}/{total}"
        if s.total:
            progress += f" ({100 * s.step / s.total:.0f}%)"
        if s.step_s is not None:
            progress += f", {s.step_s:.2f} s/step"
            if s.status == "running" and s.total and s.step < s.total:
                progress += f", about {_duration((s.total - s.step) * s.step_s)} left"
        lines.append(progress)
        shown = [f"{k} {format_value(s.last[k])}" for k in KEY_METRICS if s.last.get(k) is not None]
        lines.append("metrics     " + (" | ".join(shown) or "(none of the key metrics)"))
    if s.checkpoint is not None:
        lines.append(f"checkpoint  {s.checkpoint[1]} (step {s.checkpoint[0]})")
    else:
        lines.append("checkpoint  none yet")
    if s.samples:
        lines.append(f"samples     step {s.samples[0]['step']} ({SAMPLES_FILE}):")
        for row in s.samples:
            try:
                lines.append("  " + format_sample(row, width=120))
            except (KeyError, TypeError, ValueError):
                lines.append("  " + json.dumps(row, ensure_ascii=False)[:200])
    plots = ", ".join(s.plots) if s.plots else "none yet"
    lines.append(f"plots       {plots} (redraw: megarl plot {s.run_dir})")
    if s.status in ("stopped", "hung", "interrupted"):
        lines.append(
            f"continue    the command that started it, with --out {s.run_dir} (or --resume)"
        )
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- file helpers
def _trainer_config(path: str) -> dict:
    try:
        with open(path) as f:
            cfg = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError):
        return {}
    trainer = cfg.get("trainer") if isinstance(cfg, dict) else None
    return trainer if isinstance(trainer, dict) else {}


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


def _mtime(path: str) -> float | None:
    try:
        return os.path.getmtime(path)
    except OSError:
        return None


def _step_seconds(record: dict) -> float | None:
    t = record.get("time_s")
    value = t.get("step") if isinstance(t, dict) else None
    return float(value) if isinstance(value, (int, float)) else None


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _ago(seconds: float) -> str:
    return f"{_duration(max(seconds, 0.0))} ago"
