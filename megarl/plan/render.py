"""The text `megarl plan` prints: a verdict, the layout, each stage's table and phase peaks."""

from __future__ import annotations

from megarl.plan.formulas import PHASES, gib
from megarl.plan.records import Plan, StagePlan
from megarl.plan.timing import StageCosts, checks, layouts, predict


def describe(plan: Plan) -> str:
    """The whole report: header, warnings, the problems (layout, LoRA) or the worst stage's
    table, the verdict and what would change it."""
    lines = [_header(plan)]
    lines += [f"warning: {w}" for w in plan.warnings]
    if plan.problems:
        lines += list(plan.problems)
        lines += [f"  {a}" for a in plan.advice]
        what = "layout" if any(p.startswith("layout: ") for p in plan.problems) else "config"
        lines.append(f"DOES NOT FIT: this {what} cannot run on {plan.gpus} GPUs")
        return "\n".join(lines) + "\n"
    t = plan.topo
    lines.append(
        f"layout: TP {t.tp} x PP {t.pp} x DP {t.dp}{f' (VPP {t.vpp})' if t.vpp else ''}"
        f"{f', EP {t.ep}' if t.ep > 1 else ''}, sequence parallel "
        f"{'on' if plan.cfg.parallel.sequence_parallel else 'off'}, recompute "
        f"{plan.cfg.parallel.recompute}; vLLM TP {plan.cfg.rollout.engine.tensor_parallel}"
        + (f"; LoRA rank {lora.rank}, base frozen" if (lora := plan.cfg.model.lora).enabled else "")
    )
    worst = max(plan.stages, key=lambda s: s.worst[1])
    lines += _table(worst, plan)
    others = [s for s in plan.stages if s is not worst]
    if others:
        lines.append(
            "other pipeline stages' peaks: "
            + ", ".join(f"stage {s.pp_rank} {gib(s.worst[1])} ({s.worst[0]})" for s in others)
        )
    phase, peak = worst.worst
    verdict = "FITS" if plan.fits else "DOES NOT FIT"
    lines.append(
        f"{verdict}: peak {gib(peak)} ({phase}, stage {worst.pp_rank}) of "
        f"{gib(plan.usable)} usable ({round(plan.usable / plan.gpu_mem * 100)}% of "
        f"{gib(plan.gpu_mem)}: allocator fragmentation)"
    )
    if plan.advice:
        lines.append("what would change it:")
        lines += [f"  {a}" for a in plan.advice]
    return "\n".join(lines) + "\n"


def _header(plan: Plan) -> str:
    a = plan.arch
    where = plan.config_path or "embedded default config"
    return (
        f"megarl plan: {where} on {plan.gpus} x {gib(plan.gpu_mem)} "
        f"{'GPUs' if plan.device == 'gpu' else 'CPU ranks'} ({plan.nodes} node"
        f"{'s' if plan.nodes > 1 else ''}); model {a.family}, {a.num_layers} layers, "
        f"hidden {a.hidden_size}"
    )


def _table(stage: StagePlan, plan: Plan) -> list[str]:
    width = max(len(r.name) for r in stage.rows)
    lines = [
        f"per GPU of pipeline stage {stage.pp_rank} (rank {stage.rank}, {stage.layers} layers), "
        "the largest:",
        f"  {'':<{width}}  {'memory':>10}  {'phases':<26}  formula",
    ]
    for r in stage.rows:
        phases = "all" if set(r.phases) == set(PHASES) else ", ".join(r.phases)
        lines.append(f"  {r.name:<{width}}  {gib(r.nbytes):>10}  {phases:<26}  {r.formula}")
    lines.append("  peak per phase: " + ", ".join(f"{p} {gib(stage.peak(p))}" for p in PHASES))
    return lines


def describe_timing(costs: StageCosts, devices: int) -> str:
    """`megarl plan --stage-costs`: the costs read, every layout's predicted step, the fastest,
    and each measured layout beside its prediction (`megarl.plan.timing`)."""
    c = costs
    sync_sep = (
        f"{c.separate_sync:.2f} s"
        if c.separate_sync is not None
        else "not measured: the colocated sync assumed"
    )
    lines = [
        f"megarl plan: step time by rollout placement on {devices} devices",
        f"stage costs from {', '.join(c.sources)}",
        f"  generate {_curve(c.generate)}",
        f"  trainer {_curve(c.trainer)}",
    ]
    if c.separate_trainer is not None:
        lines.append(f"  trainer when separate {_curve(c.separate_trainer)}")
    lines += [
        f"  other {c.other:.2f} s; sync colocated {c.sync:.2f} s, separate {sync_sep}",
        "",
        "| placement | engines : trainers | max_staleness | generate s | trainer s | sync s "
        f"| step s | {'samples/s | ' if c.samples_per_step else ''}vs colocated |",
        f"|---|---|---|---|---|---|---|{'---|' if c.samples_per_step else ''}---|",
    ]
    rows = layouts(c, devices)
    base = rows[0].step
    best = min(rows, key=lambda r: r.step)
    for r in rows:
        where = "colocated" if r.engines == 0 else "separate"
        split = "-" if r.engines == 0 else f"{r.engines} : {r.trainers}"
        k = "0" if r.max_staleness == 0 else ">= 1"
        rate = f"{c.samples_per_step / r.step:.2f} | " if c.samples_per_step else ""
        mark = " **fastest**" if r is best else ""
        lines.append(
            f"| {where}{mark} | {split} | {k} | {r.generate:.2f} | {r.trainer:.2f} | "
            f"{r.sync:.2f} | {r.step:.2f} | {rate}{base / r.step:.2f}x |"
        )
    what = (
        "colocated"
        if best.engines == 0
        else f"separate, {best.engines} engine : {best.trainers} trainer devices, "
        f"max_staleness {'0' if best.max_staleness == 0 else '>= 1'}"
    )
    lines += ["", f"fastest: {what}: {best.step:.2f} s/step, {base / best.step:.2f}x colocated"]
    if c.measured:
        lines += ["", "measured vs predicted:"]
    placed = {id(k.measured): k.right_placement for k in checks(c)}
    for m in c.measured:
        n = m.devices or devices
        p = predict(c, n, m.engines, m.max_staleness)
        col = predict(c, n, 0, 0).step
        where = (
            "colocated"
            if m.engines == 0
            else f"separate {m.engines} : {n - m.engines}, k={m.max_staleness}"
        )
        if m.step_s is not None:
            got, want, unit = p.step, m.step_s, "s/step"
        else:
            got, want, unit = col / p.step, m.speedup, "x colocated"
        rank = placed.get(id(m))
        ranked = "" if rank is None else f", {'right' if rank else 'WRONG'} placement"
        lines.append(
            f"  {where} on {n}: measured {want:.2f} {unit}, predicted {got:.2f} "
            f"({(got - want) / want * 100:+.0f}%{ranked}){f'  [{m.source}]' if m.source else ''}"
        )
    return "\n".join(lines) + "\n"


def _curve(curve) -> str:
    """'12.00 s on 1, 10.00 s on 2 devices' (+ the exponent through a single point)."""
    known = ", ".join(f"{t:.2f} s on {n}" for n, t in curve.points) + " devices"
    if len(curve.points) == 1:
        known += f" (elsewhere x (n0/n)^{curve.a:g})"
    return known
