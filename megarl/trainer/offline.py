"""The offline loop (SFT, DPO, reward models): training on a fixed dataset, no rollout engine (no
vLLM), no rewards. One step:

rows (resumable, DP-sharded order) -> reference logprobs (DPO, forward-only, once per batch)
-> loss and gradients through megatron's schedule (a preference pair's two sequences share a
micro-batch) -> optimizer step -> metrics -> held-out evaluation -> checkpoint

The run is built from the same parts as an RL run (`megarl.trainer.run`: topology, models by
role, data, logging) and saves the same checkpoints (the trained role under its prefix,
`actor.` or `reward.`, the same trainer_state.json keys), so a later run resumes it or starts
from it. What differs per stage
(data reader, reference, loss) lives in `megarl.trainer.stages`. Held-out evaluation (the
`eval` section: `eval.path` or `eval.fraction` of the rows) runs the stage's loss forward-only
over every held-out row and logs its metrics as `eval/...`, at step 0, every `eval.every`
steps and after the last step.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time

import torch
import torch.distributed as dist

from megarl.config import ConfigError, RunConfig
from megarl.data.batch import split_micro_batches
from megarl.distributed import device
from megarl.distributed.process_group import init_distributed
from megarl.metrics.progress import StepProgress
from megarl.metrics.reduce import LocalMetrics
from megarl.metrics.sinks import set_aside_previous_run
from megarl.metrics.timer import StageTimer
from megarl.models import forward
from megarl.models.optim import zero_grads
from megarl.trainer.faults import RunGuard
from megarl.trainer.loop import finish, stop_if_diverged
from megarl.trainer.model_source import resolve_model
from megarl.trainer.models import build_models, build_trained_reward
from megarl.trainer.run import (
    Data,
    Run,
    _check_model_files,
    _resume_state,
    build_logger,
    build_topology,
    check_paths,
    check_policy_arch,
    load_arch,
    load_tokenizer,
    write_config,
)
from megarl.trainer.stages import get_stage
from megarl.trainer.update import optimizer_step, step_metrics

log = logging.getLogger("megarl")


def train(cfg: RunConfig, out_dir: str) -> Run:
    stage = get_stage(cfg.algorithm)
    guard = RunGuard.start(cfg.trainer, out_dir)  # stop requests, timed saves, hang watchdog
    run = create(cfg, out_dir, stage)
    cfg = run.cfg  # trainer.steps resolved from trainer.epochs
    guard.trainer = cfg.trainer  # the same rules, with the resolved number of steps
    timer = StageTimer()
    bar = StepProgress(
        cfg.trainer.steps, rank=dist.get_rank(), initial=run.step, progress=cfg.logging.progress
    )
    if run.step == 0 and run.data.held_out is not None:
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
    finish(run, offline=True, role=stage.trains)
    return run


# ---------------------------------------------------------------------- construction
def create(cfg: RunConfig, out_dir: str, stage) -> Run:
    """The offline run: every check a user's input can fail (config, layout, every data row),
    then the models (the reference only when the stage needs it) and logging; no engine."""
    _, world = init_distributed()
    check_paths(cfg)
    user_model = cfg.model  # config.yaml keeps what the user wrote (e.g. the GGUF file)
    # GGUF -> cached HF dir (rank 0), run dir -> its checkpoint (the stage's role in it)
    cfg = resolve_model(cfg, stage.sources)
    if cfg.eval.path is not None and not cfg.eval.path.startswith("hf:"):
        if not os.path.exists(cfg.eval.path):
            raise ConfigError(f"eval.path={cfg.eval.path!r} does not exist")
    source_arch = load_arch(cfg, stage.sources)  # what model.* holds
    topo, groups = build_topology(cfg, source_arch, world, out_dir)
    tokenizer = load_tokenizer(cfg, out_dir)
    arch = stage.model_arch(source_arch, tokenizer)  # what the stage trains (a reward model)
    if stage.trains == "actor":
        check_policy_arch(cfg, arch)
    # everything a user can get wrong is checked before the models exist
    data = build_data(cfg, stage, tokenizer, groups, arch.max_position_embeddings)
    cfg = _resolve_steps(cfg, len(data.dataset))
    _check_model_files(cfg, source_arch)
    resume = _resume_state(cfg, out_dir, arch, data.sampler, {stage.trains: arch})
    if resume is None and dist.get_rank() == 0:  # step 0: an earlier attempt's logs go aside
        set_aside_previous_run(out_dir)
    write_config(dataclasses.replace(cfg, model=user_model), out_dir)
    gpu, updates = device.use_gpu(), cfg.trainer.steps
    if stage.trains == "reward":
        models = build_trained_reward(cfg, arch, source_arch, gpu=gpu, updates=updates)
    else:
        models = build_models(
            cfg, arch, gpu=gpu, updates=updates, reference=cfg.algorithm.needs_reference
        )
    run = Run(
        cfg=cfg,
        out_dir=out_dir,
        topo=topo,
        groups=groups,
        arch=arch,
        tokenizer=tokenizer,
        models=models,
        data=data,
        logger=build_logger(cfg, out_dir),
        resume=resume,
    )
    run.maybe_resume()
    return run


def build_data(cfg: RunConfig, stage, tokenizer, groups, max_positions: int) -> Data:
    """The stage's training rows (and held-out rows per the `eval` section), read, tokenized and
    checked in full; the sampler over the training rows."""
    from megarl.data.dataset import load_rows
    from megarl.data.offline import split_held_out
    from megarl.data.sampler import PromptSampler

    d, e = cfg.data, cfg.eval
    limit = d.max_length or max_positions
    if limit > max_positions:
        raise ConfigError(
            f"data.max_length={d.max_length} exceeds the model's max_position_embeddings "
            f"({max_positions}); accepted: at most {max_positions}, or null"
        )
    rows, source = (
        (stage.toy_rows(), "<toy copy task>")
        if d.path is None
        else (
            load_rows(d.path),
            d.path,
        )
    )

    def read(rows: list[dict], source: str):
        ds = stage.read(rows, tokenizer, d, max_length=limit, source=source)
        if (ds.num_dropped or ds.num_truncated) and dist.get_rank() == 0:
            log.warning(
                "%s: %d rows over data.max_length=%d dropped, %d truncated on the left",
                source,
                ds.num_dropped,
                limit,
                ds.num_truncated,
            )
        return ds

    held_out = read(load_rows(e.path), e.path) if e.path is not None else None
    dataset = read(rows, source)
    if e.path is None and e.fraction > 0:
        train_idx, held_idx = split_held_out(list(range(len(dataset))), e.fraction, e.seed)
        dataset, held_out = dataset.subset(train_idx), dataset.subset(held_idx)
    if held_out is not None:
        if e.max_prompts is not None:
            held_out = held_out.subset(list(range(min(e.max_prompts, len(held_out)))))
        if len(held_out) < groups.dp_size:
            raise ConfigError(
                f"the held-out set has {len(held_out)} rows, fewer than the {groups.dp_size} "
                "data-parallel ranks that evaluate it; raise eval.fraction or eval.max_prompts"
            )
    sampler = PromptSampler(
        len(dataset),
        prompts_per_step=d.prompts_per_step,
        dp_rank=groups.dp_rank,
        dp_size=groups.dp_size,
        seed=d.seed,
        shuffle=d.shuffle,
    )
    return Data(dataset, sampler, held_out)


def _resolve_steps(cfg: RunConfig, rows: int) -> RunConfig:
    """trainer.steps from trainer.epochs (when set) over `rows` training rows."""
    t = cfg.trainer
    if t.epochs is None:
        return cfg
    steps = max(1, math.ceil(t.epochs * rows / cfg.data.prompts_per_step))
    log.info("trainer.epochs=%g over %d rows: %d steps", t.epochs, rows, steps)
    return dataclasses.replace(cfg, trainer=dataclasses.replace(t, steps=steps))


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
    model, g = getattr(run.models, stage.trains), run.groups
    denominator = stage.denominator(run.data.dataset, batch["global_indices"])
    zero_grads(model.chunks, model.opt)
    micro = _micro_batches(run, stage, batch)
    out = forward.run(
        model.chunks, micro, stage.loss_fn(run, denominator), forward_only=False, dp_size=g.dp_size
    )
    loss = sum(float(m["loss"]) for m in out) if out else 0.0
    ok, grad_norm, overflow = optimizer_step(model.opt, model.sched, math.isfinite(loss), g)
    metrics = step_metrics(out, 1)
    metrics.add_same("grad_norm", grad_norm)
    metrics.add_same("skipped_steps", 0 if ok or overflow else 1)
    if overflow:
        metrics.add_same("overflow_steps", 1)
    metrics.add_same("lr", model.opt.param_groups[0]["lr"])
    return metrics


def _micro_batches(run: Run, stage, batch: dict) -> list[dict]:
    alg = run.cfg.algorithm
    fields = {k: v for k, v in batch.items() if k != "global_indices"}
    return split_micro_batches(
        fields,
        alg.micro_batch_size,
        pad_to_multiple=run.pad_to,
        max_tokens=alg.max_tokens_per_micro_batch,
        together=batch[stage.together_key] if stage.together_key else None,
    )


def collect_metrics(run: Run, stage, batch: dict, train_metrics: LocalMetrics) -> dict:
    """Global metrics of the step (what one process holding the whole step would log), on
    global rank 0."""
    local = LocalMetrics()
    local.update(train_metrics)
    local.add_sum("tokens", batch["seq_len"].sum())
    local.add_ratio("response_len", batch["response_len"].sum(), len(batch["response_len"]))
    return stage.finalize(_to_rank0(local.reduce(run.groups.dp), run))


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
            out = forward.run(
                getattr(run.models, stage.trains).chunks,
                _micro_batches(run, stage, batch),
                stage.loss_fn(run, denominator),
                forward_only=True,
                dp_size=g.dp_size,
            )
        local.update(step_metrics(out, 1))
    metrics = stage.finalize(_to_rank0(local.reduce(g.dp), run))
    return {f"eval/{k}": v for k, v in metrics.items()}


def _eval_due(run: Run) -> bool:
    every = run.cfg.eval.every
    if run.data.held_out is None:
        return False
    return run.step == run.cfg.trainer.steps or bool(every and run.step % every == 0)


def _to_rank0(merged: dict, run: Run) -> dict:
    """The last pipeline stage's metrics (the only one computing losses) on every PP rank."""
    from megatron.core import parallel_state as ps

    box = [merged]
    pp = ps.get_pipeline_model_parallel_group()
    dist.broadcast_object_list(box, src=dist.get_global_rank(pp, run.groups.pp_size - 1), group=pp)
    return box[0]
