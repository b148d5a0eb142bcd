"""Benchmark suites: `python tools/benchmark.py --suite NAME [--json OUT]`.

Suites: sync, advantage, rollout, train, step, convert, or all. Every record carries its unit, the
machine and, where known, the physical floor measured in the same run and the ratio to it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megarl.benchmarks import SUITE_MODULES, get_suite  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--suite", required=True, help=f"one of {sorted(SUITE_MODULES)} or 'all'")
    p.add_argument("--json", help="write the records to this file (JSON list)")
    p.add_argument("--quick", action="store_true", help="smaller sizes, for smoke-testing")
    args = p.parse_args(argv)
    names = sorted(SUITE_MODULES) if args.suite == "all" else [args.suite]
    records: list[dict] = []
    for name in names:
        for rec in get_suite(name)(args):
            records.append({"suite": name, **rec})
            floor = ""
            if "floor" in rec:
                floor = f"  (floor {rec['floor']:.4g} {rec['floor_unit']}, "
                floor += f"{100 * rec['ratio_to_floor']:.1f}% of floor)"
            print(f"[{name}] {rec['name']}: {rec['value']:.4g} {rec['unit']}{floor}", flush=True)
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(records, f, indent=1)
        os.replace(tmp, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
