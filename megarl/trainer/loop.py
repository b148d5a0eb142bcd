"""The RL loop. One step:

prompts -> generate (vLLM, n samples each) -> score (reward functions, reward model) -> old /
reference logprobs and values (megatron forward) -> advantages (gathered across DP) -> policy
(and critic) update -> weight sync into vLLM -> metrics (+ held-out evaluation when due, and a
few samples) -> checkpoint. With evaluation on, the policy is evaluated once before the first step
(its own metrics record, step 0).

Around it, `megarl.trainer.faults.RunGuard` turns stop requests (SIGTERM, SIGUSR1, the stop
file, the time limit) into a checkpoint and `RunStopped` at the step boundary, writes the
time-based checkpoints, and watches each step for hangs.
"""

from __future__ import annotations

import logging
import math
import time

import torch
import torch.distributed as dist

from megarl.algorithms.distributed_advantage import gae_advantages, gather_advantages
from megarl.algorithms.kl import apply_kl_penalty, kl_penalty
from megarl.config import RunConfig
from megarl.distributed import device
from megarl.metrics.progress import StepProgress
from megarl.metrics.reduce import LocalMetrics
from megarl.metrics.sinks import SAMPLES_FILE
from megarl.metrics.throughput import flops_per_token, precision_mfu
from megarl.metrics.timer import StageTimer
from megarl.models.routing import moe_metrics
from megarl.trainer import experience as xp
from megarl.trainer import recipe
from megarl.trainer.evaluate import evaluate
from megarl.trainer.faults import RunGuard
from megarl.trainer.finish import finish, stop_if_diverged
from megarl.trainer.run import Run
from megarl.trainer.samples import step_samples
from megarl.trainer.seeds import step_seed
from megarl.trainer.stages import RLStage
from megarl.trainer.update import recompute_old_logprobs, train_policy, train_value

log = logging.getLogger("megarl")


def train(cfg: RunConfig, out_dir: str) -> Run:
    guard = RunGuard.start(cfg.trainer, out_dir)  # stop requests, timed saves, hang watchdog
    run = recipe.build_run(cfg, out_dir, RLStage(cfg.algorithm))
    timer = StageTimer()
    if run.step == 0 and (baseline := evaluate(run)):  # the policy before any update
        run.logger.log(0, baseline)
    bar = StepProgress(
        cfg.trainer.steps, rank=dist.get_rank(), initial=run.step, progress=cfg.logging.progress
    )
    while run.step < cfg.trainer.steps:
        guard.begin_step(run, timer)
        t0 = time.perf_counter()
        with timer("rollout"):
            prompts, rollout = generate(run)
        with timer("reward"):
            rewards, reward_metrics, reward_parts = score(run, prompts, rollout)
        group_ids = torch.tensor([prompts.indices[i] for i in rollout.prompt_index])
        if cfg.algorithm.balance_dp_tokens and run.groups.dp_size > 1:
            with timer("balance"):
                rollout, rewards, group_ids, reward_parts = balance(
                    run, rollout, rewards, group_ids, reward_parts, reward_metrics
                )
        batch = xp.build_batch(
            rollout.prompt_ids,
            rollout.response_ids,
            rollout.response_logprobs,
            pad_id=run.pad_id,
            pad_to=run.pad_to,
            routed_experts=rollout.routed_experts,  # MoE routing replay; None otherwise
        )
        with timer("logprobs"):
            forward_passes(run, batch)
        with timer("advantage"):
            advantages(run, batch, rewards, group_ids)
        with timer("train"):
            train_metrics = update(run, batch)
        with timer("sync"):
            run.rollout.sync_weights()
        run.step += 1
        metrics = collect_metrics(
            run,
            batch,
            rewards,
            reward_metrics,
            train_metrics,
            timer.step_times(),
            time.perf_counter() - t0,
        )
        timer.reset()
        metrics.update(evaluate(run))  # every eval.every steps and after the last
        samples = step_samples(run, rollout, rewards, reward_parts, group_ids, batch)
        run.logger.log_samples(run.step, samples, file=SAMPLES_FILE)
        run.logger.log(run.step, metrics)
        bar.update(run.step, metrics, samples if cfg.logging.show_samples else ())
        stop_if_diverged(run, metrics)  # before the checkpoint: none from a diverged state
        guard.end_step(run)  # checkpoint when due; RunStopped after it on a stop request
    bar.close()
    finish(run)
    return run


