"""`megarl plan --stage-costs SOURCE ... --gpus N`: colocated or separate rollout, which split of
the devices, and whether to generate ahead, predicted from what each stage of a step costs.

A step's stages:

    generate   vLLM producing the step's samples
    trainer    logprobs (old, reference), critic, the update
    other      reward, advantage, balancing (host side): no device count changes it
    sync       the actor's weights into the engines, per placement

Colocated on N devices each stage gets all N in turn:

    step = generate(N) + trainer(N) + other + sync_colocated

Separate, E devices host engines and N - E train. On-policy (`rollout.placement.max_staleness: 0`)
the two sides take turns:

    step = generate(E) + trainer'(N - E) + other + sync_separate

Generating ahead (k >= 1), the engines generate the next step's samples while the trainer
trains, and the sync holds both sides:

    step = sync_separate + max(generate(E), trainer'(N - E) + other)

With partial rollouts (`partial_rollout: true`: a generation cut by a weight update resumes
after it, as verl's fully_async does) the engines never wait for a step's longest samples, which
finish in a later step: generation is throughput-bound,

    generate(E) = W / E,   from   generate(n) = T + W / n

fitted to the colocated generation times (least squares over the known device counts, T >= 0;
T is the long tail, the latency of the longest samples, which no device count shortens; with one
known count T = `generate_tail_s`, default 0). A synchronous step always waits for its tail.

trainer' is the trainer's work when separate (default: the same as colocated; a trainer that
takes the engines' logprobs as the old ones skips a forward pass). In this steady-state model
every k >= 1 gives the same step time: a larger k only absorbs step-to-step variation of the
generation time, which the model leaves out.

generate(n) and trainer(n) are curves through the times known at some device counts: a power law
through the two nearest known points (beyond the known range, the nearest segment's), or
t(n) = t0 * (n0 / n) ** a through a single point (`a` = 1 unless stated: the work spread evenly
over the devices). Neither generation (its longest sequences) nor training scales evenly in
practice, so each stage should be known at the device counts the splits give it.

A source is a run directory (its `metrics.jsonl`: medians of the stages' `time_s` over the
steps after the first; `job.yaml`: its devices; `config.yaml`: samples per step and layout
multiples) or a YAML file of stated costs (`STATED_KEYS`, e.g. a published run's profile).
Colocated runs give points of the stage curves; a separate run gives `sync_separate` and its
measured step time, which the plan prints beside its prediction.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass

import yaml

from megarl.config import ConfigError
from megarl.rollout.config import migrate_keys

TRAINER_STAGES = ("logprobs", "train")
OTHER_STAGES = ("reward", "advantage", "balance")
STATED_KEYS = {
    "name": "what the costs describe (printed)",
    "source": "where the figures come from: a URL, a paper, a run (printed)",
    "devices": "GPUs (or CPU cores) of the colocated run the costs describe",
    "generate_s": "seconds per step generating: a number (on `devices`) or {devices: seconds}",
    "trainer_s": "seconds per step of trainer work (logprobs, reference, critic, update): a "
    "number or {devices: seconds}",
    "separate_trainer_s": "the trainer's seconds when separate, if it does other work (e.g. "
    "takes the engines' logprobs as the old ones); default: trainer_s",
    "scaling": "{generate: a, trainer: a}: a stage known at one device count scales as "
    "t * (n0 / n) ** a; default 1 each",
    "other_s": "seconds per step that no device count changes (reward, advantage); default 0",
    "sync_s": "seconds of the colocated weight sync; default 0",
    "separate_sync_s": "seconds of a sync to separate engines; default: sync_s",
    "samples_per_step": "samples per step (throughput column); default: none printed",
    "partial_rollout": "generations cut by a weight update resume after it (throughput-bound "
    "generation when generating ahead); default false",
    "generate_tail_s": "seconds of the colocated generation no device count shortens (the "
    "longest samples); default: fitted to the colocated counts, 0 with one count",
    "engine_multiple": "engine devices come in multiples of this (vLLM TP x instances); default 1",
    "trainer_multiple": "trainer devices come in multiples of this (TP x PP x CP); default 1",
    "measured": "published results to check the model on: a list of {devices, engines, "
    "max_staleness, step_s} or {..., speedup} (vs colocated on the same devices), with source",
}


@dataclass(frozen=True)
class Curve:
    """A stage's seconds per step by device count, through the known `points` (module
    docstring); `a`: the exponent through a single point."""

    points: tuple[tuple[int, float], ...]
    a: float = 1.0

    def at(self, n: int) -> float:
        pts = self.points
        if len(pts) == 1:
            n0, t0 = pts[0]
            return t0 * (n0 / n) ** self.a
        i = next((i for i in range(1, len(pts) - 1) if n < pts[i][0]), len(pts) - 1)
        (n1, t1), (n2, t2) = pts[i - 1], pts[i]
        a = math.log(t1 / t2) / math.log(n2 / n1)
        return t1 * (n1 / n) ** a

    @staticmethod
    def of(points: dict, a: float = 1.0) -> Curve:
        return Curve(tuple(sorted((int(n), float(t)) for n, t in points.items())), a)


@dataclass(frozen=True)
class Measured:
    """A measured layout: `engines` = 0 for colocated; `step_s`, or `speedup` vs colocated."""

    devices: int
    engines: int
    max_staleness: int
    step_s: float | None = None
    speedup: float | None = None
    source: str = ""


@dataclass(frozen=True)
class StageCosts:
    devices: int
    """The device count the plan shows the stages at by default (the colocated run's)."""
    generate: Curve
    trainer: Curve
    other: float
    sync: float
    separate_sync: float | None = None
    """None: not measured; the colocated sync is assumed (said in the plan)."""
    separate_trainer: Curve | None = None
    samples_per_step: int | None = None
    partial_rollout: bool = False
    generate_tail: float | None = None
    """Stated T of generate(n) = T + W / n; None: fitted (module docstring)."""
    engine_multiple: int = 1
    trainer_multiple: int = 1
    measured: tuple[Measured, ...] = ()
    sources: tuple[str, ...] = ()

    @property
    def sync_separate(self) -> float:
        return self.sync if self.separate_sync is None else self.separate_sync

    def tail_and_work(self) -> tuple[float, float]:
        """(T, W) of generate(n) = T + W / n (module docstring)."""
        pts = self.generate.points
        if self.generate_tail is not None or len(pts) == 1:
            tail = self.generate_tail or 0.0
            return tail, statistics.median((t - tail) * n for n, t in pts)
        xs, ys = [1 / n for n, _ in pts], [t for _, t in pts]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        work = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
            (x - mx) ** 2 for x in xs
        )
        tail = my - work * mx
        if tail < 0 or work <= 0:  # no tail visible: the work through the origin
            tail = 0.0
            work = sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
        return tail, work


