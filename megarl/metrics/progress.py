"""Step progress for people: a tqdm bar on a terminal, one log line per step elsewhere.

On global rank 0 only. With stdout a TTY (or `force=True`) a tqdm bar over the steps shows
reward, KL and seconds per step in its postfix; otherwise (batch jobs, CI, redirected output)
each step emits one `logging` INFO line such as
`step 12/200 | reward_mean 0.531 | kl 0.00121 | 3.21 s/step`.
The step time is the wall time between consecutive `update` calls. Samples handed to `update`
(`megarl train --show-samples`: the step's best and worst) are written to the same stream as
plain lines, above the bar (`tqdm.write`), not through logging, so they show whatever the log
level; with `progress=False` only they are shown.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

logger = logging.getLogger("megarl.progress")

# Keys shown, in order, when present in the step's metrics.
SHOWN = ("reward_mean", "kl", "loss", "eval/pass@1")


def format_value(value: Any) -> str:
    """A metric as the console shows it: 3 significant digits below 0.01, else 3 decimals."""
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e-2 and value != 0 else f"{value:.3f}"
    return str(value)


def format_step_line(step: int, total: int, metrics: Mapping[str, Any], step_s: float) -> str:
    """`step 12/200 | reward_mean 0.531 | kl 0.00121 | 3.21 s/step` (missing keys skipped)."""
    parts = [f"step {step}/{total}"]
    parts += [f"{k} {format_value(metrics[k])}" for k in SHOWN if metrics.get(k) is not None]
    parts.append(f"{step_s:.2f} s/step")
    return " | ".join(parts)


def format_sample(row: Mapping[str, Any], width: int = 160) -> str:
    """One console line for a samples.jsonl row, prompt and completion quoted and cut to fit:
    `best  reward 1.000 adv +0.84   4 tok stop | 'copy 371=' -> '371'`."""

    def short(value: Any) -> str:
        text = repr(value if isinstance(value, str) else str(value))
        return text if len(text) <= width // 2 else text[: width // 2 - 4] + "...'"

    adv = row.get("advantage")
    return (
        f"{row.get('pick', ''):<5} reward {row['reward']:.3f}"
        + (f" adv {adv:+.2f}" if isinstance(adv, (int, float)) else "")
        + f" {row['length']:>3} tok {row['finish_reason']} | "
        + f"{short(row['prompt'])} -> {short(row['completion'])}"
    )


class StepProgress:
    """`update(step, metrics)` once per finished step (the bar advances by one per call; `step`
    is shown in log lines); `close()` at the end."""

    def __init__(
        self,
        total_steps: int,
        *,
        rank: int,
        initial: int = 0,
        force: bool = False,
        file: TextIO | None = None,
        progress: bool = True,
    ) -> None:
        """initial: steps already done (resumed run). force: draw the bar even without a TTY.
        progress: False = neither bar nor step lines (samples are still shown)."""
        self.total = total_steps
        self.enabled = rank == 0
        self.progress = progress
        self._last = time.perf_counter()
        self._bar = None
        self._file = file or sys.stdout
        if not self.enabled or not progress:
            return
        file = self._file
        if force or (hasattr(file, "isatty") and file.isatty()):
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_steps, initial=initial, file=file, unit="step", dynamic_ncols=True
            )

    def update(
        self, step: int, metrics: Mapping[str, Any], samples: Sequence[Mapping] = ()
    ) -> None:
        """samples: rows of `megarl.trainer.samples` to show; those picked as the step's best
        and worst are written, one line each."""
        now = time.perf_counter()
        step_s, self._last = now - self._last, now
        if not self.enabled:
            return
        self._show(step, samples)
        if not self.progress:
            return
        if self._bar is None:
            logger.info(format_step_line(step, self.total, metrics, step_s))
            return
        postfix = {k: format_value(metrics[k]) for k in SHOWN if metrics.get(k) is not None}
        postfix["s/step"] = f"{step_s:.2f}"
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(1)

    def _show(self, step: int, samples: Sequence[Mapping]) -> None:
        lines = [
            f"step {step} {format_sample(r)}" for r in samples if r.get("pick") in ("best", "worst")
        ]
        if not lines:
            return
        if self._bar is not None:
            from tqdm import tqdm

            for line in lines:
                tqdm.write(line, file=self._file)
        else:
            self._file.write("".join(line + "\n" for line in lines))
            self._file.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
