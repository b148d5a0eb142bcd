"""The seeds a run derives from `trainer.seed`, named once.

A training step's sampling and its mini-batch order use `step_seed(seed, step)`; held-out
evaluation samples with `eval_seed(seed)`, far from every step's seed. The values are part of a
run's reproducibility: changing them changes what a seeded run generates.
"""

from __future__ import annotations

EVAL_SEED = 1 << 40
"""Base seed of evaluation sampling (+ trainer.seed), apart from the training steps' seeds."""


def step_seed(seed: int, step: int) -> int:
    """The seed of training step `step` (its rollout's sampling, the update's mini-batch
    order) of a run seeded with `seed`."""
    return seed * 1_000_003 + step


def eval_seed(seed: int) -> int:
    """The seed of held-out evaluation sampling of a run seeded with `seed`."""
    return EVAL_SEED + seed
