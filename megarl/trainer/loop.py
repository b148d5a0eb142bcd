"""The RL loop. One step:

prompts -> generate (vLLM, n samples each) -> score (reward functions) -> old / reference
logprobs and values (megatron forward) -> advantages (gathered across DP) -> policy (and
critic) update -> weight sync into vLLM -> metrics -> checkpoint
"""

from __future__ import annotations

import logging
import math
import os
import time

import torch
import torch.distributed as dist

from megarl.algorithms.advantages import masked_mean
from megarl.algorithms.distributed_advantage import gae_advantages, gather_advantages
from megarl.algorithms.kl import apply_kl_penalty, kl_penalty
from megarl.config import RunConfig
from megarl.distributed import device
from megarl.metrics.progress import StepProgress
from megarl.metrics.timer import StageTimer
from megarl.trainer import experience as xp
from megarl.trainer.run import Run, is_mp_source
from megarl.trainer.update import train_policy, train_value

log = logging.getLogger("megarl")


class TrainingDiverged(RuntimeError):
    """Too many consecutive steps with a non-finite loss."""


def train(cfg: RunConfig, out_dir: str) -> Run:
    run = Run.create(cfg, out_dir)
    timer = StageTimer()
    bar = StepProgress(cfg.trainer.steps, rank=dist.get_rank(), initial=run.step)
    while run.step < cfg.trainer.steps:
        t0 = time.perf_counter()
        with timer("rollout"):
            prompts, rollout = generate(run)
        with timer("reward"):
            rewards, reward_metrics = score(run, prompts, rollout)
        batch = xp.build_batch(
            rollout.prompt_ids,
            rollout.response_ids,
            rollout.response_logprobs,
            pad_id=_pad_id(run),
            pad_to=_pad_to(run),
        )
        with timer("logprobs"):
            forward_passes(run, batch)
        with timer("advantage"):
            advantages(run, batch, rewards, rollout.prompt_index, prompts.indices)
        with timer("train"):
            train_metrics = update(run, batch)
        with timer("sync"):
            run.sync_weights()
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
        run.logger.log(run.step, metrics)
        if cfg.logging.progress:
            bar.update(run.step, metrics)
        if _bad_step(run, metrics):  # no checkpoint is written from a diverged state
            run.close()
            raise TrainingDiverged(
                f"stopped at step {run.step}: {run.bad_steps} consecutive steps with a NaN/Inf "
                f"loss (trainer.max_bad_steps={cfg.trainer.max_bad_steps}); the newest checkpoint "
                f"in {run.out_dir}/checkpoints is from before the divergence"
            )
        every = cfg.trainer.save_every
        if (every and run.step % every == 0) or run.step == cfg.trainer.steps:
            run.save()
    bar.close()
    finish(run)
    return run


# ---------------------------------------------------------------------- the named steps
def generate(run: Run):
    """This DP rank's prompts and their samples. On CPU only the model-parallel source rank
    generates; the rollout is broadcast to the rest of its TP x PP group."""
    from megatron.core import parallel_state as ps

    prompts = run.dataset.batch(run.sampler.next_step())
    rollout = None
    if device.use_gpu() or is_mp_source(run.groups):  # SPMD engines on GPU must all step
        rollout = run.engine.generate(prompts.prompt_ids, seed=run.cfg.trainer.seed + run.step)
    box = [rollout]
    group = ps.get_model_parallel_group()
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return prompts, box[0]


def score(run: Run, prompts, rollout) -> tuple[torch.Tensor, dict]:
    """Rewards [B] for this rank's samples (TRL protocol; dataset columns passed through)."""
    from megarl.rewards import score as score_fn

    tok = run.tokenizer
    idx = rollout.prompt_index
    completions = tok.batch_decode(rollout.response_ids, skip_special_tokens=True)
    columns = {k: [v[i] for i in idx] for k, v in prompts.columns.items()}
    total, per_fn, errors = score_fn(
        run.reward_fns,
        run.cfg.reward.weights,
        [prompts.prompts[i] for i in idx],
        completions,
        rollout.response_ids,
        columns,
        on_error=run.cfg.reward.on_error,
    )
    metrics = {f"reward/{k}": float(torch.nanmean(v)) for k, v in per_fn.items()}
    metrics["reward_errors"] = errors
    return total, metrics


def forward_passes(run: Run, batch: dict) -> None:
    """Old-policy and reference logprobs, and critic values, into `batch` (last PP stage)."""
    mbs, g = run.cfg.algorithm.micro_batch_size, run.groups
    kw = dict(
        micro_batch_size=mbs,
        vocab_size=run.arch.vocab_size,
        groups=g,
        temperature=run.cfg.rollout.temperature,
        pad_to=_pad_to(run),
    )
    batch["old_logprobs"] = xp.forward_logprobs(run.actor, batch, **kw)
    if run.reference is not None:
        batch["ref_logprobs"] = xp.forward_logprobs(run.reference, batch, **kw)
    if run.critic is not None:
        batch["old_values"] = xp.forward_values(
            run.critic, batch, micro_batch_size=mbs, groups=g, pad_to=_pad_to(run)
        )


def advantages(run: Run, batch: dict, rewards: torch.Tensor, prompt_index, global_ids) -> None:
    """GRPO family: group-relative, gathered across DP. PPO: GAE with the critic."""
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
    group_ids = torch.tensor([global_ids[i] for i in prompt_index], dtype=torch.long)
    adv = gather_advantages(
        rewards,
        group_ids,
        estimator=alg.advantage,
        num_generations=run.cfg.rollout.n,
        scale=alg.scale,
        group=g.dp,
    )
    batch["advantages"] = adv[:, None] * mask


