"""Where per-step metrics go: `run_dir/metrics.jsonl` always, wandb and tensorboard optionally.

Only global rank 0 writes; on other ranks every method is a no-op, so callers need no `if rank`.

metrics.jsonl holds one JSON object per step, `{"step": N, ...metrics}`, flushed line by line so
a crash loses at most the line being written. Values are made JSON-safe: one-element tensors and
numpy scalars become numbers, larger tensors lists, nested dicts stay dicts (e.g.
`"time_s": {"rollout": 1.9}`), NaN and +-inf become null, anything else its `str()`.
wandb and tensorboard get the numeric leaves with flattened keys (`time_s/rollout`).

Samples (`log_samples`): `samples.jsonl` (a few of each training step's samples) and
`eval_samples.jsonl` (held-out completions) hold one JSON object per sample, `{"step": N, ...}`,
several per step, steps never decreasing; with wandb on, each call is also a wandb table.

Resuming: existing files are appended to; call `truncate_after(step)` with the checkpoint's step
first (a fresh start: -1), so records logged after that checkpoint are not duplicated; it
truncates metrics.jsonl and the samples files alike. Logging a metrics step that is not larger
than the last one raises.

A run that starts again from step 0 in a directory that already holds metrics (no complete
checkpoint to resume from) first calls `set_aside_previous_run`, which renames those logs to
`NAME.1` (`.2`, ...) and starts a new wandb run. wandb drops a step at or below the last one it
holds, so a resumed wandb run keeps the first attempt's values for the steps that are done again
(metrics.jsonl has the new ones); `truncate_after` says so in a warning.

wandb mode (`wandb_mode`): `wandb_cfg["mode"]` when given (it wins over an inherited
`WANDB_MODE`), else `WANDB_MODE` from the environment, else "offline".
The run id is kept in `run_dir/wandb_run_id` so a resumed run continues the same wandb run.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import string
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from megarl.metrics.plots import LivePlots

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
EVAL_SAMPLES_FILE = "eval_samples.jsonl"
SAMPLE_FILES = (SAMPLES_FILE, EVAL_SAMPLES_FILE)


def json_safe(value: Any) -> Any:
    """`value` as something `json.dumps(..., allow_nan=False)` accepts (see module doc)."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        value = value.item() if value.numel() == 1 else value.tolist()
    elif hasattr(value, "item") and hasattr(value, "dtype") and getattr(value, "ndim", 1) == 0:
        value = value.item()  # numpy scalar / 0-d array
    elif hasattr(value, "tolist") and hasattr(value, "dtype"):
        value = value.tolist()  # numpy array
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return str(value)


def flatten(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"time_s": {"rollout": 1.0}} -> {"time_s/rollout": 1.0}."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{name}/"))
        else:
            out[name] = value
    return out


def _scalars(flat: Mapping[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in flat.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def _step_of(line: str) -> int | None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) else None


class MetricsLogger:
    """Per-step metrics to metrics.jsonl (+ wandb, tensorboard) from global rank 0."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        rank: int,
        wandb_cfg: dict | None = None,
        tensorboard: bool = False,
        plot_every_s: float = 0.0,
    ) -> None:
        """wandb_cfg: None disables wandb; else `mode` ("offline" | "online" | "disabled"; it
        wins over `WANDB_MODE`), `id` (default: kept in run_dir/wandb_run_id) and any other
        `wandb.init` keyword (project, entity, name, group, tags, config, dir — default run_dir
        —, ...). tensorboard: write events when the package is installed (a warning when not).
        plot_every_s: redraw the run's plot (`megarl.metrics.plots.LivePlots`) after a logged
        step when that many seconds passed since the last draw; 0 = never (the end of a run
        draws it)."""
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self.enabled = rank == 0
        self._file = None
        self._wandb = None
        self._tb = None
        self._plots: LivePlots | None = None
        self._last_step: int | None = None
        if not self.enabled:
            return
        if plot_every_s > 0:
            self._plots = LivePlots(self.run_dir, every_s=plot_every_s)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._last_step = self._read_last_step()
        self._file = open(self.path, "a", encoding="utf-8")  # closed in close()
        if wandb_cfg is not None:
            self._wandb = self._open_wandb(wandb_cfg)
        if tensorboard:
            self._tb = _open_tensorboard(self.run_dir / "tensorboard")

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Append `{"step": step, **metrics}` (JSON-safe) and mirror it to wandb/tensorboard."""
        if not self.enabled:
            return
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(
                f"step {step} logged after step {self._last_step} in {self.path}; steps must "
                "increase (on resume call truncate_after(checkpoint_step) first)"
            )
        record = {"step": step, **json_safe({k: v for k, v in metrics.items() if k != "step"})}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        self._last_step = step
        scalars = _scalars(flatten({k: v for k, v in record.items() if k != "step"}))
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._plots is not None:
            self._plots.maybe_redraw()

    def log_samples(self, step: int, rows: list[Mapping[str, Any]], *, file: str) -> None:
        """Append `{"step": step, **row}` per row to `file` (one of `SAMPLE_FILES`) and, with
        wandb on, the rows as a wandb table under the file's stem (`samples`, `eval_samples`)."""
        if not self.enabled or not rows:
            return
        if file not in SAMPLE_FILES:
            raise ValueError(f"log_samples(file={file!r}); accepted: {SAMPLE_FILES}")
        records = [{"step": step, **json_safe(dict(r))} for r in rows]
        with open(self.run_dir / file, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps(r, allow_nan=False) + "\n" for r in records))
        if self._wandb is not None:
            self._wandb.log({Path(file).stem: _wandb_table(records)}, step=step)

    def truncate_after(self, step: int) -> int:
        """Drop records with step > `step` (and unreadable lines, e.g. one cut by a crash) from
        metrics.jsonl and the samples files; returns how many metrics lines were dropped."""
        if not self.enabled:
            return 0
        self._file.close()
        dropped, kept = _truncate(self.path, step)
        self._file = open(self.path, "a", encoding="utf-8")
        last_logged = self._last_step
        self._last_step = max((_step_of(line) for line in kept), default=None)
        for name in SAMPLE_FILES:
            if (self.run_dir / name).exists():
                _truncate(self.run_dir / name, step)
        if self._wandb is not None and last_logged is not None and last_logged > step:
            logger.warning(
                "wandb run %s already holds steps %d-%d from before this resume; wandb drops "
                "re-logged steps at or below its last one, so it shows the earlier values for "
                "those and new values from step %d on (metrics.jsonl holds the re-done steps)",
                getattr(self._wandb, "id", "?"),
                step + 1,
                last_logged,
                last_logged + 1,
            )
        return dropped

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _read_last_step(self) -> int | None:
        if not self.path.exists():
            return None
        steps = [_step_of(line) for line in self.path.read_text(encoding="utf-8").splitlines()]
        return max((s for s in steps if s is not None), default=None)

    def _open_wandb(self, cfg: dict) -> Any:
        mode = wandb_mode(cfg.get("mode"))
        if mode == "disabled":
            return None
        try:
            import wandb
        except ImportError as err:
            raise ImportError("wandb logging needs wandb: pip install wandb") from err
        id_file = self.run_dir / "wandb_run_id"
        run_id = cfg.get("id")
        if run_id is None and id_file.exists():
            run_id = id_file.read_text().strip()
        if run_id is None:
            run_id = "".join(
                secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8)
            )
        id_file.write_text(run_id)
        kwargs = {k: v for k, v in cfg.items() if k not in ("mode", "id")}
        kwargs.setdefault("dir", str(self.run_dir))
        kwargs.setdefault("resume", "allow")
        return wandb.init(mode=mode, id=run_id, **kwargs)


