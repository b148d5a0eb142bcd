"""The RL loop. One step:

prompts -> generate (vLLM, n samples each) -> score (reward functions, reward model) -> old /
reference / teacher logprobs and values (megatron forward) -> advantages (gathered across DP;
distill: teacher - student per token) -> policy (and critic) update -> weight sync into vLLM ->
metrics (+ held-out evaluation when due, and a few samples) -> checkpoint. With evaluation on,
the policy is evaluated once before the first step (its own metrics record, step 0). With
`algorithm.dynamic_sampling`, generate and score run in rounds until the step holds enough
groups whose rewards differ (`megarl.trainer.dynamic_sampling`).

Around it, `megarl.trainer.faults.RunGuard` turns stop requests (SIGTERM, SIGUSR1, the stop
file, the time limit) into a checkpoint and `RunStopped` at the step boundary, writes the
time-based checkpoints, and watches each step for hangs.
"""

from __future__ import annotations

import copy
import logging
import math
import time

import torch
import torch.distributed as dist

from megarl.algorithms.distill import distill_advantages
from megarl.algorithms.distributed_advantage import gae_advantages, gather_advantages
from megarl.algorithms.kl import apply_kl_penalty, kl_penalty
from megarl.config import RunConfig
from megarl.data.dataset import PromptBatch
from megarl.distributed import device
from megarl.distributed.placement import Job
from megarl.metrics.progress import StepProgress
from megarl.metrics.reduce import LocalMetrics, from_last_stage
from megarl.metrics.sinks import SAMPLES_FILE
from megarl.metrics.throughput import flops_per_token, precision_mfu
from megarl.metrics.timer import StageTimer
from megarl.models.routing import moe_metrics
from megarl.rollout import Samples, SyncStats, logprob_mismatch
from megarl.trainer import dynamic_sampling, recipe
from megarl.trainer.balance import balance_over_dp
from megarl.trainer.evaluate import evaluate
from megarl.trainer.experience import (
    Scored,
    StepBatch,
    build_batch,
    final_token_rewards,
    forward_logprobs,
    forward_teacher,
    forward_values,
)
from megarl.trainer.faults import RunGuard
from megarl.trainer.finish import finish, stop_if_diverged
from megarl.trainer.judge import trace_judge
from megarl.trainer.run import Run
from megarl.trainer.samples import step_samples
from megarl.trainer.seeds import round_seed, step_seed
from megarl.trainer.stages import RLStage
from megarl.trainer.teacher import teacher_metrics
from megarl.trainer.update import (
    local_positions,
    recompute_old_logprobs,
    train_policy,
    train_value,
)

log = logging.getLogger("megarl")


def train(cfg: RunConfig, out_dir: str, job: Job | None = None) -> Run:
    guard = RunGuard.start(cfg.trainer, out_dir)  # stop requests, timed saves, hang watchdog
    with recipe.build_run(cfg, out_dir, RLStage(cfg.algorithm), job) as run:
        timer = StageTimer()
        if run.step == 0 and (baseline := evaluate(run)):  # the policy before any update
            run.logger.log(0, baseline)
        bar = StepProgress(
            cfg.trainer.steps, rank=dist.get_rank(), initial=run.step, progress=cfg.logging.progress
        )
        while run.step < cfg.trainer.steps:
            guard.begin_step(run, timer)
            t0 = time.perf_counter()
            rollout, scored = sample(run, timer)  # generate, score (dynamic sampling: rounds)
            if cfg.algorithm.balance_dp_tokens and run.groups.dp_size > 1:
                with timer("balance"):
                    rollout, scored = balance(run, rollout, scored)
            batch = build_batch(
                rollout.prompt_ids,
                rollout.response_ids,
                rollout.response_logprobs,
                pad_id=run.pad_id,
                pad_to=run.pad_to,
                routed_experts=rollout.routed_experts,  # MoE routing replay; None otherwise
                response_mask=rollout.response_mask,  # multi-turn: the environment's tokens
            )
            with timer("logprobs"):
                forward_passes(run, batch)
            with timer("advantage"):
                advantages(run, batch, scored)
            with timer("train"):
                train_metrics = update(run, batch, scored.positions)
            with timer("sync"):
                synced = run.rollout.sync_weights()
            run.step += 1
            times = {**timer.step_times(), **sync_times(synced)}
            metrics = collect_metrics(
                run, rollout, batch, scored, train_metrics, times, time.perf_counter() - t0
            )
            timer.reset()
            metrics.update(evaluate(run))  # every eval.every steps and after the last
            samples = step_samples(run, rollout, scored, batch)
            run.logger.log_samples(run.step, samples, file=SAMPLES_FILE)
            run.logger.log(run.step, metrics)
            bar.update(run.step, metrics, samples if cfg.logging.show_samples else ())
            stop_if_diverged(run, metrics)  # before the checkpoint: none from a diverged state
            guard.end_step(run)  # checkpoint when due; RunStopped after it on a stop request
        bar.close()
        finish(run)
    return run


