"""`megarl train [CONFIG.yaml] [--set key=value ...] [--out DIR | --resume]`, `megarl config
--reference`, `megarl convert {gguf-to-hf,hf-to-mcore,mcore-to-hf} ...`, `megarl fetch-model NAME
--out DIR`. `megarl show RUN` says where a run is (step, status, last metrics, samples, plots);
`megarl plot RUN` redraws its reward.png / loss.png.

Without --out a run gets a new directory runs/<config>-<time>/ (runs/default-<time>/ without a
config); `--resume` continues the newest such directory of the config instead (or --out DIR),
from its newest checkpoint.

`megarl train CONFIG --dry-run --world-size N [--rank R]` checks the layout for N ranks and
prints what rank R holds (groups, layers, parameters) without GPUs, weights, data or vLLM.
`megarl plan CONFIG --gpus N --gpu-mem GIB [--nodes K]` adds the memory of one GPU in every
phase of a step; exit status 0 when it fits, 1 when it does not (with what to change).
`megarl plan --stage-costs RUN... --gpus N` predicts the step time of colocated vs separate
rollout from a run's stage times (or a YAML file of stated ones) and names the fastest.
`megarl eval CONFIG` or `megarl eval MODEL_DIR [--config CONFIG]` evaluates a model on the
config's held-out prompts (eval.*) without training; MODEL_DIR is an HF directory (model.hf)
or a megarl checkpoint (model.mcore_ckpt). `megarl train --show-samples` prints each step's
best and worst sample.

Without a config: the embedded default, a tiny CPU GRPO run on a toy copy task that visibly
learns in a few minutes. Multi-rank: `torchrun --nproc_per_node N -m megarl train CONFIG`.

A mistake in the input (config, data, model or checkpoint directory, reward function, layout) is
found before the models and the rollout engine are built and printed once as
`megarl: error: ...` (exit status 2); `--debug` adds its traceback. `--verbose` shows what
vLLM, megatron-core and torch log, which a normal run hides (see `megarl.console`).

Exit status of `megarl train`: 0 done, 1 a bug (traceback), 2 an input error, 3 diverged
(trainer.max_bad_steps), 4 stopped on request after a checkpoint (SIGTERM / SIGUSR1, the stop
file RUN/STOP, trainer.time_limit_minutes: it prints the command that continues, the same
command with --out RUN), 5 a step hung
(trainer.step_timeout_minutes; stacks in RUN/hang-rank{R}.txt). See docs/preemption.md.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import time
from functools import partial

from megarl import console
from megarl.convert import command as convert
from megarl.errors import ConfigError

# Each command imports what it runs (torch, 2 s, and with it megarl.config and the trainer) in
# its function: `megarl --help` and argument errors import none of it (tests/test_cli.py), and
# `console.setup` runs before torch loads (it sets TORCH_CPP_LOG_LEVEL, which torch reads once).

# subcommands that own their parser, each `main(argv) -> int` in its module: `megarl NAME ARGS`
# runs `module.main(ARGS)`
TOOLS = {
    "bench": ("megarl.benchmarks.cli", "benchmark suites, each figure with its physical floor"),
    "prepare-data": ("megarl.data.prepare", "public dataset formats -> megarl's columns"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--verbose", action="store_true", help="show the libraries' logs (vLLM, megatron, torch)"
    )
    common.add_argument("--debug", action="store_true", help="tracebacks for input errors too")
    parser = argparse.ArgumentParser(
        prog="megarl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", parents=[common], help="run PPO / GRPO training")
    c = sub.add_parser(
        "config", parents=[common], help="print the resolved config, or every key (--reference)"
    )
    pl = sub.add_parser(
        "plan", parents=[common], help="will it fit: layout and per-GPU memory of each phase"
    )
    pl.add_argument("--gpus", type=int, required=True, metavar="N", help="GPUs of the run")
    pl.add_argument(
        "--gpu-mem",
        type=float,
        metavar="GIB",
        help="memory per GPU in GiB as the driver reports it (H100/H200 SXM: 80 / 141); "
        "required for the memory plan",
    )
    pl.add_argument(
        "--stage-costs",
        nargs="+",
        metavar="SOURCE",
        help="instead of memory: step time of colocated vs separate rollout (every split, "
        "generating ahead or not) on --gpus devices, from the stage costs of run directories "
        "(colocated runs at one or more device counts; separate runs add their sync) or of one "
        "YAML file of stated costs (megarl.plan.timing)",
    )
    pl.add_argument("--nodes", type=int, metavar="K", help="nodes (default: 8 GPUs per node)")
    for name, (_, what) in TOOLS.items():  # listed in --help; `main` hands them their argv
        sub.add_parser(name, help=f"{what} (megarl {name} --help)", add_help=False)
    e = sub.add_parser(
        "eval",
        parents=[common],
        help="evaluate a model on the held-out prompts (eval.*), no training",
        description="Evaluate a model on held-out prompts without training: the config's "
        "eval.* settings, its reward functions and data.* settings; writes OUT/metrics.jsonl "
        "(one record, eval/...), OUT/eval_samples.jsonl and prints a one-line summary.",
    )
    e.add_argument(
        "target",
        help="a YAML config, or a model: an HF directory (config.json; read as model.hf) or a "
        "megarl checkpoint directory (read as model.mcore_ckpt)",
    )
    e.add_argument(
        "--config",
        dest="config_file",
        metavar="CONFIG",
        help="with a model TARGET: the config whose eval/data/reward settings to use (default: "
        "the embedded tiny CPU run); its model.* source is replaced by TARGET",
    )
    e.add_argument("--out", help="output directory (default: runs/eval-<name>-<time>)")
    convert.add_parsers(sub, common)
    sh = sub.add_parser(
        "show",
        parents=[common],
        help="where a run is: step, status, last metrics, latest samples, plots",
        description="Where a run directory is: step / total steps, status (running, stopped, "
        "diverged, finished, interrupted), the last step's key metrics, the latest samples "
        "(samples.jsonl) and the plots. Reads only the files the run wrote; a running run is "
        "not disturbed.",
    )
    sh.add_argument("run", help="a run directory (runs/<name>-<time>, or the --out of the run)")
    sh.add_argument(
        "--samples", type=int, default=2, metavar="N", help="latest samples shown (default 2)"
    )
    pt = sub.add_parser(
        "plot",
        parents=[common],
        help="redraw a run's reward.png (RL) or loss.png (offline) from its metrics.jsonl",
        description="Redraw the plots of any run directory (running, stopped, diverged or "
        "finished) from its metrics.jsonl: reward.png for an RL run, loss.png for an offline "
        "one; prints their paths.",
    )
    pt.add_argument("run", help="a run directory (it holds metrics.jsonl)")
    for p in (t, c, pl, e):
        if p is not e:
            p.add_argument(
                "config", nargs="?", help="YAML config (default: the embedded tiny CPU run)"
            )
        p.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="dotted override, e.g. --set algorithm.kl_coef=0.01 (repeatable)",
        )
    t.add_argument("--out", help="run directory (default: a new runs/<config>-<time>)")
    t.add_argument(
        "--resume",
        action="store_true",
        help="continue the newest runs/<config>-<time>/ of this config (with --out: that "
        "directory) from its newest checkpoint; an error when there is none",
    )
    t.add_argument(
        "--show-samples",
        action="store_true",
        help="print each step's best and worst sample (prompt, completion, reward, advantage) "
        "on the console (sets logging.show_samples)",
    )
    t.add_argument("--print-config", action="store_true", help="print the resolved config, exit")
    t.add_argument(
        "--dry-run",
        action="store_true",
        help="check the layout for --world-size ranks and build one rank's model on the meta "
        "device (no GPU, weights, data or vLLM); print its groups and parameters, exit",
    )
    t.add_argument(
        "--world-size", type=int, metavar="N", help="with --dry-run: ranks of the real run"
    )
    t.add_argument(
        "--rank", type=int, metavar="R", help="with --dry-run: the rank to show (default 0)"
    )
    c.add_argument(
        "--reference",
        action="store_true",
        help="every key with its type, default and meaning, as markdown (docs/config.md)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """The `megarl` console script and `python -m megarl`. Ends the process itself
    (`console.end_process`) unless `--verbose`; in-process callers use `run`."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in TOOLS:
        import importlib

        return importlib.import_module(TOOLS[argv[0]][0]).main(argv[1:])
    args = parse_args(argv)
    code = run_command(args)
    if args.verbose:
        return code
    console.end_process(code)