# ---------------------------------------------------------------------- the named steps
def generate(run: Run):
    """This DP rank's prompts and their samples (each prompt generated once, by the engines of
    its model-parallel group: `megarl.rollout.dispatch`); then the engine sleeps (GPU: frees its
    weights and KV cache for the trainer) until the next weight sync wakes it."""
    prompts = run.data.dataset.batch(run.data.sampler.next_step())
    count = len(prompts.prompt_ids)
    positions = [run.groups.dp_rank * count + j for j in range(count)]  # in the global batch
    seed = step_seed(run.cfg.trainer.seed, run.step)
    rollout = run.rollout.dispatcher.generate(prompts.prompt_ids, positions, seed)
    run.rollout.engine.sleep()
    return prompts, rollout


def score(run: Run, prompts, rollout) -> tuple[torch.Tensor, LocalMetrics, dict]:
    """Rewards [B] for this rank's samples: the weighted reward functions (TRL protocol;
    dataset columns passed through) plus the weighted reward model's score (`reward.model`),
    less `reward.truncated_penalty` for responses cut without EOS; each function's mean over the
    samples it applies to (None = not applicable) as metrics, the reward model's as `reward/rm`;
    and each function's value per sample ({name: [B]}, NaN where it does not apply, the reward
    model's raw score as "rm": `samples.jsonl`)."""
    completions = run.tokenizer.batch_decode(rollout.response_ids, skip_special_tokens=True)
    scores = run.scorer.score(prompts, rollout, completions)
    return scores.total, scores.metrics, scores.per_function


def forward_passes(run: Run, batch: dict) -> None:
    """Old-policy (when the update needs them first: `recompute_old_logprobs`) and reference
    logprobs, and critic values, into `batch` (last PP stage)."""
    alg, g, m = run.cfg.algorithm, run.groups, run.models
    split = dict(
        micro_batch_size=alg.micro_batch_size,
        groups=g,
        pad_to=run.pad_to,
        max_tokens=alg.max_tokens_per_micro_batch,
    )
    kw = dict(split, vocab_size=run.arch.vocab_size, temperature=run.cfg.rollout.temperature)
    batch["old_logprobs"] = None  # the update's own forward provides them (one epoch, one mb)
    if recompute_old_logprobs(run.cfg.algorithm) or not _trains_policy(run):
        batch["old_logprobs"] = xp.forward_logprobs(m.actor.chunks, batch, **kw)
    if m.reference is not None:
        batch["ref_logprobs"] = xp.forward_logprobs(m.reference, batch, **kw)
    if m.critic is not None:
        batch["old_values"] = xp.forward_values(m.critic.chunks, batch, **split)


def balance(run: Run, rollout, rewards, group_ids, parts: dict, metrics: LocalMetrics):
    """Equal tokens per DP rank (`megarl.trainer.balance`), each sample's reward and per-function
    values travelling with it; logs the imbalance before/after."""
    from megarl.trainer.balance import balance_over_dp

    stacked = torch.stack([rewards, *(v.to(rewards.dtype) for v in parts.values())], 1)
    rollout, stacked, group_ids, m = balance_over_dp(rollout, stacked, group_ids, run.groups.dp)
    for k, v in m.items():
        metrics.add_same(k, v)
    parts = {k: stacked[:, j + 1] for j, k in enumerate(parts)}
    return rollout, stacked[:, 0], group_ids, parts


def advantages(run: Run, batch: dict, rewards: torch.Tensor, group_ids: torch.Tensor) -> None:
    """GRPO family: group-relative, gathered across DP by global prompt id (`group_ids` [b]).
    PPO: GAE with the critic."""
    alg, g = run.cfg.algorithm, run.groups
    mask = batch["loss_mask"]
    if alg.name == "ppo":
        if not g.is_last_stage:
            return
        token_rewards = xp.final_token_rewards(rewards, mask)
        if alg.kl_coef > 0 and alg.kl_in == "reward":
            token_rewards, _ = apply_kl_penalty(
                token_rewards,
                batch["old_logprobs"],
                batch["ref_logprobs"],
                mask,
                coef=alg.kl_coef,
                kind=alg.kl_kind,
            )
        adv, ret = gae_advantages(
            token_rewards, batch["old_values"], mask, gamma=alg.gamma, lam=alg.lam, group=g.dp
        )
        batch["advantages"], batch["returns"] = adv, ret
        return
    adv = gather_advantages(
        rewards,
        group_ids,
        estimator=alg.advantage,
        num_generations=run.cfg.rollout.n,
        scale=alg.scale,
        group=g.dp,
    )
    batch["advantages"] = adv[:, None] * mask


