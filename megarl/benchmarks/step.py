"""`--suite step`: one whole RL step of the embedded default run, stage by stage.

Runs `megarl train` (the tiny CPU GRPO default; `--quick`: fewer steps) in a temporary directory
and reports the median step time, the median time of each stage (rollout, reward, logprobs,
advantage, train, sync) and the end-to-end tokens/s, from the run's own metrics.jsonl. The first
two steps (engine warm-up) are excluded. The floor beside the step time is the sum of the stage
medians that are not overhead: it shows what the loop itself adds.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

from megarl.benchmarks import record, register_suite


@register_suite("step")
def suite(args) -> list[dict]:
    steps = 8 if args.quick else 24
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            sys.executable,
            "-m",
            "megarl",
            "train",
            "--out",
            out,
            "--set",
            f"trainer.steps={steps}",
            "--set",
            "logging.wandb=false",
            "--set",
            "logging.progress=false",
        ]
        subprocess.run(cmd, check=True, capture_output=True, timeout=1800)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f][2:]
    # stages are the numbers; a dict (`sync_detail`) is a breakdown of one of them
    stages = sorted(
        {
            k
            for r in rows
            for k, v in r["time_s"].items()
            if k != "step" and isinstance(v, int | float)
        }
    )
    med = {s: statistics.median(r["time_s"].get(s, 0.0) for r in rows) for s in stages}
    step = statistics.median(r["time_s"]["step"] for r in rows)
    common = dict(config="embedded default (tiny GRPO, CPU, fp32)", steps_measured=len(rows))
    times = [r["time_s"]["step"] for r in rows]
    out = [
        record(
            "step_seconds",
            step,
            "s/step",
            floor=sum(med.values()),
            floor_unit="s/step",
            higher_is_better=False,
            spread=[min(times), max(times)],
            floor_name="sum of the stage medians (loop overhead excluded)",
            **common,
        )
    ]
    spread = {
        s: [min(r["time_s"].get(s, 0.0) for r in rows), max(r["time_s"].get(s, 0.0) for r in rows)]
        for s in stages
    }
    out += [
        record(f"stage_{s}_seconds", t, "s", spread=spread[s], **common) for s, t in med.items()
    ]
    out.append(
        record(
            "step_tokens_per_s",
            statistics.median(r["tokens_per_s"] for r in rows),
            "tokens/s",
            **common,
        )
    )
    return out