# ---------------------------------------------------------------------- the named steps
def sample(run: Run, timer: StageTimer) -> tuple[Samples, Scored]:
    """This DP rank's scored samples of the step: `generate`, then the engine sleeps (GPU: frees
    its weights and KV cache for the trainer) until the next weight sync wakes it, then `score`.
    With `algorithm.dynamic_sampling`, rounds of generate and score (the engine awake) until the
    step holds `data.prompts_per_step` groups whose rewards differ
    (`megarl.trainer.dynamic_sampling`), then the engine sleeps."""

    def one_round(round_: int, release: bool) -> tuple[Samples, Scored]:
        with timer("rollout"):
            prompts, rollout = generate(run, round_)
            if release:
                run.rollout.release()
        with timer("reward"):
            return rollout, score(run, prompts, rollout)

    if not run.cfg.algorithm.dynamic_sampling:
        return one_round(0, release=True)
    out = dynamic_sampling.sample_step(run, lambda round_: one_round(round_, release=False))
    with timer("rollout"):
        run.rollout.release()
    return out


def generate(run: Run, round_: int = 0) -> tuple[PromptBatch, Samples]:
    """This DP rank's prompts and their samples (each prompt generated once, by the engines of its
    model-parallel group), drawn with round `round_`'s seed. With `rollout.placement.
    max_staleness` k > 0 the rollout also learns the next k steps' requests, which it may start
    generating now."""
    prompts = run.data.dataset.batch(run.data.sampler.next_step())
    request = step_request(run, prompts, run.step, round_)
    rollout = run.rollout.generate(*request, upcoming=upcoming_requests(run))
    return prompts, rollout


def step_request(
    run: Run, prompts: PromptBatch, step: int, round_: int = 0
) -> tuple[PromptBatch, list[int], int]:
    """(this DP rank's prompts, their positions in the step's global batch, the sampling seed of
    the step's round `round_`: 0 without dynamic sampling)."""
    count = len(prompts.prompt_ids)
    positions = [run.groups.dp_rank * count + j for j in range(count)]  # in the global batch
    return prompts, positions, round_seed(run.cfg.trainer.seed, step, round_)


def upcoming_requests(run: Run) -> list[tuple[PromptBatch, list[int], int]]:
    """The requests of the next `rollout.placement.max_staleness` steps (none past the last), drawn
    from a copy of the prompt sampler: the run's own advances one step per trained step, so a
    checkpoint holds the trained position and a resumed run asks for the same prompts."""
    if run.cfg.rollout.placement.max_staleness == 0:
        return []
    ahead = copy.deepcopy(run.data.sampler)
    last = min(run.step + run.cfg.rollout.placement.max_staleness, run.cfg.trainer.steps - 1)
    return [
        step_request(run, run.data.dataset.batch(ahead.next_step()), step)
        for step in range(run.step + 1, last + 1)
    ]


def score(run: Run, prompts, rollout) -> Scored:
    """This rank's samples scored: rewards [B], the weighted reward functions (TRL protocol;
    dataset columns passed through) plus the weighted reward model's score (`reward.model`),
    less `reward.truncated_penalty` for responses cut without EOS; each function's mean over the
    samples it applies to (None = not applicable) as metrics, the reward model's as `reward/rm`;
    each function's value per sample ({name: [B]}, NaN where it does not apply, the reward
    model's raw score as "rm", the judge's as "judge": `samples.jsonl`; the judge's prompts and
    answers: `trace_judge`); and each sample's global prompt id."""
    scores = run.scorer.score(prompts, rollout, rollout.completions(run.tokenizer))
    if scores.verdicts is not None:
        trace_judge(run, prompts, rollout, scores.verdicts)
    group_ids = torch.tensor([prompts.indices[i] for i in rollout.prompt_index])
    return Scored(
        rewards=scores.total,
        per_function=scores.per_function,
        metrics=scores.metrics,
        group_ids=group_ids,
    )


