"""The GPU check's results from its JSON lines: `--table FILE` the final table, `--lines FILE` one
line per check (what the driver prints after each step). Standard library only."""

from __future__ import annotations

import argparse
import json

ORDER = ("setup", "env", "train", "sync", "throughput", "optional")
KEY_FIGURES = (
    "gpu", "torch", "megatron_core", "python", "how", "group_backend", "ops", "tflops",
    "megarl_peak_tflops", "fraction_of_peak", "copy_GBps", "rw_GBps", "arch", "params", "shape",
    "logprob_mean", "loss", "grad_norm", "matrices_changed", "value_loss", "policy_loss",
    "critic_matrices_changed", "B_changed", "base_changed", "merged_vs_adapted_max",
    "logprob_abs_diff_mean", "logprob_abs_diff_max", "loss_abs_diff",
    "loss_tol", "mode", "pieces", "bitwise_equal", "tensors", "sync_s", "floor_s", "x_floor",
    "seq", "mbs", "tokens_per_s", "mfu", "peak_gib", "note",
)  # fmt: skip


def read(path: str) -> list[dict]:
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                out.append(
                    {
                        "step": "?",
                        "check": f"line {n}",
                        "status": "FAIL",
                        "reason": f"unreadable JSON line: {e}",
                        "figures": {},
                    }
                )
    return out


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        bad = {k: x for k, x in v.items() if x != "ok"}
        return "all ok" if not bad else json.dumps(bad)[:120]
    return str(v)


def figures_text(rec: dict, width: int = 150) -> str:
    if rec.get("status") != "PASS" and rec.get("reason"):
        text = str(rec["reason"])
    else:
        figs = rec.get("figures") or {}
        keys = [k for k in KEY_FIGURES if figs.get(k) is not None] or list(figs)[:6]
        text = " ".join(f"{k}={_fmt(figs[k])}" for k in keys)
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def table(recs: list[dict]) -> str:
    rank = {s: i for i, s in enumerate(ORDER)}
    recs = sorted(recs, key=lambda r: rank.get(r.get("step"), len(ORDER)))
    counts = {s: sum(r.get("status") == s for r in recs) for s in ("PASS", "FAIL", "SKIP")}
    lines = [
        f"megarl GPU check: {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP",
        f"{'STEP':<11} {'CHECK':<24} {'STATUS':<6} {'SECONDS':>8}  FIGURES / REASON",
    ]
    for r in recs:
        secs = r.get("seconds")
        secs = f"{secs:8.1f}" if isinstance(secs, (int, float)) else f"{'':8}"
        lines.append(
            f"{str(r.get('step')):<11} {str(r.get('check')):<24} "
            f"{str(r.get('status')):<6} {secs}  {figures_text(r)}"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--table", metavar="FILE")
    g.add_argument("--lines", metavar="FILE")
    args = p.parse_args()
    if args.table:
        print(table(read(args.table)))
        return
    for r in read(args.lines):
        secs = r.get("seconds")
        took = f" ({secs:.1f} s)" if isinstance(secs, (int, float)) else ""
        print(f"{r.get('status')} {r.get('step')}.{r.get('check')}{took}: {figures_text(r, 400)}")


if __name__ == "__main__":
    main()
