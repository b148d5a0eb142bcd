"""The figures of `--suite peer` (`megarl.benchmarks.peer`) from its runs' per-step records:
medians, model FLOP rates against the GEMM floor, the ceiling, the time to a held-out accuracy,
and the markdown table. Pure bookkeeping (tests feed it fake runs)."""

from __future__ import annotations

import math
import statistics

from megarl.benchmarks import record
from megarl.benchmarks.peer_smollm2 import TARGET, time_to_target
from megarl.metrics.throughput import flops_per_token


def time_to_target_ratio(out: list[dict], common: dict) -> dict:
    """TRL's fastest time to the target accuracy over megarl's (NaN when either never got
    there)."""
    times = {
        (r["params"]["system"], r["params"]["precision"]): r["value"]
        for r in out
        if r["name"].endswith("_time_to_target_seconds")
    }
    reached = {k: v for k, v in times.items() if math.isfinite(v)}
    best = {
        system: min(((v, k[1]) for k, v in reached.items() if k[0] == system), default=None)
        for system in ("megarl", "trl")
    }
    value = float("nan")
    if best["megarl"] and best["trl"]:
        value = best["trl"][0] / best["megarl"][0]
    return record(
        "megarl_over_trl_time_to_target",
        value,
        "x",
        target=2.5,
        megarl_config=best["megarl"] and best["megarl"][1],
        trl_config=best["trl"] and best["trl"][1],
        seconds={f"{k[0]}_{k[1]}": v for k, v in times.items()},
        **common,
    )


def summarize(
    results: list[dict],
    gemm_floor: float,
    gemm_dtype: str,
    *,
    model: dict,
    samples: int,
    skip: int,
    reference: bool = False,
    evals: bool = False,
) -> dict:
    """Medians over the measured steps (all but the first `skip`) of every run of one system x
    precision: `model` the shape for model FLOPs, `samples` per step, `reference`: the steps
    hold a reference forward (its stage, "logprobs", is put at the floor in the ceiling too);
    with held-out `evals` also the time to the target accuracy (the median over the runs that
    reached it; all steps count)."""
    pick = lambda key: [v for r in results for v in r[key][skip:]]  # noqa: E731
    step_s, completion, tokens = pick("step_s"), pick("completion_tokens"), pick("tokens")
    rate = [c / s for c, s in zip(completion, step_s, strict=True)]
    stages = {k: [v for r in results for v in r["stages"][k][skip:]] for k in results[0]["stages"]}
    seq = statistics.mean(tokens) / samples
    fpt = flops_per_token(model, seq_len=round(seq), training=True, causal=True)
    fwd = flops_per_token(model, seq_len=round(seq), causal=True)
    train_flops = [fpt * t / s for t, s in zip(tokens, stages["train"], strict=True)]
    ref = stages.get("logprobs") if reference else None
    ref = ref or [0.0] * len(step_s)
    # the same steps with the train (and reference) passes at the GEMM floor (model FLOPs /
    # floor rate): what no implementation of them can beat on this machine
    at_floor = [
        c / (s - tr - lp + fpt * t / gemm_floor + (fwd * t / gemm_floor if reference
                                                    else 0.0))
        for c, s, tr, lp, t in zip(completion, step_s, stages["train"], ref, tokens, strict=True)
    ]  # fmt: skip
    mean_tokens = statistics.mean(tokens)
    stage_floors = {"train": fpt * mean_tokens / gemm_floor}
    if reference:
        stage_floors["logprobs"] = fwd * mean_tokens / gemm_floor
    ttt = {}
    if evals:
        per_run = [time_to_target(r["evals"], r["step_s"]) for r in results]
        done = [t["seconds"] for t in per_run if math.isfinite(t["seconds"])]
        ttt = {
            "seconds": statistics.median(done) if done else float("nan"),
            "runs": per_run,
            "evals": [r["evals"] for r in results],
        }
    return {
        "step_s": statistics.median(step_s),
        # per-step rate, then the median: a step's tokens and its seconds belong together
        "tokens_per_s": statistics.median(rate),
        # the fastest step: on a shared machine the least disturbed estimate of each system
        "best_tokens_per_s": max(rate),
        "mean_completion_len": statistics.mean(completion) / samples,
        "stages": {k: statistics.median(v) for k, v in stages.items()},
        "train_flops": statistics.median(train_flops),
        "train_at_floor_tokens_per_s": statistics.median(at_floor),
        "stage_floors": stage_floors,
        "time_to_target": ttt,
        "mismatch": [m for r in results for m in r.get("mismatch", [])],
        "gemm_floor": gemm_floor,
        "gemm_dtype": gemm_dtype,
        "all_step_s": step_s,
        "load_avg": [(r["load_before"], r["load_after"]) for r in results],
        "started": [r["started"] for r in results],
        "exit_hung": [r["exit_hung"] for r in results],
    }


