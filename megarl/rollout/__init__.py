"""The rollout: prompts in, samples out, the policy's weights in after every update.

Its parts, each a folder (`tests/test_architecture.py` keeps their import rules):
- `engine`: vLLM in this process (start, generate, sleep / wake, its weights' write surface);
- `sync`: Megatron -> engine weight transfer behind one interface (`WeightSender`);
- `multi_turn`: trajectories with an environment, over a small generator protocol, and the
  two schedulers; `agents`: the OpenAI-compatible endpoint and agent trajectories;
- `placement`: where engines run; colocated and separate drive one `RolloutWorker`;
- `judge`: a judge model's engine beside the policy's (`reward.judge`).

This module is the API the trainer uses: `RolloutComponent` (`api`), the `Samples` record,
`RolloutConfig`, `build_rollout` / `resolve` (`build`), the sample metrics and the engine
ranks' lifetime. The light names are imported now; the others (they import torch or vLLM) on
first use, from `_LAZY`.
"""

from __future__ import annotations

import importlib

from megarl.rollout.api import RolloutComponent
from megarl.rollout.config import (
    EngineConfig,
    PlacementConfig,
    RolloutConfig,
    RolloutConfigError,
    SamplingConfig,
    check_rollout_with,
    migrate_keys,
    new_key,
)
from megarl.rollout.samples import Samples, Turns, Versions
from megarl.rollout.sync.stats import SyncError, SyncStats

_LAZY = {
    "build_rollout": "megarl.rollout.build",
    "resolve": "megarl.rollout.build",
    "check_kv_cache": "megarl.rollout.engine.checks",
    "JudgeEngine": "megarl.rollout.judge",
    "load_trajectories": "megarl.rollout.placement.worker",
    "engine_ranks": "megarl.rollout.placement.separate",
    "serve": "megarl.rollout.placement.engine_rank",
    "logprob_mismatch": "megarl.rollout.metrics",
    "trajectory_metrics": "megarl.rollout.metrics",
}
"""Name -> the module it is imported from on first use."""

__all__ = [
    "EngineConfig",
    "JudgeEngine",
    "PlacementConfig",
    "RolloutComponent",
    "RolloutConfig",
    "RolloutConfigError",
    "Samples",
    "SamplingConfig",
    "SyncError",
    "SyncStats",
    "Turns",
    "Versions",
    "build_rollout",
    "check_kv_cache",
    "check_rollout_with",
    "engine_ranks",
    "load_trajectories",
    "logprob_mismatch",
    "migrate_keys",
    "new_key",
    "resolve",
    "serve",
    "trajectory_metrics",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'megarl.rollout' has no attribute {name!r}")