def update(run: Run, batch: dict) -> dict:
    alg, g, seed = run.cfg.algorithm, run.groups, run.cfg.trainer.seed * 1000003 + run.step
    metrics = {}
    if run.critic is not None:
        metrics.update(
            train_value(
                run.critic,
                run.critic_opt,
                run.critic_sched,
                batch,
                alg=alg,
                groups=g,
                seed=seed,
                pad_to=_pad_to(run),
            )
        )
    if run.critic is None or run.step >= run.cfg.trainer.critic_warmup_steps:
        metrics.update(
            train_policy(
                run.actor,
                run.actor_opt,
                run.actor_sched,
                batch,
                alg=alg,
                rollout=run.cfg.rollout,
                vocab_size=run.arch.vocab_size,
                groups=g,
                seed=seed,
                pad_to=_pad_to(run),
            )
        )
    return metrics


def collect_metrics(run: Run, batch, rewards, reward_metrics, train_metrics, times, step_s) -> dict:
    """Global (DP-averaged) metrics, delivered to global rank 0."""
    from megatron.core import parallel_state as ps

    g, mask = run.groups, batch["loss_mask"]
    resp = batch["response_len"].float()
    local = {
        "reward_mean": rewards.float().mean().item(),
        "reward_std": rewards.float().std().item() if len(rewards) > 1 else 0.0,
        "response_len": resp.mean().item(),
        "tokens": float(batch["seq_len"].sum()),
        **reward_metrics,
        **train_metrics,
    }
    if g.is_last_stage:
        old = batch["old_logprobs"]
        mm = _mismatch(old, batch["sampler_logprobs"], mask)
        local["logprob_mismatch"] = mm["mean"]
        local["logprob_mismatch_max"] = mm["max"]
        if "ref_logprobs" in batch:
            local["kl"] = masked_mean(kl_penalty(old, batch["ref_logprobs"], "k3"), mask).item()
        else:
            local["kl"] = 0.0
    # average over DP replicas (every rank of a stage holds the same keys)
    keys = sorted(local)
    vec = torch.tensor([float(local[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(vec, group=g.dp)
    vec /= g.dp_size
    merged = dict(zip(keys, vec.tolist(), strict=True))
    merged["tokens"] *= g.dp_size  # a sum, not a mean
    # the last stage's view reaches rank 0 through the pipeline group
    box = [merged]
    pp = ps.get_pipeline_model_parallel_group()
    dist.broadcast_object_list(box, src=dist.get_global_rank(pp, g.pp_size - 1), group=pp)
    out = box[0]
    out["time_s"] = {**times, "step": step_s}
    tokens = out.pop("tokens")
    out["tokens_per_s"] = tokens / step_s
    mfu = _train_mfu(run, tokens, times.get("train"), batch)
    if mfu is not None:
        out["mfu"] = mfu
    return out


def _train_mfu(run: Run, tokens: float, train_s: float | None, batch: dict) -> float | None:
    """Model FLOPs utilisation of the policy-update stage (GPU only: needs a known peak)."""
    from megarl.distributed import device
    from megarl.metrics.throughput import flops_per_token, peak_flops

    if not train_s or not device.use_gpu():
        return None
    peak = peak_flops(torch.cuda.get_device_name(), run.cfg.precision.torch_dtype)
    if peak is None:
        return None
    seq = float(batch["seq_len"].float().mean())
    fpt = flops_per_token(run.arch, seq_len=int(seq), training=True, causal=True)
    achieved = tokens * run.cfg.algorithm.ppo_epochs * fpt / train_s
    return achieved / (peak * dist.get_world_size())


def _mismatch(trainer_lp, sampler_lp, mask) -> dict:
    from megarl.rollout import mismatch

    return mismatch.logprob_mismatch(trainer_lp, sampler_lp, mask)


def _bad_step(run: Run, metrics: dict) -> bool:
    """Count consecutive steps whose loss was non-finite (their updates were dropped)."""
    loss = metrics.get("loss", 0.0)
    if metrics.get("skipped_steps", 0) or not math.isfinite(loss):
        run.bad_steps += 1
        log.warning(
            "step %d: non-finite loss, update skipped (%d in a row)", run.step, run.bad_steps
        )
        return run.bad_steps >= run.cfg.trainer.max_bad_steps
    run.bad_steps = 0
    return False


def finish(run: Run) -> None:
    """Plot the reward curve; optionally export the policy as an HF directory."""
    metrics = os.path.join(run.out_dir, "metrics.jsonl")
    if dist.get_rank() == 0 and os.path.exists(metrics):
        from megarl.metrics.plots import plot_rewards

        try:
            plot_rewards(metrics, os.path.join(run.out_dir, "reward.png"))
        except ValueError as e:  # e.g. a resumed run that had no step left to do
            log.warning("no reward plot: %s", e)
    if run.cfg.trainer.export_hf:
        export_hf(run, os.path.join(run.out_dir, "hf"))
    run.close()
    dist.barrier()


def export_hf(run: Run, out: str) -> None:
    from megarl.convert.hf_io import save_hf_dir
    from megarl.convert.layout import gather_full_state
    from megarl.convert.mapping import canonical_to_hf

    full = gather_full_state(run.actor, to_all=False)
    if dist.get_rank() == 0:
        tok_dir = os.path.join(run.out_dir, "tokenizer")
        save_hf_dir(
            out,
            run.arch.hf_config,
            canonical_to_hf(run.arch, full.items()),
            tokenizer_dir=tok_dir if os.path.isdir(tok_dir) else None,
            overwrite=True,
        )
    dist.barrier()


def _pad_id(run: Run) -> int:
    tok = run.tokenizer
    return tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)


def _pad_to(run: Run) -> int:
    # sequence parallelism splits the sequence over TP ranks
    return run.groups.tp_size if run.cfg.parallel.sequence_parallel else 1