def update(run: Run, batch: dict) -> LocalMetrics:
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
                rollout=run.cfg.rollout,
                vocab_size=run.arch.vocab_size,
                groups=g,
                seed=seed,
                pad_to=run.pad_to,
            )
        )
    return metrics


def _trains_policy(run: Run) -> bool:
    """PPO trains only the critic for its first `trainer.critic_warmup_steps` steps."""
    return run.models.critic is None or run.step >= run.cfg.trainer.critic_warmup_steps


def collect_metrics(
    run: Run,
    batch,
    rewards,
    reward_metrics: LocalMetrics,
    train_metrics: LocalMetrics,
    times,
    step_s,
) -> dict:
    """Global metrics (the values one process holding the whole batch would log), delivered
    to global rank 0."""
    from megatron.core import parallel_state as ps

    g, mask = run.groups, batch["loss_mask"]
    r = rewards.double()
    local = LocalMetrics()
    local.add_ratio("reward_mean", r.sum(), len(r))
    local.add_ratio("_reward_sq", r.square().sum(), len(r))
    local.add_ratio("response_len", batch["response_len"].sum(), len(r))
    local.add_sum("tokens", batch["seq_len"].sum())
    local.update(reward_metrics)
    local.update(train_metrics)
    # router load balance, aux loss (MoE only)
    local.update(moe_metrics(run.models.actor.chunks, run.arch))
    if g.is_last_stage:
        old, valid = batch["old_logprobs"], mask.bool()
        diff = (old.double() - batch["sampler_logprobs"].double()).abs()[valid]
        local.add_ratio("logprob_mismatch", diff.sum(), diff.numel())
        local.add_max("logprob_mismatch_max", diff.max() if diff.numel() else 0.0)
        kl = 0.0
        if "ref_logprobs" in batch:
            kl = kl_penalty(old, batch["ref_logprobs"], "k3")[valid].double().sum()
        local.add_ratio("kl", kl, valid.sum())
    local.add_sum("_samples", len(r))
    merged = local.reduce(g.dp)
    n, mean = merged.pop("_samples"), merged["reward_mean"]
    var = (merged.pop("_reward_sq") - mean * mean) * n / max(n - 1, 1)  # unbiased, as torch.std
    merged["reward_std"] = math.sqrt(max(var, 0.0))
    # every prompt generated once: samples generated in the world = prompts x n
    made = torch.tensor([float(run.rollout.dispatcher.samples_generated)], dtype=torch.float64)
    dist.all_reduce(made)
    merged["rollout/samples_generated"] = made.item()
    # the last stage's view reaches rank 0 through the pipeline group
    box = [merged]
    pp = ps.get_pipeline_model_parallel_group()
    dist.broadcast_object_list(box, src=dist.get_global_rank(pp, g.pp_size - 1), group=pp)
    out = box[0]
    out["time_s"] = {**times, "step": step_s}
    tokens = out.pop("tokens")
    out["tokens_per_s"] = tokens / step_s
    out.update(_train_mfu(run, tokens, times.get("train"), batch))
    return out


def _train_mfu(run: Run, tokens: float, train_s: float | None, batch: dict) -> dict:
    """Model FLOPs utilisation of the policy-update stage (GPU only: needs a known peak); see
    `megarl.metrics.throughput.precision_mfu`."""
    if not train_s or not device.use_gpu():
        return {}
    prec = run.cfg.precision
    seq = float(batch["seq_len"].float().mean())
    fpt = flops_per_token(run.arch, seq_len=int(seq), training=True, causal=True)
    achieved = tokens * run.cfg.algorithm.ppo_epochs * fpt / train_s
    return precision_mfu(
        torch.cuda.get_device_name(),
        prec.torch_dtype,
        prec.fp8 is not None,
        achieved,
        dist.get_world_size(),
    )