@dataclass(frozen=True)
class Layout:
    """One predicted layout; `engines` = 0 is colocated."""

    engines: int
    trainers: int
    max_staleness: int
    generate: float
    trainer: float
    sync: float
    step: float


def predict(c: StageCosts, devices: int, engines: int, max_staleness: int) -> Layout:
    """The step time of `devices` devices of which `engines` host engines (0: colocated), with
    generation `max_staleness` steps ahead (module docstring)."""
    if engines == 0:
        g, t, s = c.generate.at(devices), c.trainer.at(devices), c.sync
        return Layout(0, devices, 0, g, t, s, g + t + c.other + s)
    trainer = c.separate_trainer or c.trainer
    g, t, s = c.generate.at(engines), trainer.at(devices - engines), c.sync_separate
    if max_staleness >= 1 and c.partial_rollout:
        g = c.tail_and_work()[1] / engines
    if max_staleness == 0:
        step = g + t + c.other + s
    else:
        step = s + max(g, t + c.other)
    return Layout(engines, devices - engines, max_staleness, g, t, s, step)


@dataclass(frozen=True)
class Check:
    """A measured separate layout against its prediction."""

    measured: Measured
    predicted: float
    """Predicted step seconds (or speedup, when `measured.speedup` is stated)."""
    error: float
    """(predicted - measured) / measured."""
    right_placement: bool | None
    """Whether the plan ranks it against colocated on the same devices as measured; None when
    no colocated step there is stated."""


def checks(c: StageCosts) -> list[Check]:
    """Every measured separate layout of `c` against its prediction (colocated entries serve
    as the placement's reference)."""
    colocated = {m.devices: m.step_s for m in c.measured if m.engines == 0 and m.step_s}
    out = []
    for m in c.measured:
        if m.engines == 0:
            continue
        p = predict(c, m.devices, m.engines, m.max_staleness).step
        col = predict(c, m.devices, 0, 0).step
        got, want = (p, m.step_s) if m.step_s is not None else (col / p, m.speedup)
        right = None
        if m.devices in colocated and m.step_s is not None:
            right = (p < col) == (m.step_s < colocated[m.devices])
        out.append(Check(m, got, (got - want) / want, right))
    return out


