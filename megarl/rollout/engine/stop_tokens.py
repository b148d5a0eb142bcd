"""Which token ids end a sample: `rollout.sampling.stop_token_ids`, or when it is null the model's
EOS ids.

The engine stops only at the ids it is given (`SamplingConfig.stop_token_ids`, kept as the
sample's last token); the trainer resolves null here, once, before the engine starts. Reads the
tokenizer's `eos_token_id`, the model's config.json and any `generation_config.json` (chat
models often stop at several ids, e.g. Llama-3's <|eot_id|>).
"""

from __future__ import annotations

import json
import os


def resolve_stop_tokens(
    stop_token_ids: tuple[int, ...] | None, tokenizer, hf_config: dict, model_dirs=()
) -> tuple[int, ...]:
    """`rollout.sampling.stop_token_ids`, or when None the EOS ids of the tokenizer, of the model's
    config.json (`eos_token_id`, an int or a list) and of `generation_config.json` in any of
    `model_dirs` (chat models often stop at several ids, e.g. Llama-3's <|eot_id|>)."""
    if stop_token_ids is not None:
        return tuple(stop_token_ids)
    ids: list[int] = []

    def add(value) -> None:
        for v in value if isinstance(value, list | tuple) else [value]:
            if isinstance(v, int) and v >= 0 and v not in ids:
                ids.append(v)

    add(getattr(tokenizer, "eos_token_id", None))
    add(hf_config.get("eos_token_id"))
    for d in model_dirs:
        path = os.path.join(d, "generation_config.json") if d else ""
        if path and os.path.exists(path):
            with open(path) as f:
                add(json.load(f).get("eos_token_id"))
    return tuple(ids)
