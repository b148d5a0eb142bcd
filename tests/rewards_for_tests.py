"""Reward functions used by the end-to-end tests (loaded by dotted path)."""


def inf_reward(prompts, completions, **kwargs):
    """Every sample scores +inf: advantages and the loss become NaN (the divergence test)."""
    return [float("inf")] * len(completions)