def splits(c: StageCosts, devices: int) -> list[int]:
    """Engine device counts that leave the trainer a whole number of its multiples."""
    return [
        e
        for e in range(c.engine_multiple, devices, c.engine_multiple)
        if (devices - e) % c.trainer_multiple == 0
    ]


def layouts(c: StageCosts, devices: int) -> list[Layout]:
    """Colocated, the fastest split at k = 0, then every split at k >= 1 (written as 1)."""
    on_policy = [predict(c, devices, e, 0) for e in splits(c, devices)]
    rows = [predict(c, devices, 0, 0), *([min(on_policy, key=lambda r: r.step)] * bool(on_policy))]
    return rows + [predict(c, devices, e, 1) for e in splits(c, devices)]


# ---------------------------------------------------------------------- sources


def load_costs(sources: list[str]) -> StageCosts:
    """The stage costs of `sources` (run directories, or one stated-cost YAML file; module
    docstring). `ConfigError` names the source and what is missing."""
    if not sources:
        raise ConfigError("--stage-costs: accepted: one or more run directories or YAML files")
    missing = [s for s in sources if not os.path.exists(s)]
    if missing:
        raise ConfigError(
            f"--stage-costs {missing[0]}: no such file or directory; accepted: run directories "
            "(of megarl train) or one YAML file of stated costs"
        )
    stated = [s for s in sources if not os.path.isdir(s)]
    if stated:
        if len(sources) > 1:
            raise ConfigError(
                f"--stage-costs {' '.join(sources)}: a stated-cost file ({stated[0]}) stands "
                "alone; accepted: one YAML file, or run directories"
            )
        return _stated(stated[0])
    runs = [_run_record(s) for s in sources]
    colocated = [r for r in runs if r["engines"] == 0]
    if not colocated:
        raise ConfigError(
            f"--stage-costs {' '.join(sources)}: no colocated run among them; accepted: at "
            "least one run directory of a colocated run (its stages give the costs)"
        )
    separate = [r for r in runs if r["engines"] > 0]
    base = max(colocated, key=lambda r: r["devices"])

    def curve(stage: str) -> Curve:
        by_n: dict[int, list[float]] = {}
        for r in colocated:
            by_n.setdefault(r["devices"], []).append(r[stage])
        return Curve.of({n: statistics.median(ts) for n, ts in by_n.items()})

    return StageCosts(
        devices=base["devices"],
        generate=curve("generate"),
        trainer=curve("trainer"),
        other=statistics.median(r["other"] for r in colocated),
        sync=statistics.median(r["sync"] for r in colocated),
        separate_sync=statistics.median(r["sync"] for r in separate) if separate else None,
        samples_per_step=base["samples"],
        engine_multiple=base["engine_multiple"],
        trainer_multiple=base["trainer_multiple"],
        measured=tuple(
            Measured(r["devices"], r["engines"], r["max_staleness"], r["step"], None, r["path"])
            for r in runs
        ),
        sources=tuple(sources),
    )