def run_command(args: argparse.Namespace) -> int:
    """Run a parsed command; returns its exit status (2 for an input error)."""
    console.setup(verbose=args.verbose)
    command = {
        "train": _train,
        "config": _config,
        "plan": _plan,
        "eval": _eval,
        "convert": convert.convert,
        "fetch-model": convert.fetch,
        "show": _show,
        "plot": _plot,
    }[args.command]
    return console.run_guarded(partial(command, args), debug=args.debug)


def _config(args: argparse.Namespace) -> int:
    if args.reference:
        from megarl.config_reference import reference_markdown  # deferred: imports torch (2 s)

        sys.stdout.write(reference_markdown())
        return 0
    return _print_config(args)


def _plan(args: argparse.Namespace) -> int:
    from megarl.config import load_config  # deferred: imports torch (2 s)
    from megarl.plan import describe, plan  # deferred: imports torch (2 s)

    if args.stage_costs:
        from megarl.plan.render import describe_timing  # deferred: imports torch (2 s)
        from megarl.plan.timing import load_costs  # deferred: imports torch (2 s)

        if args.gpus < 1:
            raise ConfigError(f"--gpus {args.gpus}: accepted: a number of devices >= 1")
        print(describe_timing(load_costs(args.stage_costs), args.gpus), end="")
        return 0
    if args.gpu_mem is None:
        raise ConfigError("--gpu-mem: required for the memory plan (or --stage-costs SOURCE)")
    cfg = load_config(args.config, args.overrides)
    result = plan(
        cfg, gpus=args.gpus, gpu_mem_gib=args.gpu_mem, nodes=args.nodes, config_path=args.config
    )
    print(describe(result), end="")
    return 0 if result.fits else 1


