"""Seeds derived from `trainer.seed`, named once: each stream of random draws gets its own.

A step's sampling seed (vLLM, per prompt position) and its mini-batch shuffle share
`step_seed`; evaluation samples from `eval_seed`, apart from every training step's.
"""

STEP_STRIDE = 1_000_003
"""A prime stride between runs' seeds: runs with seeds s and s + 1 draw apart for 10^6 steps."""
EVAL_OFFSET = 1 << 40
"""Evaluation's seeds start here (+ trainer.seed), beyond any step's."""


def step_seed(seed: int, step: int) -> int:
    """The seed of training step `step` (0-based) of a run with `trainer.seed` = `seed`."""
    return seed * STEP_STRIDE + step


def eval_seed(seed: int) -> int:
    """The base seed of every held-out evaluation of a run with `trainer.seed` = `seed`."""
    return EVAL_OFFSET + seed


def score_head_seed(seed: int) -> int:
    """The seed of a new reward-model score head drawn from `model.init_seed` = `seed`."""
    return seed * STEP_STRIDE + 17
