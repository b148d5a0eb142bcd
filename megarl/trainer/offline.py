"""The offline loop (SFT, DPO, reward models): training on a fixed dataset, no rollout engine (no
vLLM), no rewards. One step:

rows (resumable, DP-sharded order) -> reference logprobs (DPO, forward-only, once per batch)
-> loss and gradients through megatron's schedule (a preference pair's two sequences share a
micro-batch) -> optimizer step -> metrics -> held-out evaluation -> checkpoint

The run is built by the same recipe as an RL run (`megarl.trainer.recipe`: topology, models by
role, data, logging) and saves the same checkpoints (the trained role under its prefix,
`actor.` or `reward.`, the same trainer_state.json keys), so a later run resumes it or starts
from it. What differs per stage
(data reader, reference, loss) lives in `megarl.trainer.stages`. Held-out evaluation (the
`eval` section: `eval.path` or `eval.fraction` of the rows) runs the stage's loss forward-only
over every held-out row and logs its metrics as `eval/...`, at step 0, every `eval.every`
steps and after the last step.
"""

from __future__ import annotations

import logging
import math
import time

import torch
import torch.distributed as dist

from megarl.config import RunConfig
from megarl.data.batch import pad_share, split_micro_batches
from megarl.distributed.placement import Job
from megarl.metrics.progress import StepProgress
from megarl.metrics.reduce import LocalMetrics, from_last_stage
from megarl.metrics.timer import StageTimer
from megarl.models import forward
from megarl.models.optim import zero_grads
from megarl.trainer import recipe
from megarl.trainer.evaluate import evaluation_due
from megarl.trainer.faults import RunGuard
from megarl.trainer.finish import finish, stop_if_diverged
from megarl.trainer.run import Run
from megarl.trainer.stages import get_stage
from megarl.trainer.update import optimizer_step, step_metrics

log = logging.getLogger("megarl")


def train(cfg: RunConfig, out_dir: str, job: Job | None = None) -> Run:
    stage = get_stage(cfg.algorithm)
    guard = RunGuard.start(cfg.trainer, out_dir)  # stop requests, timed saves, hang watchdog
    with recipe.build_run(cfg, out_dir, stage, job) as run:
        cfg = run.cfg  # trainer.steps resolved from trainer.epochs
        guard.trainer = cfg.trainer  # the same rules, with the resolved number of steps
        timer = StageTimer()
        bar = StepProgress(
            cfg.trainer.steps, rank=dist.get_rank(), initial=run.step, progress=cfg.logging.progress
        )
        if run.step == 0 and _eval_due(run):
            run.logger.log(0, evaluate(run, stage))  # before any update
        while run.step < cfg.trainer.steps:
            guard.begin_step(run, timer)
            t0 = time.perf_counter()
            with timer("data"):
                batch = next_batch(run)
            with timer("reference"):
                stage.prepare(run, batch)
            with timer("train"):
                train_metrics = update(run, stage, batch)
            run.step += 1
            metrics = collect_metrics(run, stage, batch, train_metrics)
            metrics["time_s"] = {**timer.step_times(), "step": time.perf_counter() - t0}
            metrics["tokens_per_s"] = metrics.pop("tokens") / metrics["time_s"]["step"]
            timer.reset()
            if _eval_due(run):
                metrics.update(evaluate(run, stage))
            run.logger.log(run.step, metrics)
            bar.update(run.step, metrics)
            stop_if_diverged(run, metrics)  # before the checkpoint: none from a diverged state
            guard.end_step(run)  # checkpoint when due; RunStopped after it on a stop request
        bar.close()
        finish(run, role=stage.role)
    return run


# ---------------------------------------------------------------------- the named steps
def next_batch(run: Run) -> dict:
    """This DP rank's rows of the next step, collated; `denominator`: the stage's global loss
    denominator over the whole step (all DP ranks)."""
    local = run.data.sampler.next_step()
    batch = run.data.dataset.batch(local, pad_id=run.pad_id, pad_to=run.pad_to)
    batch["global_indices"] = list(run.data.sampler.last_global_indices)
    return batch


def update(run: Run, stage, batch: dict) -> LocalMetrics:
    """One optimizer step on the step's rows (gradient accumulation over micro-batches)."""
    model, g = getattr(run.models, stage.role), run.groups
    denominator = stage.denominator(run.data.dataset, batch["global_indices"])
    zero_grads(model.chunks, model.opt)
    micro = _micro_batches(run, stage, batch)
    out = forward.forward_backward(
        model.chunks, micro, stage.loss_fn(run, denominator), forward_only=False, dp_size=g.dp_size
    )
    loss = sum(float(m["loss"]) for m in out) if out else 0.0
    ok, grad_norm, overflow = optimizer_step(model.opt, model.sched, math.isfinite(loss), g)
    metrics = step_metrics(out, 1)
    real, computed = pad_share(micro)
    metrics.add_ratio("train/pad_share", computed - real, computed)
    metrics.add_same("grad_norm", grad_norm)
    metrics.add_same("skipped_steps", 0 if ok or overflow else 1)
    if overflow:
        metrics.add_same("overflow_steps", 1)
    metrics.add_same("lr", model.opt.param_groups[0]["lr"])
    return metrics


def _micro_batches(run: Run, stage, batch: dict) -> list[dict]:
    fields = {k: v for k, v in batch.items() if k != "global_indices"}
    together = batch[stage.together_key] if stage.together_key else None
    return split_micro_batches(fields, run.micro_batching, together=together)


def collect_metrics(run: Run, stage, batch: dict, train_metrics: LocalMetrics) -> dict:
    """Global metrics of the step (what one process holding the whole step would log), on
    global rank 0."""
    local = LocalMetrics()
    local.update(train_metrics)
    local.add_sum("tokens", batch["seq_len"].sum())
    local.add_ratio("response_len", batch["response_len"].sum(), len(batch["response_len"]))
    return stage.finalize(
        from_last_stage(local.reduce(run.groups.dp), run.groups.pp, run.groups.pp_size)
    )


def evaluate(run: Run, stage) -> dict:
    """The stage's loss and metrics over every held-out row (forward only), as `eval/...`."""
    held, g = run.data.held_out, run.groups
    mine = list(range(g.dp_rank, len(held), g.dp_size))
    denominator = stage.denominator(held, list(range(len(held))))
    per_chunk = max(1, run.cfg.data.prompts_per_step // g.dp_size)
    local = LocalMetrics()
    for start in range(0, len(mine), per_chunk):
        rows = mine[start : start + per_chunk]
        batch = held.batch(rows, pad_id=run.pad_id, pad_to=run.pad_to)
        stage.prepare(run, batch)
        with torch.no_grad():
            out = forward.forward_backward(
                getattr(run.models, stage.role).chunks,
                _micro_batches(run, stage, batch),
                stage.loss_fn(run, denominator),
                forward_only=True,
                dp_size=g.dp_size,
            )
        local.update(step_metrics(out, 1))
    metrics = stage.finalize(from_last_stage(local.reduce(g.dp), g.pp, g.pp_size))
    return {f"eval/{k}": v for k, v in metrics.items()}


def _eval_due(run: Run) -> bool:
    """The run's evaluation rule (`evaluation_due`), for a run with held-out rows."""
    held = run.data.held_out is not None
    return held and evaluation_due(run.step, run.cfg.eval, run.cfg.trainer.steps)
