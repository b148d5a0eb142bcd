"""Prompt data: sources, tokenizers, the DP-sharded resumable sampler, collation and sequence
packing, the toy task.

Usage:

    tokenizer = load_tokenizer(model_dir)  # or toy_tokenizer()
    dataset = PromptDataset.from_config(cfg, tokenizer)  # cfg: DataConfig
    sampler = PromptSampler(len(dataset), prompts_per_step=cfg.prompts_per_step,
                            dp_rank=r, dp_size=d, seed=cfg.seed, shuffle=cfg.shuffle)
    prompts = dataset.batch(sampler.next_step())  # this rank's share
    group_ids = sampler.last_global_indices  # the step's prompts, all ranks, global order
    batch = collate(prompt_ids, response_ids, tokenizer.pad_token_id)
    for micro in split_micro_batches(batch, MicroBatching(size=8, pack=True)): ...
"""

from megarl.data.batch import MicroBatching, collate, split_micro_batches
from megarl.data.dataset import DataConfig, DataError, PromptBatch, PromptDataset, load_rows
from megarl.data.sampler import PromptSampler
from megarl.data.tokenizer import TokenizerError, build_char_tokenizer, load_tokenizer
from megarl.data.toy import TOY_CHARS, toy_reward, toy_rows, toy_tokenizer

__all__ = [
    "TOY_CHARS",
    "DataConfig",
    "DataError",
    "MicroBatching",
    "PromptBatch",
    "PromptDataset",
    "PromptSampler",
    "TokenizerError",
    "build_char_tokenizer",
    "collate",
    "load_rows",
    "load_tokenizer",
    "split_micro_batches",
    "toy_reward",
    "toy_rows",
    "toy_tokenizer",
]
