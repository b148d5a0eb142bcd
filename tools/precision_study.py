"""Which precision learns per step and per second: the SmolLM2 arithmetic workload of
`megarl bench --suite peer --model smollm2` run for each setting at each seed, one run at a time.

    python tools/precision_study.py --settings fp32 bf16 bf16+res32 bf16+tis --seeds 0 1 2 \
        --steps 8 --json runs/precision_study.json [--trl bf16]

A setting is `megarl.benchmarks.peer_smollm2.megarl_config`'s precision name ("bf16+res32":
`precision.fp32_residual`, "bf16+tis": `algorithm.off_policy_correction: tis`); `--trl` adds
TRL runs of the same workload (bf16 = autocast over fp32 weights). Every finished run is appended
to the JSON file at once (a study survives an interruption; `--resume` skips the runs it holds).
Prints per setting: median s/step (steps 2+), mean trainer-vs-sampler logprob mismatch, held-out
accuracy per evaluation (mean over seeds, with the spread) and seconds to 0.6 and 0.85 per seed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

TARGETS = (0.6, 0.85)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--settings", nargs="+", default=["fp32", "bf16"])
    p.add_argument("--trl", nargs="*", default=[], help="TRL precisions (fp32, bf16)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", required=True, help="results file (appended run by run)")
    p.add_argument("--resume", action="store_true", help="skip runs the JSON file holds")
    return p.parse_args(argv)


def main(argv=None) -> None:
    import torch

    from megarl.benchmarks import peer, peer_smollm2

    args = parse_args(argv)
    threads = args.threads or torch.get_num_threads()
    runs = _load(args.json) if args.resume else []
    done = {(r["system"], r["setting"], r["seed"]) for r in runs}
    plan = [("megarl", s) for s in args.settings] + [("trl", s) for s in args.trl]
    workload = peer.WORKLOADS["smollm2"]()
    with tempfile.TemporaryDirectory(prefix="megarl_precision_") as tmp:
        model_dir, _ = peer_smollm2.prepare(tmp)
        for seed in args.seeds:
            for system, setting in plan:
                if (system, setting, seed) in done:
                    continue
                t0 = time.strftime("%Y-%m-%d %H:%M:%S")
                res = peer.RUNNERS[system](
                    model_dir, setting, args.steps, threads, workload=workload, data_dir=tmp,
                    seed=seed,
                )  # fmt: skip
                res.update(system=system, setting=setting, seed=seed, started=t0)
                runs.append(res)
                _save(args.json, runs)
                print(_run_line(res), flush=True)
    print(table(runs))


def _load(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return json.load(f)["runs"]


def _save(path: str, runs: list[dict]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"runs": runs}, f, indent=1)
    os.replace(tmp, path)


def _run_line(r: dict) -> str:
    evals = " ".join(f"{s}:{a:.3f}" for s, a in r["evals"])
    return f"{r['system']} {r['setting']} seed {r['seed']}: {evals}"


def summary(runs: list[dict]) -> list[dict]:
    """Per (system, setting): the figures the table prints."""
    from megarl.benchmarks.peer_smollm2 import time_to_target

    out = []
    keys = sorted({(r["system"], r["setting"]) for r in runs}, key=lambda k: (k[0], k[1]))
    for key in keys:
        rs = [r for r in runs if (r["system"], r["setting"]) == key]
        rs.sort(key=lambda r: r["seed"])
        steps = sorted({s for r in rs for s, _ in r["evals"]})
        acc = {s: [a for r in rs for t, a in r["evals"] if t == s] for s in steps}
        mism = [m for r in rs for m in r.get("mismatch", [])]
        out.append(
            dict(
                system=key[0],
                setting=key[1],
                seeds=[r["seed"] for r in rs],
                s_per_step=statistics.median(s for r in rs for s in r["step_s"][1:] or r["step_s"]),
                mismatch=statistics.fmean(mism) if mism else float("nan"),
                accuracy={s: (statistics.fmean(a), min(a), max(a)) for s, a in acc.items()},
                to_target={
                    t: [time_to_target(r["evals"], r["step_s"], t)["seconds"] for r in rs]
                    for t in TARGETS
                },
            )
        )
    return out


def table(runs: list[dict]) -> str:
    rows = summary(runs)
    if not rows:
        return "no runs"
    steps = sorted({s for r in rows for s in r["accuracy"]})
    head = ["system", "setting", "seeds", "s/step", "mismatch"]
    head += [f"acc@{s}" for s in steps] + [f"s to {t}" for t in TARGETS]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        cells = [r["system"], r["setting"], ",".join(map(str, r["seeds"]))]
        cells += [f"{r['s_per_step']:.1f}", f"{r['mismatch']:.1e}"]
        for s in steps:
            m, lo, hi = r["accuracy"].get(s, (float("nan"),) * 3)
            cells.append(f"{m:.3f} ({lo:.2f}-{hi:.2f})")
        for t in TARGETS:
            cells.append(" / ".join("-" if v != v else f"{v:.0f}" for v in r["to_target"][t]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
