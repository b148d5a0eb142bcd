"""Colocated rollout: a vLLM engine per trainer rank and the Megatron -> vLLM weight sync.

- `config`: `RolloutConfig` (the `rollout:` settings) and `RolloutConfigError`; `checks`: what is
  checked before an engine starts (KV cache, free GPU memory, vLLM installed); `stop_tokens`:
  the EOS ids a sample stops at.
- `engine`: `Rollout`, `RolloutEngine` (generation from token ids, sleep / wake, weight loads);
  `vllm_patches`: every patch of vLLM and reach into its internals.
- `weight_sync`: `WeightSync` (plan once, bulk collectives each step), `naive_sync` (reference).
- `plan`, `vllm_layout`, `moe_layout`: the resharding plan and vLLM's parameter layouts (fused
  MoE experts included); `pieces`: the records they share (`Piece`, `PlanError`, ...).
- `routes`: the experts vLLM routed each token to, for MoE routing replay.
- `mismatch`: `logprob_mismatch`, the trainer-vs-sampler metric.

Imports are lazy so that `import megarl.rollout` does not pull in vLLM.
"""

from __future__ import annotations

_EXPORTS = {
    "RolloutConfig": "megarl.rollout.config",
    "Rollout": "megarl.rollout.engine",
    "RolloutEngine": "megarl.rollout.engine",
    "WeightSync": "megarl.rollout.weight_sync",
    "naive_sync": "megarl.rollout.weight_sync",
    "SyncError": "megarl.rollout.weight_sync",
    "PlanError": "megarl.rollout.pieces",
    "logprob_mismatch": "megarl.rollout.mismatch",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'megarl.rollout' has no attribute {name!r}")
