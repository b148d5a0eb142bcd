"""What makes an HF directory complete besides its weights: config, tokenizer, generation config.

Every HF directory megarl writes (`megarl convert mcore-to-hf`, `trainer.export_hf`) goes through
`finish_hf_dir`, so transformers and vLLM load it as it is:
- `config.json`: the model's HF config with `dtype` (and `torch_dtype`, where present) set to the
  dtype of the written tensors and `architectures` filled in; a critic (scalar value head) is
  written as `<Family>ForSequenceClassification` with `num_labels: 1` and its head as
  `score.weight`, the layout of TRL's value and reward models (transformers computes the value
  of every position with `model.score(model.model(ids).last_hidden_state)`); a reward model's
  config, already a classifier's, keeps its `pad_token_id`, which decides where transformers
  reads the score;
- the tokenizer files, chat template included, copied from the tokenizer directory kept with the
  checkpoint (`megarl.checkpoint.files.TOKENIZER_FILES`);
- `generation_config.json`: copied with the tokenizer when the source had one, otherwise built
  from the config's (or else the tokenizer's) bos / eos / pad token ids.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterable, Iterator

import torch

from megarl import dtypes
from megarl.checkpoint.files import copy_tokenizer_files
from megarl.convert.mapping import canonical_to_hf
from megarl.models.hf_config import ARCHITECTURES, ModelArch

log = logging.getLogger(__name__)
_CLASSES = {family: cls for cls, family in ARCHITECTURES.items()}
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def export_config(hf_config: dict, family: str, dtype: str, *, value_head: bool = False) -> dict:
    """The config.json of an export: tensors in `dtype` (fp32 / bf16 / fp16)."""
    cfg = dict(hf_config)
    cfg["dtype"] = dtypes.NAMES[dtype]
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = dtypes.NAMES[dtype]
    causal = (cfg.get("architectures") or [_CLASSES[family]])[0]
    cfg["architectures"] = [causal]
    if value_head:
        cfg["architectures"] = [causal.replace("ForCausalLM", "ForSequenceClassification")]
        cfg.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
        cfg["tie_word_embeddings"] = False  # no LM head to tie
    return cfg


def critic_tensors(
    arch: ModelArch, canonical: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors of a model with a scalar head (a critic, a reward model): the trunk as for the
    policy, the head [1, hidden] as `score.weight` (the mapping's score rule)."""
    classifier = dataclasses.replace(arch, score_head=True, tie_word_embeddings=False)
    return canonical_to_hf(classifier, canonical)


def finish_hf_dir(directory: str, config: dict, tokenizer_dir: str | None) -> list[str]:
    """Write `config` as config.json, copy the tokenizer files and make sure a
    generation_config.json exists (see the module docstring); returns the files added."""
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    added = ["config.json"]
    if tokenizer_dir is not None:
        added += copy_tokenizer_files(tokenizer_dir, directory)
    else:
        log.warning(
            "%s: no tokenizer was kept with this checkpoint; the HF directory has weights and "
            "config only (copy a tokenizer into it before using it with transformers or vLLM)",
            directory,
        )
    gen = os.path.join(directory, "generation_config.json")
    if not os.path.exists(gen):
        ids = {k: config[k] for k in _TOKEN_IDS if config.get(k) is not None}
        if tokenizer_dir is not None and len(ids) < len(_TOKEN_IDS):
            ids = {**_tokenizer_ids(tokenizer_dir), **ids}
        with open(gen, "w") as f:
            json.dump(ids, f, indent=2, sort_keys=True)
        added.append("generation_config.json")
    return added


def _tokenizer_ids(tokenizer_dir: str) -> dict:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    except (OSError, ValueError) as e:
        log.warning("%s: tokenizer not readable for the generation config (%s)", tokenizer_dir, e)
        return {}
    ids = {k: getattr(tok, k, None) for k in _TOKEN_IDS}
    if ids["pad_token_id"] is None:
        ids["pad_token_id"] = ids["eos_token_id"]
    return {k: v for k, v in ids.items() if v is not None}
