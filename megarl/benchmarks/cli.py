"""`megarl bench --suite NAME [--json OUT] [--report OUT.md]` (also `python tools/benchmark.py`).

Suites: sync, advantage, rollout, train, step, convert, or all; peer (megarl against TRL's
GRPOTrainer, optional dependency `megarl[peer]`), multi_turn (trajectories against one turn
of the same tokens) and passes (where the reference and train passes' time goes, against their
GEMM floor), both on SmolLM2-135M-Instruct, fetched once, run only when named. Every record
carries its unit, the machine and, where known, the physical floor measured in the same run and
the ratio to it.
`--report OUT.md` writes the markdown report (a table per suite, machine, versions) and OUT.png
(the RL step's stages); `--from-json IN --report OUT.md` renders it from an earlier `--json`.
"""

from __future__ import annotations

import argparse
import json
import os

from megarl.benchmarks import OPT_IN_SUITES, SUITE_MODULES, get_suite, get_summary
from megarl.benchmarks.report import write_report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="megarl bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--suite", help=f"one of {sorted(SUITE_MODULES)} or 'all'")
    p.add_argument("--json", help="write the records to this file (JSON list)")
    p.add_argument("--report", help="write the markdown report here (and its .png beside it)")
    p.add_argument("--from-json", help="report on the records of an earlier --json run")
    p.add_argument("--quick", action="store_true", help="smaller sizes, for smoke-testing")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="peer: runs of each system, interleaved (A, B, A, B, ...)",
    )
    p.add_argument(
        "--model",
        choices=("random", "smollm2"),
        default="random",
        help="peer: the workload's model: a random 18.9M Llama on a toy task (default), or "
        "SmolLM2-135M-Instruct (fetched like `megarl fetch-model`) on the small-addition example "
        "with a reference pass and the time to a held-out accuracy",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="peer: RL steps of each run (default: the workload's; --quick: 4; at least 3, "
        "as steps 1-2 are warm-up)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="peer: torch intra-op threads of each run (default: torch's own)",
    )
    args = p.parse_args(argv)
    if args.from_json:
        if not args.report or args.suite:
            p.error("--from-json needs --report and no --suite")
        with open(args.from_json) as f:
            records = json.load(f)
        print(f"report: {write_report(records, args.report)}")
        return 0
    if args.steps is not None and args.steps < 3:
        p.error(f"--steps {args.steps}: at least 3 (the peer suite's steps 1-2 are warm-up)")
    if not args.suite:
        p.error("--suite is required (or --from-json IN --report OUT.md)")
    everything = [n for n in sorted(SUITE_MODULES) if n not in OPT_IN_SUITES]
    names = everything if args.suite == "all" else [args.suite]
    records: list[dict] = []
    for name in names:
        suite_records = get_suite(name)(args)
        for rec in suite_records:
            records.append({"suite": name, **rec})
            floor = ""
            if "floor" in rec:
                floor = f"  (floor {rec['floor']:.4g} {rec['floor_unit']}, "
                floor += f"{100 * rec['ratio_to_floor']:.1f}% of floor)"
            print(f"[{name}] {rec['name']}: {rec['value']:.4g} {rec['unit']}{floor}", flush=True)
        summary = get_summary(name)
        if summary is not None:
            print(summary(suite_records), flush=True)
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(records, f, indent=1)
        os.replace(tmp, args.json)
    if args.report:
        print(f"report: {write_report(records, args.report)}")
    return 0
