"""vLLM's layerwise reload warns "<Layer>: Failed to load weights" for a layer that got no
weight; megarl drops it for the rotary cache and for layers tied to an earlier one (a tied LM
head, whose values arrive through the embedding it shares), and only for those."""

from __future__ import annotations

import logging

import torch

from megarl.rollout.engine.vllm_patches import DropBenignReloadWarnings, tied_modules


class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(8, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.lm_head = torch.nn.Linear(4, 8, bias=False)
        self.lm_head.weight = self.embed_tokens.weight


def _record(message: str) -> logging.LogRecord:
    return logging.LogRecord("vllm", logging.WARNING, __file__, 1, message, None, None)


def test_only_the_tied_layer_and_the_rotary_cache_are_quiet():
    tied = tied_modules(_Tied())
    assert [(name, type(m).__name__) for name, m in tied] == [("lm_head", "Linear")]
    f = DropBenignReloadWarnings()
    f.tied = frozenset(type(m).__name__ for _, m in tied)
    assert not f.filter(_record("Linear: Failed to load weights"))
    assert not f.filter(_record("RotaryEmbedding: Failed to load weights"))
    assert f.filter(_record("Embedding: Failed to load weights"))
    assert f.filter(_record("Linear: something else"))
    f.tied = frozenset()  # outside a reload of a tied model: reported
    assert f.filter(_record("Linear: Failed to load weights"))