WANDB_MODES = ("offline", "online", "disabled")


def wandb_mode(configured: str | None, env: Mapping[str, str] = os.environ) -> str:
    """The wandb mode a run uses: `configured` (logging.wandb_mode) when set, else
    `WANDB_MODE` of `env` when set, else "offline"."""
    return configured or env.get("WANDB_MODE") or "offline"


def _truncate(path: Path, step: int) -> tuple[int, list[str]]:
    """Keep the complete lines of `path` whose step is <= `step` (atomic rewrite); returns
    (lines dropped, lines kept)."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = []
    for line in lines:
        s = _step_of(line)
        if s is not None and s <= step and line.endswith("\n"):
            kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)
    dropped = len(lines) - len(kept)
    if dropped:
        logger.info("%s: dropped %d lines after step %d", path, dropped, step)
    return dropped, kept


def _wandb_table(records: list[dict]) -> Any:
    """The records as a `wandb.Table`: one column per key (first seen order), nested values
    (per-function rewards, chat prompts) as JSON text."""
    import wandb

    columns = list(dict.fromkeys(k for r in records for k in r))
    cell = lambda v: json.dumps(v, ensure_ascii=False) if isinstance(v, (dict, list)) else v  # noqa: E731
    return wandb.Table(columns=columns, data=[[cell(r.get(c)) for c in columns] for r in records])


# what a run directory holds per attempt at its steps (`set_aside_previous_run`)
PER_RUN_LOGS = (METRICS_FILE, "samples.jsonl", "eval_samples.jsonl", "wandb_run_id", "tensorboard")


def set_aside_previous_run(run_dir: str | os.PathLike) -> int | None:
    """Before a run starts at step 0 in `run_dir`: rename the logs of an earlier attempt there
    (`PER_RUN_LOGS`) to `NAME.K`, K the first suffix free for all of them, when metrics.jsonl
    holds any step; returns K (None: nothing to set aside). One process (rank 0) calls it."""
    run_dir = Path(run_dir)
    metrics = run_dir / METRICS_FILE
    if not metrics.exists() or not any(
        _step_of(line) is not None for line in metrics.read_text(encoding="utf-8").splitlines()
    ):
        return None
    k = 1
    while any((run_dir / f"{name}.{k}").exists() for name in PER_RUN_LOGS):
        k += 1
    moved = []
    for name in PER_RUN_LOGS:
        if (run_dir / name).exists():
            os.replace(run_dir / name, run_dir / f"{name}.{k}")
            moved.append(name)
    logger.warning(
        "%s holds an earlier attempt's metrics and this run starts at step 0 (no complete "
        "checkpoint to resume from, or trainer.resume=false): its %s kept with suffix .%d",
        run_dir,
        ", ".join(moved),
        k,
    )
    return k


def _open_tensorboard(log_dir: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        logger.warning(
            "logging.tensorboard=true but tensorboard is not installed (pip install "
            "tensorboard): no tensorboard events are written"
        )
        return None
    return SummaryWriter(log_dir=str(log_dir))