def forward_passes(run: Run, batch: StepBatch) -> None:
    """Old-policy (when the update needs them first: `recompute_old_logprobs`), reference and
    teacher logprobs, and critic values, into `batch`'s fields (last PP stage; None
    elsewhere)."""
    g, m = run.groups, run.models
    split = dict(micro=run.micro_batching, groups=g)
    kw = dict(
        split, vocab_size=run.arch.vocab_size, temperature=run.cfg.rollout.sampling.temperature
    )
    # without the pass, the update's own forward provides the old logprobs (one epoch, one mb)
    if recompute_old_logprobs(run.cfg.algorithm) or not _trains_policy(run):
        batch.old_logprobs = forward_logprobs(m.actor.chunks, batch.fields(), **kw)
    with m.reference_policy() as reference:
        if reference is not None:
            batch.ref_logprobs = forward_logprobs(reference, batch.fields(), **kw)
    if m.teacher is not None:
        batch.teacher_logprobs, batch.teacher_top1 = forward_teacher(
            m.teacher, batch.fields(), **{**kw, "vocab_size": m.archs["teacher"].vocab_size}
        )
    if m.critic is not None:
        batch.old_values = forward_values(m.critic.chunks, batch.fields(), **split)


def balance(run: Run, rollout, scored: Scored):
    """Equal tokens per DP rank (`megarl.trainer.balance`), each sample's reward, per-function
    values and prompt id travelling with it; logs the imbalance before/after (into the scored
    metrics). Returns (rollout, scored) of this rank's new samples."""
    rewards, parts = scored.rewards, scored.per_function
    stacked = torch.stack([rewards, *(v.to(rewards.dtype) for v in parts.values())], 1)
    positions = scored.positions
    if positions is None:
        positions = local_positions(len(rewards), run.groups)
    rollout, stacked, group_ids, positions, m = balance_over_dp(
        rollout,
        stacked,
        scored.group_ids,
        positions,
        run.groups.dp,
        strata=run.cfg.algorithm.mini_batches,
    )
    for k, v in m.items():
        scored.metrics.add_same(k, v)
    parts = {k: stacked[:, j + 1] for j, k in enumerate(parts)}
    return rollout, Scored(
        rewards=stacked[:, 0],
        per_function=parts,
        metrics=scored.metrics,
        group_ids=group_ids,
        positions=positions,
    )


def advantages(run: Run, batch: StepBatch, scored: Scored) -> None:
    """`batch.advantages` [B, S]. GRPO family: group-relative, gathered across DP by global
    prompt id (`scored.group_ids`). PPO: GAE with the critic, and `batch.returns`. Distill: the
    teacher's logprob less the student's per sampled token (`megarl.algorithms.distill`), which
    `algorithm.distill_coef` > 0 adds, weighted, to either of the others."""
    alg, g = run.cfg.algorithm, run.groups
    if alg.name == "distill":
        if g.is_last_stage:
            batch.advantages = _distill_term(run, batch)
        return
    if alg.name == "ppo":
        _gae(run, batch, scored)
    else:
        adv = gather_advantages(
            scored.rewards,
            scored.group_ids,
            estimator=alg.advantage,
            num_generations=run.cfg.rollout.sampling.n,
            scale=alg.scale,
            group=g.dp,
        )
        batch.advantages = adv[:, None] * batch.loss_mask
    if alg.distill_coef and g.is_last_stage:
        batch.advantages = batch.advantages + alg.distill_coef * _distill_term(run, batch)


def _distill_term(run: Run, batch: StepBatch) -> torch.Tensor:
    """[B, S]: clip(teacher - student logprob) on sampled tokens (last PP stage)."""
    return distill_advantages(
        batch.teacher_logprobs,
        batch.old_logprobs,
        batch.loss_mask,
        clip=run.cfg.algorithm.distill_clip,
    )


def _gae(run: Run, batch: StepBatch, scored: Scored) -> None:
    """PPO: `batch.advantages` and `batch.returns` from GAE over the critic's values, the
    reward on each sequence's last token (less the KL penalty with `algorithm.kl_in: reward`)."""
    alg, g, mask = run.cfg.algorithm, run.groups, batch.loss_mask
    if g.is_last_stage:
        token_rewards = final_token_rewards(scored.rewards, mask)
        kl = alg.kl_options
        if kl.in_reward:
            token_rewards, _ = apply_kl_penalty(
                token_rewards,
                batch.old_logprobs,
                batch.ref_logprobs,
                mask,
                coef=kl.coef,
                kind=kl.kind,
            )
        batch.advantages, batch.returns = gae_advantages(
            token_rewards, batch.old_values, mask, alg.gae_options, group=g.dp
        )


