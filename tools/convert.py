"""HF <-> megatron checkpoints and GGUF -> HF (exact, streaming, CPU only): `megarl convert`.

    python tools/convert.py gguf-to-hf --gguf FILE --out DIR
    python tools/convert.py hf-to-mcore --hf DIR --out DIR [--tp N] [--pp N] [--dtype D]
    python tools/convert.py mcore-to-hf --ckpt CKPT --out DIR [--role actor|critic] [--dtype D]

The same command as `megarl convert ...` (see `megarl convert --help`): a megatron checkpoint
(`torch_dist`) loads at any TP / PP / EP, `--ckpt` also reads trainer checkpoints
(`RUN/checkpoints/step_N` or a run directory), and `--verify` compares logits with transformers
(exit status 3 above `--tol`). An input error is one `megarl: error: ...` line with exit status
2; outputs are written under a hidden temporary name and renamed at the end.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ["MEGARL_DEVICE"] = "cpu"  # conversion never needs a GPU (and must not require one)


def main(argv: list[str] | None = None) -> int:
    from megarl.cli import main as megarl_main

    return megarl_main(["convert", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
