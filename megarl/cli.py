"""`megarl train [CONFIG.yaml] [--set key=value ...] [--out DIR]`.

Without a config: the embedded default, a tiny CPU GRPO run on a toy addition task that visibly
learns in a few minutes. Multi-rank: `torchrun --nproc_per_node N -m megarl train CONFIG`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="megarl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="run PPO / GRPO training")
    t.add_argument("config", nargs="?", help="YAML config (default: the embedded tiny CPU run)")
    t.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="dotted override, e.g. --set algorithm.kl_coef=0.01 (repeatable)",
    )
    t.add_argument("--out", help="run directory (default: runs/<config>-<time>)")
    t.add_argument("--print-config", action="store_true", help="print the resolved config, exit")
    args = parser.parse_args(argv)

    logging.basicConfig(
        level=os.environ.get("MEGARL_LOG", "INFO"),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    for noisy in ("megatron", "vllm"):  # their per-module INFO lines drown the step log
        logging.getLogger(noisy).setLevel(os.environ.get("MEGARL_LIB_LOG", "WARNING"))
    from megarl.config import ConfigError, load_config, to_dict

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"megarl: config error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        import yaml

        print(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        return 0

    import torch.distributed as dist

    from megarl.trainer.loop import TrainingDiverged, train
    from megarl.trainer.run import init_distributed

    init_distributed()
    out = [args.out]
    if out[0] is None:  # one name for every rank
        stem = os.path.splitext(os.path.basename(args.config))[0] if args.config else "default"
        out = [os.path.join("runs", f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}")]
        dist.broadcast_object_list(out, src=0)
    try:
        run = train(cfg, out[0])
    except TrainingDiverged as e:
        print(f"megarl: {e}", file=sys.stderr)
        return 3
    if dist.get_rank() == 0:
        print(
            f"megarl: run directory {os.path.abspath(run.out_dir)} "
            f"(metrics.jsonl, reward.png, checkpoints/)"
        )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