def update(run: Run, batch: StepBatch, positions: torch.Tensor | None = None) -> LocalMetrics:
    """The critic's update (PPO), then the policy's, on mini-batches drawn over the rows'
    `positions` in the global batch (`Scored.positions`)."""
    alg, g, seed = run.cfg.algorithm, run.groups, step_seed(run.cfg.trainer.seed, run.step)
    actor, critic = run.models.actor, run.models.critic
    metrics = LocalMetrics()
    if critic is not None:
        metrics.update(
            train_value(
                critic.chunks,
                critic.opt,
                critic.sched,
                batch,
                alg=alg,
                groups=g,
                seed=seed,
                pad_to=run.pad_to,
                positions=positions,
            )
        )
    if _trains_policy(run):
        metrics.update(
            train_policy(
                actor.chunks,
                actor.opt,
                actor.sched,
                batch,
                alg=alg,
                sampling=run.cfg.rollout.sampling,
                vocab_size=run.arch.vocab_size,
                groups=g,
                seed=seed,
                pad_to=run.pad_to,
                positions=positions,
            )
        )
    return metrics


def _trains_policy(run: Run) -> bool:
    """PPO trains only the critic for its first `trainer.critic_warmup_steps` steps."""
    return run.models.critic is None or run.step >= run.cfg.trainer.critic_warmup_steps


def collect_metrics(
    run: Run,
    rollout,
    batch: StepBatch,
    scored: Scored,
    train_metrics: LocalMetrics,
    times,
    step_s,
) -> dict:
    """Global metrics (the values one process holding the whole batch would log), delivered
    to global rank 0."""
    g, mask = run.groups, batch.loss_mask
    r = scored.rewards.double()
    local = LocalMetrics()
    local.add_ratio("reward_mean", r.sum(), len(r))
    local.add_ratio("response_len", batch.response_len.sum(), len(r))
    local.add_sum("tokens", batch.seq_len.sum())
    local.update(scored.metrics)
    local.update(run.rollout.metrics(rollout))  # trajectories (turns, tool calls, ...), staleness
    local.update(train_metrics)
    # router load balance, aux loss (MoE only)
    local.update(moe_metrics(run.models.actor.chunks, run.arch))
    if g.is_last_stage:
        old, valid = batch.old_logprobs, mask.bool()
        local.update(logprob_mismatch(old, batch.sampler_logprobs, mask))
        kl = 0.0
        if batch.ref_logprobs is not None:
            kl = kl_penalty(old, batch.ref_logprobs, "k3")[valid].double().sum()
        local.add_ratio("kl", kl, valid.sum())
        if batch.teacher_logprobs is not None:
            local.update(teacher_metrics(batch.teacher_logprobs, old, batch.teacher_top1, mask))
    merged = local.reduce(g.dp)
    merged["reward_std"] = reward_std(r, merged["reward_mean"], g.dp)
    if "rollout/samples_generated" not in merged:  # dynamic sampling counts every round's
        # every prompt generated once: samples generated in the world = prompts x n
        generated = torch.tensor([float(run.rollout.samples_generated())], dtype=torch.float64)
        dist.all_reduce(generated)
        merged["rollout/samples_generated"] = generated.item()
    out = from_last_stage(merged, g.pp, g.pp_size)  # reaches rank 0 through the pipeline group
    out["time_s"] = {**times, "step": step_s}
    tokens = out.pop("tokens")
    out["tokens_per_s"] = tokens / step_s
    out.update(_train_mfu(run, tokens, times.get("train"), batch))
    return out


def sync_times(stats: SyncStats) -> dict:
    """`time_s.sync_detail`, this rank's figures of the weight sync (part of `time_s.sync`, so
    not a stage of its own; `SyncStats.time_detail`)."""
    detail = stats.time_detail()
    return {"sync_detail": detail} if detail else {}


def reward_std(rewards: torch.Tensor, mean: float, group) -> float:
    """The unbiased std (as `torch.std`) of the step's rewards over the DP `group`, from this
    rank's rewards [b] and the global mean (collective over `group`)."""
    moments = LocalMetrics()
    moments.add_ratio("reward_sq", rewards.double().square().sum(), len(rewards))
    moments.add_sum("samples", len(rewards))
    reduced = moments.reduce(group)
    n = reduced["samples"]
    var = (reduced["reward_sq"] - mean * mean) * n / max(n - 1, 1)
    return math.sqrt(max(var, 0.0))


def _train_mfu(run: Run, tokens: float, train_s: float | None, batch: StepBatch) -> dict:
    """Model FLOPs utilisation of the policy-update stage (GPU only: needs a known peak); see
    `megarl.metrics.throughput.precision_mfu`."""
    if not train_s or not device.use_gpu():
        return {}
    prec = run.cfg.precision
    seq = float(batch.seq_len.float().mean())
    fpt = flops_per_token(run.arch, seq_len=int(seq), training=True, causal=True)
    achieved = tokens * run.cfg.algorithm.ppo_epochs * fpt / train_s
    return precision_mfu(
        torch.cuda.get_device_name(),
        prec.torch_dtype,
        prec.fp8 is not None,
        achieved,
        dist.get_world_size(),
    )
