"""The curves of a run from its metrics.jsonl: rewards (`reward.png`) or offline losses.

Panels: `reward_mean` per step with a moving average, and beside it (moving averages, dashed)
the per-function rewards `reward/<name>` that differ from it, e.g. the toy task's
`reward/exact_match`, and the held-out evaluation's curves (points joined by lines, from step 0
on): `eval/pass@k`, `eval/reward_mean` and each `eval/<function>`, a series that only repeats an
earlier one left out; then, when logged, the mean response length and the KL to the reference.
An offline run (sft, dpo) has no reward: `plot_offline` draws its loss, accuracies and reward
margin (`loss.png`), training steps beside the held-out `eval/...` values.
`plot_run` draws whichever of the two a run's metrics.jsonl holds; `LivePlots` redraws it every
few minutes while a run trains (the metrics logger calls it after each step: rank 0 only, and a
plot that fails is a warning, never the end of the run).
Uses matplotlib's Agg canvas directly (no pyplot, no global backend switch, safe off the main
thread) and writes through a temporary file renamed into place, so a reader never sees a
half-written PNG.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

REWARD_PNG = "reward.png"
LOSS_PNG = "loss.png"
REDRAW_EVERY_S = 180.0
"""How often a training run redraws its plot (seconds of wall time, checked after each step)."""

RESPONSE_LENGTH_KEYS = (
    "response_len",
    "response_length_mean",
    "response_len_mean",
    "response_length",
)


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The readable JSON object lines of a metrics.jsonl (a torn last line is skipped)."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "step" in record:
            records.append(record)
    return records


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to `window` points (shorter at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pairs = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [s for s, _ in pairs], [float(v) for _, v in pairs]


def _function_rewards(records: list[dict], reward: list[float]) -> list[tuple[str, list, list]]:
    """(name, steps, values) of each `reward/<name>` series, except one that only repeats
    `reward_mean` (a single reward function with weight 1)."""
    names = sorted({k for r in records for k in r if k.startswith("reward/")})
    out = []
    for name in names:
        s, v = _series(records, name)
        same = len(v) == len(reward) and all(
            abs(a - b) < 1e-6 for a, b in zip(v, reward, strict=True)
        )
        if s and not same:
            out.append((name, s, v))
    return out


EVAL_SKIP = (
    "eval/prompts",
    "eval/time_s",
    "eval/reward_errors",
    "eval/truncated",
    "eval/response_len",
)
"""Eval keys that are not success figures (not drawn beside the reward)."""


def eval_series(records: list[dict]) -> list[tuple[str, list, list]]:
    """(name, steps, values) of the held-out curves drawn beside the reward: pass@k first, then
    eval/reward_mean, then the per-function means; a series equal to an earlier one is left
    out (e.g. pass@1 and an exact-match function)."""
    names = sorted({k for r in records for k in r if k.startswith("eval/") and k not in EVAL_SKIP})
    order = lambda k: (0 if k.startswith("eval/pass@") else 1 if k == "eval/reward_mean" else 2, k)  # noqa: E731
    out: list[tuple[str, list, list]] = []
    for name in sorted(names, key=order):
        s, v = _series(records, name)
        repeats = any(
            s == s2 and all(abs(a - b) < 1e-9 for a, b in zip(v, v2, strict=True))
            for _, s2, v2 in out
        )
        if s and not repeats:
            out.append((name, s, v))
    return out


def plot_rewards(
    metrics_jsonl_path: str | os.PathLike, out_png: str | os.PathLike, *, window: int | None = None
) -> Path:
    """Write the reward curve PNG; returns its path. window: moving-average width (default
    about a twentieth of the run, at least 1). Raises ValueError if no step has reward_mean."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = read_metrics(metrics_jsonl_path)
    steps, rewards = _series(records, "reward_mean")
    if not steps:
        raise ValueError(f"{metrics_jsonl_path}: no step has a numeric 'reward_mean' to plot")
    window = window or max(1, len(rewards) // 20)

    panels = [("reward_mean", steps, rewards)]
    for key in RESPONSE_LENGTH_KEYS:
        s, v = _series(records, key)
        if s:
            panels.append(("response length", s, v))
            break
    s, v = _series(records, "kl")
    if s:
        panels.append(("kl", s, v))

    fig = Figure(figsize=(7, 2.6 * len(panels)), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (label, s, v) in zip(axes, panels, strict=True):
        ax.plot(s, v, lw=0.8, alpha=0.5 if label == "reward_mean" else 1.0, label=label)
        if label == "reward_mean":
            ax.plot(s, moving_average(v, window), lw=1.8, label=f"moving average ({window})")
            for name, fs, fv in _function_rewards(records, rewards):
                ax.plot(fs, moving_average(fv, window), lw=1.0, ls="--", label=name)
            for name, es, ev in eval_series(records):
                ax.plot(es, ev, lw=1.2, marker="o", ms=3, label=f"{name} (held-out)")
            ax.legend(loc="best", fontsize=8)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    axes[0].set_title(Path(metrics_jsonl_path).parent.name or "run")
    fig.tight_layout()

    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    fig.savefig(tmp, format="png")
    os.replace(tmp, out)
    return out


# panels of an offline run (sft, dpo): each training series with its held-out `eval/` twin
OFFLINE_PANELS = (
    ("loss", ("loss",)),
    ("accuracy", ("token_accuracy", "rewards/accuracies", "preference_accuracy")),
    ("reward margin", ("rewards/margins",)),
)


def plot_offline(
    metrics_jsonl_path: str | os.PathLike, out_png: str | os.PathLike, *, window: int | None = None
) -> Path:
    """The losses and accuracies of an offline run (training steps as thin lines with their
    moving average, held-out `eval/...` values as markers) as a PNG; returns its path. Raises
    ValueError if no step has a loss."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = read_metrics(metrics_jsonl_path)
    if not any(_series(records, k)[0] for k in ("loss", "eval/loss")):
        raise ValueError(f"{metrics_jsonl_path}: no step has a numeric 'loss' to plot")
    steps = _series(records, "loss")[0]
    window = window or max(1, len(steps) // 20)
    panels = []
    for label, keys in OFFLINE_PANELS:
        lines = []
        for key in keys:
            for name in (key, f"eval/{key}"):
                s, v = _series(records, name)
                if s:
                    lines.append((name, s, v))
        if lines:
            panels.append((label, lines))

    fig = Figure(figsize=(7, 2.6 * len(panels)), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (label, lines) in zip(axes, panels, strict=True):
        for name, s, v in lines:
            if name.startswith("eval/"):
                ax.plot(s, v, marker="o", ms=3, lw=1.2, label=name)
            else:
                ax.plot(s, v, lw=0.8, alpha=0.4, label=name)
                ax.plot(s, moving_average(v, window), lw=1.6, label=f"{name} (avg {window})")
        ax.legend(loc="best", fontsize=7)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    axes[0].set_title(Path(metrics_jsonl_path).parent.name or "run")
    fig.tight_layout()

    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    fig.savefig(tmp, format="png")
    os.replace(tmp, out)
    return out


def plot_run(run_dir: str | os.PathLike) -> Path:
    """Draw a run's plot from `run_dir/metrics.jsonl`: `reward.png` when a step has a
    `reward_mean` (RL), else `loss.png` (offline: sft, dpo, reward models); returns its path.
    Raises FileNotFoundError without metrics.jsonl, ValueError when no step has either."""
    metrics = Path(run_dir) / "metrics.jsonl"
    if not metrics.exists():
        raise FileNotFoundError(f"{metrics}: no such file (no step of this run was logged)")
    if _series(read_metrics(metrics), "reward_mean")[0]:
        return plot_rewards(metrics, Path(run_dir) / REWARD_PNG)
    return plot_offline(metrics, Path(run_dir) / LOSS_PNG)


class LivePlots:
    """Redraw a running run's plot (`plot_run`) at most every `every_s` seconds of `clock`;
    the first call after `every_s` draws. A failure is logged once per kind as a warning and
    never raised: a plot must not end a run."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        every_s: float = REDRAW_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
        draw: Callable[[str | os.PathLike], object] = plot_run,
    ) -> None:
        """draw: the function that draws (default `plot_run`; tests pass one that fails)."""
        self.run_dir = run_dir
        self.every_s = every_s
        self.clock = clock
        self.draw = draw
        self._last = clock()
        self._warned: set[str] = set()

    def maybe_redraw(self) -> bool:
        """Draw when `every_s` has passed since the last draw (or the start); True if it drew."""
        now = self.clock()
        if self.every_s <= 0 or now - self._last < self.every_s:
            return False
        self._last = now
        try:
            self.draw(self.run_dir)
        except Exception as e:  # noqa: BLE001 - any failure of a plot is only a warning
            kind = type(e).__name__
            if kind not in self._warned:
                self._warned.add(kind)
                log.warning("could not redraw the plot of %s: %s: %s", self.run_dir, kind, e)
            return False
        return True