def _time_to_target_line(r: dict) -> str:
    p = r["params"]
    runs = p["time_to_target"]["runs"]
    each = "; ".join(
        f"{t['start']:.3f} -> best {t['best']:.3f}, "
        + (f"{t['seconds']:.0f} s (step {t['step']})" if t["step"] is not None else "not reached")
        for t in runs
    )
    floors = ", ".join(f"{k} {v:.1f} s" for k, v in p["stage_floors"].items())
    stages = ", ".join(f"{k} {v:.1f} s" for k, v in p["stages"].items())
    return (
        f"{p['system']} {p['precision']}: held-out greedy accuracy {each}; median time to "
        f">= {TARGET}: {r['value']:.0f} s; stages {stages} (floors: {floors})"
    )


def markdown_table(records: list[dict]) -> str:
    """The comparison as a markdown table (one row per system x precision) and the ratio."""
    rows = [r for r in records if r["name"].endswith("_completion_tokens_per_s")]
    lines = [
        "| system | precision | s/step | rollout / train s | mean completion tokens "
        "| completion tokens/s (fastest step) | train FLOP/s (% of GEMM) | load avg (1 min) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = r["params"]
        if p.get("status") == "SKIP":
            lines.append(
                f"| {r['name'].split('_')[0]} | {r['name'].split('_')[1]} | SKIP: "
                f"{p['reason']} | | | | | |"
            )
            continue
        st = p["stages"]
        load = ", ".join(f"{a[0]:.1f}-{b[0]:.1f}" for a, b in p["load_avg"])
        lines.append(
            f"| {p['system']} | {p['precision']} | {p['step_s']:.2f} | {st['rollout']:.2f} / "
            f"{st['train']:.2f} | {p['mean_completion_len']:.1f} | {r['value']:.0f} "
            f"({p['best_tokens_per_s']:.0f}) | "
            f"{p['train_flops'] / 1e9:.1f} G ({100 * p['train_flops'] / p['gemm_floor']:.0f}%) "
            f"| {load} |"
        )
    for r in records:
        if r["name"] == "megarl_over_trl_best":
            p = r["params"]
            same = ", ".join(f"{k} {v:.2f}x" for k, v in p["same_precision"].items())
            at_floor = ", ".join(f"{k} {v:.2f}x" for k, v in p["train_at_floor"].items())
            passes = " and ".join(p.get("ceiling_stages", ["train"]))
            stage = "stage" if passes == "train" else "passes"
            lines.append(
                f"\nmegarl ({p['megarl_config']}) / TRL best ({p['trl_config']}): "
                f"{r['value']:.2f}x completion tokens/s (target 2x); same precision: "
                f"{same}; fastest step against fastest step: {p['fastest_steps']:.2f}x; "
                f"with megarl's {passes} {stage} at the GEMM floor (the ceiling): {at_floor}. "
                f"{p['threads']} threads, {p['rounds']} round(s), {p['date']}."
            )
        elif r["name"].endswith("_time_to_target_seconds"):
            lines.append(_time_to_target_line(r))
        elif r["name"] == "megarl_over_trl_time_to_target":
            p = r["params"]
            lines.append(
                f"time to the held-out target: TRL best ({p['trl_config']}) / megarl best "
                f"({p['megarl_config']}) = {r['value']:.2f}x (goal {p['target']}x)"
            )
        elif r["name"].startswith("gemm_"):
            lines.append(f"{r['name']}: {r['value'] / 1e9:.0f} GFLOP/s")
    return "\n".join(lines)
