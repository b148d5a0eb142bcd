"""`tools/benchmark.py --report`: the markdown report and the stage chart, from records shaped
like the suites' (no suite is run here)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megarl.benchmarks import record
from megarl.benchmarks.report import stage_bars, suite_table, write_report

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def _records() -> list[dict]:
    step = [
        record("step_seconds", 1.5, "s/step", floor=1.4, floor_unit="s/step",
               higher_is_better=False, spread=[1.3, 2.0]),
        record("stage_rollout_seconds", 0.6, "s", spread=[0.5, 0.9]),
        record("stage_train_seconds", 0.8, "s", spread=[0.7, 1.0]),
    ]
    peer = [record("megarl_bf16_stage_rollout_seconds", 1.7, "s"),
            record("megarl_bf16_stage_train_seconds", 1.6, "s"),
            record("trl_fp32_stage_rollout_seconds", 1.8, "s"),
            record("megarl_over_trl_best", 1.41, "x")]
    sync = [record("sync_seconds", 0.02, "s", floor=0.01, higher_is_better=False)]
    return ([{"suite": "step", **r} for r in step] + [{"suite": "peer", **r} for r in peer]
            + [{"suite": "sync", **r} for r in sync])


def test_tables_and_stage_breakdowns():
    recs = _records()
    table = suite_table([r for r in recs if r["suite"] == "step"])
    assert "| step_seconds | 1.5 | s/step | 1.3 - 2 | 1.4 s/step | 93.3% |" in table
    assert "| stage_rollout_seconds | 0.6 | s | 0.5 - 0.9 | - | - |" in table
    assert stage_bars(recs) == {
        "step: megarl default": {"rollout": 0.6, "train": 0.8},
        "peer: megarl_bf16": {"rollout": 1.7, "train": 1.6},
        "peer: trl_fp32": {"rollout": 1.8},
    }


def test_report_files(tmp_path):
    out = write_report(_records(), tmp_path / "bench.md", when="2026-12-01")
    text = out.read_text()
    assert text.startswith("# megarl benchmark report")
    assert "Date: 2026-12-01" in text and "torch " in text
    assert [line for line in text.splitlines() if line.startswith("## ")] == [
        "## step", "## peer", "## sync"]
    assert "![RL step stages](bench.png)" in text
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.md", "bench.png"]  # no temps
    with pytest.raises(ValueError, match="no benchmark records"):
        write_report([], tmp_path / "empty.md")


def test_cli_renders_a_saved_run(tmp_path):
    src = tmp_path / "bench.json"
    src.write_text(json.dumps(_records()))
    cmd = [sys.executable, str(ROOT / "tools" / "benchmark.py"), "--from-json", str(src),
           "--report", str(tmp_path / "r.md")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "r.md").exists() and (tmp_path / "r.png").exists()
    bad = subprocess.run(cmd[:-2], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--from-json needs --report" in bad.stderr
