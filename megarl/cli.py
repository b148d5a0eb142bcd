"""`megarl train [CONFIG.yaml] [--set key=value ...] [--out DIR]`, `megarl config --reference`.

`megarl train CONFIG --dry-run --world-size N [--rank R]` checks the layout for N ranks and
prints what rank R holds (groups, layers, parameters) without GPUs, weights, data or vLLM.
`megarl plan CONFIG --gpus N --gpu-mem GIB [--nodes K]` adds the memory of one GPU in every
phase of a step; exit status 0 when it fits, 1 when it does not (with what to change).

Without a config: the embedded default, a tiny CPU GRPO run on a toy copy task that visibly
learns in a few minutes. Multi-rank: `torchrun --nproc_per_node N -m megarl train CONFIG`.

A mistake in the input (config, data, model or checkpoint directory, reward function, layout) is
found before the models and the rollout engine are built and printed once as
`megarl: error: ...` (exit status 2); `--debug` adds its traceback. `--verbose` shows what
vLLM, megatron-core and torch log, which a normal run hides (see `megarl.console`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial

from megarl import console


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
        required=True,
        metavar="GIB",
        help="memory per GPU in GiB as the driver reports it (H100/H200 SXM: 80 / 141)",
    )
    pl.add_argument("--nodes", type=int, metavar="K", help="nodes (default: 8 GPUs per node)")
    for p in (t, c, pl):
        p.add_argument("config", nargs="?", help="YAML config (default: the embedded tiny CPU run)")
        p.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="dotted override, e.g. --set algorithm.kl_coef=0.01 (repeatable)",
        )
    t.add_argument("--out", help="run directory (default: runs/<config>-<time>)")
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
    args = parse_args(argv)
    code = run(args)
    if args.verbose:
        return code
    console.end_process(code)


def run(args: argparse.Namespace) -> int:
    """Run a parsed command; returns its exit status (2 for an input error)."""
    console.setup(verbose=args.verbose)
    command = {"train": _train, "config": _config, "plan": _plan}[args.command]
    return console.run_guarded(partial(command, args), debug=args.debug)


def _config(args: argparse.Namespace) -> int:
    if args.reference:
        from megarl.config_reference import reference_markdown

        sys.stdout.write(reference_markdown())
        return 0
    return _print_config(args)


def _plan(args: argparse.Namespace) -> int:
    from megarl.config import load_config
    from megarl.plan import plan

    cfg = load_config(args.config, args.overrides)
    result = plan(
        cfg, gpus=args.gpus, gpu_mem_gib=args.gpu_mem, nodes=args.nodes, config_path=args.config
    )
    print(result.describe(), end="")
    return 0 if result.fits else 1


def _print_config(args: argparse.Namespace) -> int:
    import yaml

    from megarl.config import load_config, to_dict

    cfg = load_config(args.config, args.overrides)
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
    return 0


def _train(args: argparse.Namespace) -> int:
    from megarl.config import ConfigError, load_config

    if args.print_config:
        return _print_config(args)
    cfg = load_config(args.config, args.overrides)
    if args.dry_run or args.world_size is not None or args.rank is not None:
        return _dry_run(args, cfg)
    if args.out is not None and os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ConfigError(f"--out {args.out}: exists and is not a directory; accepted: a directory")

    import torch.distributed as dist

    from megarl.trainer import loop, offline
    from megarl.trainer.loop import TrainingDiverged
    from megarl.trainer.run import init_distributed

    train = offline.train if cfg.algorithm.offline else loop.train

    init_distributed()
    out = [args.out]
    if out[0] is None:  # one name for every rank
        stem = os.path.splitext(os.path.basename(args.config))[0] if args.config else "default"
        out = [os.path.join("runs", f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}")]
        dist.broadcast_object_list(out, src=0)
    try:
        run_ = train(cfg, out[0])
    except TrainingDiverged as e:
        if dist.get_rank() == 0:
            print(f"megarl: {e}", file=sys.stderr)
        return 3
    if dist.get_rank() == 0:
        wandb = cfg.logging.wandb and cfg.logging.wandb_mode != "disabled"
        print(
            f"megarl: run directory {os.path.abspath(run_.out_dir)} "
            f"(metrics.jsonl, {'loss.png' if cfg.algorithm.offline else 'reward.png'}, "
            f"checkpoints/{', wandb/' if wandb else ''})"
        )
    dist.destroy_process_group()
    return 0


def _dry_run(args: argparse.Namespace, cfg) -> int:
    from megarl.config import ConfigError
    from megarl.trainer.dry_run import dry_run

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
