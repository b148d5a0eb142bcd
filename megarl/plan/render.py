"""The text `megarl plan` prints: a verdict, the layout, each stage's table and phase peaks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megarl.plan.formulas import PHASES, gib

if TYPE_CHECKING:  # annotations only: memory imports this module to print its Plan
    from megarl.plan.memory import Plan, StagePlan


def describe(plan: Plan) -> str:
    """The whole report: header, warnings, layout problems or the worst stage's table, the
    verdict and what would change it."""
    lines = [_header(plan)]
    lines += [f"warning: {w}" for w in plan.warnings]
    if plan.problems:
        lines += [f"layout: {p}" for p in plan.problems]
        lines += [f"  {a}" for a in plan.advice]
        lines.append(f"DOES NOT FIT: this layout cannot run on {plan.gpus} GPUs")
        return "\n".join(lines) + "\n"
    t = plan.topo
    lines.append(
        f"layout: TP {t.tp} x PP {t.pp} x DP {t.dp}{f' (VPP {t.vpp})' if t.vpp else ''}"
        f"{f', EP {t.ep}' if t.ep > 1 else ''}, sequence parallel "
        f"{'on' if plan.cfg.parallel.sequence_parallel else 'off'}, recompute "
        f"{plan.cfg.parallel.recompute}; vLLM TP {plan.cfg.rollout.tensor_parallel}"
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
