"""Seeds derived from `trainer.seed`, named once: each stream of random draws gets its own.

A step's sampling seed (vLLM, per prompt position) and its mini-batch shuffle share
`step_seed`; evaluation samples from `eval_seed`, apart from every training step's. Dynamic
sampling's further rounds of a step draw from `round_seed` (round 0 is the step's own seed).
"""

STEP_STRIDE = 1_000_003
"""A prime stride between runs' seeds: runs with seeds s and s + 1 draw apart for 10^6 steps."""
EVAL_OFFSET = 1 << 40
"""Evaluation's seeds start here (+ trainer.seed), beyond any step's."""
ROUND_OFFSET = 1 << 44
"""Dynamic sampling's further rounds draw seeds from here on, beyond any step's and eval's."""
ROUND_STRIDE = 1024
"""Seeds per step for its rounds (`algorithm.dynamic_sampling_max_rounds` is at most this)."""


def step_seed(seed: int, step: int) -> int:
    """The seed of training step `step` (0-based) of a run with `trainer.seed` = `seed`."""
    return seed * STEP_STRIDE + step


def round_seed(seed: int, step: int, round_: int) -> int:
    """The sampling seed of round `round_` (0-based) of step `step` with dynamic sampling:
    round 0 is the step's own seed (`step_seed`), so the first round generates what a step
    without dynamic sampling would; later rounds get seeds of their own."""
    if round_ == 0:
        return step_seed(seed, step)
    return ROUND_OFFSET + step_seed(seed, step) * ROUND_STRIDE + round_


def eval_seed(seed: int) -> int:
    """The base seed of every held-out evaluation of a run with `trainer.seed` = `seed`."""
    return EVAL_OFFSET + seed


def score_head_seed(seed: int) -> int:
    """The seed of a new reward-model score head drawn from `model.init_seed` = `seed`."""
    return seed * STEP_STRIDE + 17
