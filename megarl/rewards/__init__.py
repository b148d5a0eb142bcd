"""Reward functions: the TRL protocol, weighted combination, built-ins (math, format, length).

from megarl.rewards import load_reward_function, score
fns = [load_reward_function("math_verify"), load_reward_function("format")]
total, per_fn, errors = score(fns, [1.0, 0.1], prompts, completions, ids, {"answer": answers})
"""

from megarl.rewards.builtins import (
    BUILTINS,
    format_reward,
    length_penalty,
    math_verify_reward,
)
from megarl.rewards.scoring import (
    RewardFunction,
    RewardFunctionError,
    function_name,
    load_reward_function,
    score,
)

__all__ = [
    "BUILTINS",
    "RewardFunction",
    "RewardFunctionError",
    "format_reward",
    "function_name",
    "length_penalty",
    "load_reward_function",
    "math_verify_reward",
    "score",
]