def _print_config(args: argparse.Namespace) -> int:
    import yaml

    from megarl.config import load_config, to_dict  # deferred: imports torch (2 s)

    cfg = load_config(args.config, args.overrides)
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
    return 0


def _train(args: argparse.Namespace) -> int:
    from megarl.config import load_config  # deferred: imports torch (2 s)

    given = (args.config, list(args.overrides), args.show_samples)  # before the flag becomes a key
    if args.show_samples:
        args.overrides = [*args.overrides, "logging.show_samples=true"]
    if args.print_config:
        return _print_config(args)
    cfg = load_config(args.config, args.overrides)
    if args.dry_run or args.world_size is not None or args.rank is not None:
        return _dry_run(args, cfg)
    if args.out is not None and os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ConfigError(f"--out {args.out}: exists and is not a directory; accepted: a directory")
    stem = os.path.splitext(os.path.basename(args.config))[0] if args.config else "default"
    if args.resume:
        args.out = resume_dir(args.out, stem, args.config)

    from megarl.trainer import faults  # deferred: imports torch (2 s)

    faults.install_stop_signals()  # from here on SIGTERM / SIGUSR1 ask for a clean stop

    from megarl.distributed.process_group import init_distributed  # deferred: imports torch (2 s)
    from megarl.trainer import loop, offline  # deferred: imports torch (2 s)

    train = offline.train if cfg.algorithm.offline else loop.train

    from megarl import rollout  # deferred: imports torch (2 s)

    job = init_distributed(
        faults.collective_timeout(cfg.trainer),
        placement=cfg.rollout.placement.mode,
        engines=cfg.rollout.placement.ranks,
    )
    with job:
        if job.placement.role == "rollout":  # an engine rank: serves trainer rank 0 until stop
            return rollout.serve(job)
        with rollout.engine_ranks(job) as engines:  # they exit with the trainer's status
            engines.status = _train_ranks(args, cfg, given, stem, train, job)
        return engines.status


