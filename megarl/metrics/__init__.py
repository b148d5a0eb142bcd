"""Step metrics: stage timers, FLOPs/MFU, the jsonl/wandb/tensorboard sinks, progress, plots.

Usage:

    timer = StageTimer()
    logger = MetricsLogger(run_dir, rank=rank, wandb_cfg={"project": "megarl"})
    progress = StepProgress(total_steps, rank=rank)
    with timer("rollout"): ...
    metrics = {"reward_mean": r, "kl": kl, "time_s": timer.step_times()}
    logger.log(step, metrics); progress.update(step, metrics); timer.reset()
    plot_rewards(run_dir / "metrics.jsonl", run_dir / "reward.png")
"""

from megarl.metrics.plots import LivePlots, plot_rewards, plot_run, read_metrics
from megarl.metrics.progress import StepProgress, format_step_line
from megarl.metrics.sinks import MetricsLogger, flatten, json_safe
from megarl.metrics.throughput import flops_per_token, mfu, peak_flops
from megarl.metrics.timer import StageTimer

__all__ = [
    "LivePlots",
    "MetricsLogger",
    "StageTimer",
    "StepProgress",
    "flatten",
    "flops_per_token",
    "format_step_line",
    "json_safe",
    "mfu",
    "peak_flops",
    "plot_rewards",
    "plot_run",
    "read_metrics",
]
