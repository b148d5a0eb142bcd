"""HF <-> megatron-core checkpoints (exact, streaming, CPU only).

    python tools/convert.py hf-to-mcore --hf DIR --out DIR [--tp N] [--pp N] [--dtype D]
    python tools/convert.py mcore-to-hf --ckpt DIR --out DIR [--dtype ...]

The megatron checkpoint (`torch_dist`) loads at any TP / PP / EP: `--tp/--pp` are checked against
the model and recorded as the suggested training layout. `--verify` then runs transformers and
megatron on the same token ids and exits with status 3 when max |delta logit| exceeds `--tol`.

An input error (unreadable or unsupported model files, a layout that does not fit the model, an
output that already holds files) is printed as one `megarl: error: ...` line with exit status 2,
before any model is built; the output directory is written under a hidden temporary name and
renamed at the end, so a failed conversion leaves none. `--debug` adds tracebacks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ["MEGARL_DEVICE"] = "cpu"  # conversion never needs a GPU (and must not require one)


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("hf-to-mcore", help="HF directory -> megatron torch_dist checkpoint")
    a.add_argument("--hf", required=True, help="HF model directory (config.json + safetensors)")
    a.add_argument("--out", required=True, help="output checkpoint directory")
    a.add_argument("--tp", type=int, default=1, help="suggested tensor parallel size (recorded)")
    a.add_argument("--pp", type=int, default=1, help="suggested pipeline parallel size (recorded)")
    a.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="default: the HF dtype")
    a.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    b = sub.add_parser("mcore-to-hf", help="megatron checkpoint -> HF directory")
    b.add_argument("--ckpt", required=True, help="checkpoint written by hf-to-mcore or the trainer")
    b.add_argument("--out", required=True, help="output HF directory")
    b.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="default: checkpoint dtype")
    b.add_argument("--max-shard-gb", type=float, default=2.0, help="safetensors shard size")
    for s in (a, b):
        s.add_argument("--overwrite", action="store_true", help="replace an existing --out")
        s.add_argument("--verify", action="store_true", help="compare logits with transformers")
        s.add_argument("--tol", type=float, default=1e-3, help="max |delta logit| for --verify")
        s.add_argument("--no-progress", action="store_true")
        s.add_argument("--verbose", action="store_true", help="show the libraries' logs")
        s.add_argument("--debug", action="store_true", help="tracebacks for input errors too")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Ends the process itself (`megarl.console.end_process`) unless `--verbose`."""
    from megarl import console

    args = _args(argv)
    console.setup(verbose=args.verbose)
    code = console.run_guarded(partial(_convert, args), debug=args.debug)
    if args.verbose:
        return code
    console.end_process(code)


def _convert(args: argparse.Namespace) -> int:
    from megarl.convert.pipeline import hf_to_mcore, mcore_to_hf

    if args.cmd == "hf-to-mcore":
        summary = hf_to_mcore(
            args.hf,
            args.out,
            tp=args.tp,
            pp=args.pp,
            dtype=args.dtype,
            make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
            overwrite=args.overwrite,
            progress=not args.no_progress,
        )
        hf_dir, ckpt = args.hf, args.out
    else:
        summary = mcore_to_hf(
            args.ckpt,
            args.out,
            dtype=args.dtype,
            max_shard_bytes=int(args.max_shard_gb * 2**30),
            overwrite=args.overwrite,
            progress=not args.no_progress,
        )
        hf_dir, ckpt = args.out, args.ckpt
    print(json.dumps({"converted": args.out, **summary}))
    if args.verify:
        from megarl.convert.verify import verify

        res = verify(hf_dir, ckpt, tol=args.tol)
        print(
            f"verify: max |delta logit| {res['max_abs_delta']:.3g}, mean "
            f"{res['mean_abs_delta']:.3g}, argmax agreement {100 * res['argmax_agreement']:.2f}% "
            f"(tol {args.tol:g}): {'OK' if res['ok'] else 'FAILED'}"
        )
        if not res["ok"]:
            return 3
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