def _train_ranks(args: argparse.Namespace, cfg, given: tuple, stem: str, train, job) -> int:
    """The trainer ranks' part of `megarl train` (every rank, when the engines are colocated)."""
    import torch.distributed as dist

    from megarl.metrics.sinks import wandb_mode  # deferred: imports torch (2 s)
    from megarl.trainer import faults  # deferred: imports torch (2 s)
    from megarl.trainer.finish import TrainingDiverged  # deferred: imports torch (2 s)

    out = _out_dir(args.out, stem)
    if args.resume and dist.get_rank() == 0:
        print(f"megarl: resuming {out}", file=sys.stderr, flush=True)
    try:
        run_ = train(cfg, out, job)
    except TrainingDiverged as e:
        if dist.get_rank() == 0:
            print(f"megarl: {e}", file=sys.stderr)
        return 3
    except faults.RunStopped as e:
        message = f"megarl: {e}; to continue: {continue_command(*given, out)}"
        console.record_for_torchrun(message)  # torchrun's report shows it
        if dist.get_rank() == 0:
            print(message, file=sys.stderr, flush=True)
        return faults.EXIT_STOPPED
    if dist.get_rank() == 0:
        wandb = cfg.logging.wandb and wandb_mode(cfg.logging.wandb_mode) != "disabled"
        print(
            f"megarl: run directory {os.path.abspath(run_.out_dir)} "
            f"(metrics.jsonl, {'loss.png' if cfg.algorithm.offline else 'reward.png'}, "
            f"checkpoints/{', wandb/' if wandb else ''})"
        )
    dist.destroy_process_group()
    return 0


RUNS_ROOT = "runs"
"""Where a run without --out gets its directory, relative to the working directory."""
_RUN_TIME = "%Y%m%d-%H%M%S"


def _out_dir(out: str | None, stem: str) -> str:
    """`out`, or runs/<stem>-<time> named once for every rank (collective)."""
    import torch.distributed as dist

    name = [out]
    if out is None:
        name = [os.path.join(RUNS_ROOT, f"{stem}-{time.strftime(_RUN_TIME)}")]
        dist.broadcast_object_list(name, src=0)
    return name[0]


def newest_run_dir(stem: str, root: str = RUNS_ROOT) -> str | None:
    """The newest `root/<stem>-<YYYYmmdd-HHMMSS>` directory (by the time in its name, so every
    rank finds the same one), or None."""
    pattern = re.compile(re.escape(stem) + r"-\d{8}-\d{6}")
    try:
        names = [n for n in os.listdir(root) if pattern.fullmatch(n)]
    except FileNotFoundError:
        return None
    names = [n for n in names if os.path.isdir(os.path.join(root, n))]
    return os.path.join(root, max(names, key=lambda n: n[len(stem) + 1 :])) if names else None


def resume_dir(out: str | None, stem: str, config: str | None) -> str:
    """The run directory `megarl train --resume` continues: `out` (which must exist), else the
    newest runs/<stem>-<time>/; a `ConfigError` naming where it looked when there is none."""
    if out is not None:
        if not os.path.isdir(out):
            raise ConfigError(
                f"--resume --out {out}: no such run directory; accepted: an existing run "
                "directory, or --out without --resume to start a new run there"
            )
        return out
    found = newest_run_dir(stem)
    if found is None:
        what = f"megarl train {config}" if config else "megarl train (the default run)"
        raise ConfigError(
            f"{what} --resume: no run to resume, no directory "
            f"{os.path.join(os.path.abspath(RUNS_ROOT), stem)}-<YYYYmmdd-HHMMSS>/; accepted: "
            "start one without --resume, or name a run directory with --resume --out DIR"
        )
    return found