def _run_record(path: str) -> dict:
    """One run directory's stage medians, devices and layout (see `load_costs`)."""
    metrics, job_file = os.path.join(path, "metrics.jsonl"), os.path.join(path, "job.yaml")
    for f in (metrics, job_file, os.path.join(path, "config.yaml")):
        if not os.path.isfile(f):
            raise ConfigError(
                f"--stage-costs {path}: no {os.path.basename(f)}; accepted: the directory of "
                "an RL run (megarl train writes metrics.jsonl, job.yaml and config.yaml there)"
            )
    with open(job_file) as f:
        job = yaml.safe_load(f)
    with open(os.path.join(path, "config.yaml")) as f:
        cfg = yaml.safe_load(f)
    migrate_keys(cfg)  # a run of an earlier release wrote the flat rollout keys
    steps = []
    with open(metrics) as f:
        for line in f:
            row = json.loads(line) if line.strip() else None
            if isinstance(row, dict) and "rollout" in (row.get("time_s") or {}):
                steps.append(row["time_s"])
    if not steps:
        raise ConfigError(
            f"--stage-costs {path}: {metrics} has no finished RL step (time_s.rollout); "
            "accepted: a run with at least one step"
        )
    steps = steps[1:] or steps  # the first step warms up (compilation, caches)

    def median(*keys: str) -> float:
        return statistics.median(sum(float(t.get(k, 0.0)) for k in keys) for t in steps)

    # on CPU a device is a core (a rank's threads), and any split of the cores runs
    cpu = job.get("device") == "cpu"
    threads = int(job.get("threads_per_rank", 1)) if cpu else 1
    p, r = cfg["parallel"], cfg["rollout"]
    sampling, engine, placement = (r.get(k) or {} for k in ("sampling", "engine", "placement"))
    return {
        "path": path,
        "devices": int(job["ranks"]) * threads,
        "engines": int(job.get("engine_ranks", 0)) * threads,
        "max_staleness": int(placement.get("max_staleness") or 0),
        "generate": median("rollout"),
        "trainer": median(*TRAINER_STAGES),
        "other": median(*OTHER_STAGES),
        "sync": median("sync"),
        "step": median("step"),
        "samples": int(cfg["data"]["prompts_per_step"]) * int(sampling["n"]),
        "engine_multiple": 1 if cpu else int(engine.get("tensor_parallel") or 1),
        "trainer_multiple": 1
        if cpu
        else int(p["tensor_parallel"])
        * int(p["pipeline_parallel"])
        * int(p.get("context_parallel") or 1),
    }


def _stated(path: str) -> StageCosts:
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(
            f"--stage-costs {path}: {e.strerror}; accepted: a run directory or a YAML file"
        ) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--stage-costs {path}: accepted: a YAML mapping of {list(STATED_KEYS)}")
    unknown = sorted(set(raw) - set(STATED_KEYS))
    if unknown:
        raise ConfigError(f"{path}: unknown keys {unknown}; accepted: {list(STATED_KEYS)}")
    missing = [k for k in ("devices", "generate_s", "trainer_s") if k not in raw]
    if missing:
        raise ConfigError(f"{path}: missing {missing} ({STATED_KEYS[missing[0]]})")
    devices = int(raw["devices"])
    scaling = {"generate": 1.0, "trainer": 1.0, **(raw.get("scaling") or {})}
    if set(scaling) != {"generate", "trainer"}:
        raise ConfigError(f"{path}: scaling={raw['scaling']}; accepted: keys generate, trainer")

    def curve(key: str, a: float) -> Curve:
        v = raw[key]
        points = v if isinstance(v, dict) else {devices: v}
        if not points or any(float(t) <= 0 or int(n) < 1 for n, t in points.items()):
            raise ConfigError(f"{path}: {key}={v!r}; accepted: {STATED_KEYS[key]}, all > 0")
        return Curve.of(points, a)

    measured = []
    for m in raw.get("measured") or []:
        if not isinstance(m, dict) or ("step_s" in m) == ("speedup" in m) or "engines" not in m:
            raise ConfigError(
                f"{path}: measured entry {m!r}; accepted: {{devices, engines, max_staleness, "
                "step_s}} or {devices, engines, max_staleness, speedup}"
            )
        measured.append(
            Measured(
                int(m.get("devices", devices)),
                int(m["engines"]),
                int(m.get("max_staleness", 0)),
                m.get("step_s"),
                m.get("speedup"),
                str(m.get("source", "")),
            )
        )
    return StageCosts(
        devices=devices,
        generate=curve("generate_s", float(scaling["generate"])),
        trainer=curve("trainer_s", float(scaling["trainer"])),
        separate_trainer=curve("separate_trainer_s", float(scaling["trainer"]))
        if "separate_trainer_s" in raw
        else None,
        other=float(raw.get("other_s", 0.0)),
        sync=float(raw.get("sync_s", 0.0)),
        separate_sync=raw.get("separate_sync_s"),
        samples_per_step=raw.get("samples_per_step"),
        partial_rollout=bool(raw.get("partial_rollout", False)),
        generate_tail=raw.get("generate_tail_s"),
        engine_multiple=int(raw.get("engine_multiple", 1)),
        trainer_multiple=int(raw.get("trainer_multiple", 1)),
        measured=tuple(measured),
        sources=(f"{raw.get('name', path)} ({raw.get('source', path)})",),
    )
