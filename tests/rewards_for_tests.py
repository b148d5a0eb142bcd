"""Reward functions used by the end-to-end tests (loaded by dotted path)."""


def inf_reward(prompts, completions, **kwargs):
    """Every sample scores +inf: advantages and the loss become NaN (the divergence test)."""
    return [float("inf")] * len(completions)


_calls = {"n": 0}


def sleep_on_rank1_at_step2(prompts, completions, **kwargs):
    """Scores 0; on global rank 1 its second call (step 2) sleeps for an hour: a rank stuck
    inside a step, so the other rank waits in the next collective (the hang watchdog test)."""
    import time

    import torch.distributed as dist

    _calls["n"] += 1
    if dist.get_rank() == 1 and _calls["n"] == 2:
        time.sleep(3600)
    return [0.0] * len(completions)