def continue_command(
    config: str | None, overrides: list[str], show_samples: bool, out: str, env=os.environ
) -> str:
    """The command that continues a run in `out`: the same `megarl train` with `--out out`,
    under the same torchrun launch (`env`: its LOCAL_WORLD_SIZE / WORLD_SIZE) when there was
    one."""
    words = ["megarl", "train"] + ([config] if config else [])
    for o in overrides:
        words += ["--set", o]
    words += ["--show-samples"] if show_samples else []
    words += ["--out", out]
    local, world = int(env.get("LOCAL_WORLD_SIZE", 1)), int(env.get("WORLD_SIZE", 1))
    if "TORCHELASTIC_RUN_ID" in env or world > 1:
        nodes = f" --nnodes {world // local}" if world > local else ""
        words[:1] = [f"torchrun{nodes} --nproc_per_node {local} -m megarl"]
        return " ".join(words[:1] + [shlex.quote(w) for w in words[1:]])
    return shlex.join(words)


def _show(args: argparse.Namespace) -> int:
    from megarl.trainer.watch import describe, read_status  # deferred: imports torch (2 s)

    try:
        status = read_status(args.run, samples=args.samples)
    except FileNotFoundError as e:
        raise ConfigError(f"megarl show: {e}") from None
    print(describe(status), end="")
    return 0


def _plot(args: argparse.Namespace) -> int:
    from megarl.metrics.plots import plot_run  # deferred: imports matplotlib (1 s)

    try:
        path = plot_run(args.run)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"megarl plot: {e}") from None
    print(f"megarl: {path}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from megarl.config import load_config  # deferred: imports torch (2 s)
    from megarl.trainer.eval_command import (  # deferred: imports torch (2 s)
        evaluate_model,
        model_overrides,
        require_held_out,
    )
    from megarl.trainer.evaluate import summary  # deferred: imports torch (2 s)

    target, config, overrides = args.target, args.config_file, list(args.overrides)
    is_config = os.path.isfile(target) and target.endswith((".yaml", ".yml"))
    if is_config:
        if config is not None:
            raise ConfigError(
                f"megarl eval {target} --config {config}: two configs; accepted: a config, or a "
                "model directory with --config"
            )
        config = target
    elif os.path.exists(target):
        overrides = model_overrides(os.path.abspath(target)) + overrides
    else:
        raise ConfigError(
            f"megarl eval {target}: no such file or directory; accepted: a YAML config, an HF "
            "model directory or a megarl checkpoint directory"
        )
    cfg = load_config(config, overrides)
    if args.out is not None and os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ConfigError(f"--out {args.out}: exists and is not a directory; accepted: a directory")
    require_held_out(cfg)

    import torch.distributed as dist

    from megarl.distributed.process_group import init_distributed  # deferred: imports torch (2 s)

    init_distributed()
    stem = os.path.splitext(os.path.basename(os.path.normpath(target)))[0]
    out = _out_dir(args.out, f"eval-{stem}")
    metrics = evaluate_model(cfg, out)
    if dist.get_rank() == 0:
        step = metrics.pop("step")
        what = f"eval of {target}" + (f" (step {step})" if step else "")
        print(f"megarl: {summary(what, metrics, cfg.eval)}; {os.path.abspath(out)}")
    dist.destroy_process_group()
    return 0


def _dry_run(args: argparse.Namespace, cfg) -> int:
    from megarl.trainer.dry_run import dry_run  # deferred: imports torch (2 s)

    if not args.dry_run:
        raise ConfigError(
            "--world-size / --rank go with --dry-run only (a real run takes its ranks from "
            "torchrun); e.g. megarl train CONFIG --dry-run --world-size 32"
        )
    if args.world_size is None:
        raise ConfigError("--dry-run needs --world-size N, the number of ranks of the real run")
    report = dry_run(cfg, world_size=args.world_size, rank=args.rank or 0, config_path=args.config)
    print(report.describe(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
