"""The precisions megarl's configs name (`precision.dtype`: fp32, bf16, fp16) and what each is
elsewhere, in one table: torch's name (also HF's `torch_dtype` and vLLM's `dtype`) and the
bytes per element. Imports nothing: the config, the planner and the converter read it without
torch."""

from __future__ import annotations

NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""megarl's name -> torch's."""

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
"""megarl's name -> bytes per element."""

BYTES_BY_NAME = {NAMES[k]: v for k, v in BYTES.items()}
"""torch's name -> bytes per element."""
