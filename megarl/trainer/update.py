"""Policy and value updates: epochs over mini-batches through megatron's schedule.

Each mini-batch is one optimizer step. Its loss denominators (valid tokens, sequences) are
counted over the whole mini-batch across DP ranks before the forward passes, so every micro-batch
returns its exact share of the mini-batch loss and the update does not depend on the micro-batch
size or the DP split (see megarl.algorithms.losses and megarl.models.forward).

Metrics follow the same rule: a micro-batch's token-mean metric is turned into its share of the
mini-batch's global token mean (x its valid tokens / the global count), so summing over
micro-batches and DP ranks gives what one process would log; maxima are maxima. The update
functions return `LocalMetrics` (mean over the optimizer steps of this rank's shares), which
the trainer reduces over DP (`megarl.metrics.reduce`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megarl.algorithms.losses import get_policy_loss, global_denominators, value_loss
from megarl.data.batch import split_micro_batches
from megarl.metrics.reduce import LocalMetrics
from megarl.models import forward
from megarl.models.optim import zero_grads

# metrics that are maxima over tokens, not token means
MAX_METRICS = ("ratio_max",)
# policy_loss's "kl" (current policy vs reference, the estimator in the loss) is logged as
# "kl_loss"; "kl" is the rollout policy's k3 KL to the reference over the rollout batch
RENAMED = {"kl": "kl_loss"}


def recompute_old_logprobs(alg) -> bool:
    """Whether the old policy's logprobs need a forward pass of their own before the update.

    With one epoch over one mini-batch the update's forward runs on exactly the weights that
    generated the advantages' data, so its detached logprobs *are* the old ones (ratio = 1 by
    construction, as TRL does); a separate pass would change nothing. Truncated importance
    sampling then weighs each token by exp(those logprobs - the sampler's), which the update's
    forward provides as well. The pass is kept when something reads the old logprobs before the
    update or across optimizer steps: several epochs or mini-batches, the KL penalty in the
    reward."""
    return alg.ppo_epochs > 1 or alg.mini_batches > 1 or (alg.kl_coef > 0 and alg.kl_in == "reward")


def mini_batches(num_rows: int, count: int, seed: int) -> list[torch.Tensor]:
    """Row indices of `count` mini-batches: a seeded permutation (identical on every rank of a
    model-parallel group), split evenly."""
    if num_rows < count:
        raise ValueError(f"algorithm.mini_batches={count} > {num_rows} local sequences per step")
    perm = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed))
    return list(perm.chunk(count))


def _select(batch: dict, rows: torch.Tensor) -> dict:
    n = batch["tokens"].shape[0]
    return {
        k: (v[rows] if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == n else v)
        for k, v in batch.items()
    }


def _shares(metrics: dict, loss: torch.Tensor, mask: torch.Tensor, tokens: float) -> dict:
    """A micro-batch's token-mean metrics as shares of the mini-batch's global token mean."""
    weight = mask.sum() / tokens
    out = {
        RENAMED.get(k, k): v.detach() if k in MAX_METRICS else v.detach() * weight
        for k, v in metrics.items()
    }
    out["loss"] = loss.detach()
    return out


def step_metrics(outputs: list[dict], steps: int) -> LocalMetrics:
    """One optimizer step's micro-batch metrics, pre-divided by the number of steps (so the
    LocalMetrics of all steps add up to the mean over steps)."""
    lm = LocalMetrics()
    for m in outputs:
        for k, v in m.items():
            if k in MAX_METRICS:
                lm.add_max(k, float(v))
            elif k not in ("index", "logprobs"):
                lm.add_sum(k, float(v) / steps)
    return lm


def optimizer_step(optimizer, scheduler, loss_ok: bool, groups) -> tuple[bool, float, bool]:
    """Optimizer step unless any rank saw a non-finite loss (then the grads are dropped).
    Returns (applied, grad norm, overflow): `overflow` is an fp16 step the optimizer itself
    skipped because its dynamic loss scale overflowed (the scale backs off; expected while it
    calibrates, so not a sign of divergence)."""
    flag = torch.tensor([0.0 if loss_ok else 1.0])
    dist.all_reduce(flag)
    if flag.item() > 0:
        return False, float("nan"), False
    ok, grad_norm, _ = optimizer.step()
    scheduler.step(1)
    overflow = not ok and _has_loss_scaler(optimizer)
    return bool(ok), float(grad_norm) if grad_norm is not None else float("nan"), overflow


def _has_loss_scaler(optimizer) -> bool:
    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return any(getattr(o, "grad_scaler", None) is not None for o in inner)


def _policy_loss_fn(alg, rollout, vocab_size: int, groups, tokens: float, seqs: float):
    """loss_fn(micro_batch, logits) -> (share of the mini-batch policy loss, metrics)."""
    use_ref = alg.kl_coef > 0 and alg.kl_in == "loss"
    loss_of = get_policy_loss(alg.policy_loss)  # the registry: a name it lacks raises here

    def loss_fn(micro, logits):
        lp = forward.vocab_parallel_logprobs(
            logits,
            micro["targets"],
            vocab_size=vocab_size,
            tp_group=groups.tp,
            temperature=rollout.temperature,
        )
        ent = None
        if alg.entropy_coef > 0:
            ent = forward.vocab_parallel_entropy(logits, vocab_size=vocab_size, tp_group=groups.tp)
        old = micro["old_logprobs"]
        loss, m = loss_of(
            lp,
            lp.detach() if old is None else old,  # see recompute_old_logprobs
            micro["advantages"],
            micro["loss_mask"],
            clip_low=alg.clip_low,
            clip_high=alg.clip_high,
            dual_clip=alg.dual_clip,
            agg_mode=alg.agg_mode,
            global_tokens=tokens,
            global_seqs=seqs,
            max_len=rollout.max_tokens,
            sampler_logprobs=micro["sampler_logprobs"] if alg.tis_cap else None,
            tis_cap=alg.tis_cap,
            entropy=ent,
            entropy_coef=alg.entropy_coef,
            ref_logprobs=micro["ref_logprobs"] if use_ref else None,
            kl_coef=alg.kl_coef if use_ref else 0.0,
            kl_kind=alg.kl_kind,
        )
        out = _shares(m, loss, micro["loss_mask"], tokens)
        if old is None:  # the old logprobs, for the metrics (mismatch, KL to the reference)
            out.update(index=micro["index"], logprobs=lp.detach())
        return loss, out

    return loss_fn


def _value_loss_fn(alg, tokens: float, seqs: float):
    """loss_fn(micro_batch, values) -> (share of the mini-batch value loss, metrics)."""

    def loss_fn(micro, values):
        loss, m = value_loss(
            values.squeeze(-1).float(),
            micro["old_values"],
            micro["returns"],
            micro["loss_mask"],
            clip=alg.value_clip,
            agg_mode=alg.agg_mode,
            global_tokens=tokens,
            global_seqs=seqs,
            max_len=None,
        )
        m = {k if k.startswith("value") else f"value_{k}": v for k, v in m.items()}
        m = _shares(m, loss, micro["loss_mask"], tokens)
        m["value_loss"] = m.pop("loss")
        return alg.value_coef * loss, m

    return loss_fn


def train_policy(
    actor,
    optimizer,
    scheduler,
    batch: dict,
    *,
    alg,
    rollout,
    vocab_size: int,
    groups,
    seed: int,
    pad_to: int = 1,
) -> LocalMetrics:
    """PPO/GRPO-family policy update on this rank's batch; returns this rank's metrics (shares
    on the last stage; optimizer figures on every rank). Without `old_logprobs` in the batch
    (`recompute_old_logprobs` false: one epoch, one mini-batch) the update's own detached
    logprobs serve as the old ones, and are stored into `batch["old_logprobs"]` (last stage)."""
    reuse = batch.get("old_logprobs") is None and groups.is_last_stage
    if reuse and (alg.ppo_epochs > 1 or alg.mini_batches > 1):
        raise ValueError("train_policy: old_logprobs are required with several epochs/mini-batches")

    def keep_old_logprobs(out: list[dict], rows: torch.Tensor) -> None:
        if reuse:
            batch["old_logprobs"] = _assemble_rows(out, rows, batch["tokens"].shape)

    return _optimizer_steps(
        actor,
        optimizer,
        scheduler,
        batch,
        alg=alg,
        groups=groups,
        seed=seed,
        pad_to=pad_to,
        make_loss_fn=lambda tokens, seqs: _policy_loss_fn(
            alg, rollout, vocab_size, groups, tokens, seqs
        ),
        loss_key="loss",
        prefix="",
        on_output=keep_old_logprobs,
    )


def _optimizer_steps(
    model,
    optimizer,
    scheduler,
    batch: dict,
    *,
    alg,
    groups,
    seed: int,
    pad_to: int,
    make_loss_fn,
    loss_key: str,
    prefix: str,
    on_output=None,
) -> LocalMetrics:
    """`alg.ppo_epochs` x `alg.mini_batches` optimizer steps of `model` on `batch`.

    make_loss_fn(global tokens, global sequences) -> loss_fn for one mini-batch; `loss_key` is
    the metric holding a micro-batch's share of the mini-batch loss (a non-finite sum on any
    rank drops that step's gradients). Besides the loss metrics, every rank gets the step
    results under `prefix`: grad_norm (mean over steps), skipped_steps (dropped for a non-finite
    loss), overflow_steps (fp16 loss-scale back-offs, when any) and lr."""
    metrics = LocalMetrics()
    steps = []
    total = alg.ppo_epochs * alg.mini_batches
    for epoch in range(alg.ppo_epochs):
        for rows in mini_batches(batch["tokens"].shape[0], alg.mini_batches, seed + epoch):
            mb = _select(batch, rows)
            tokens, seqs = global_denominators([mb["loss_mask"]], group=groups.dp)
            loss_fn = make_loss_fn(tokens, seqs)
            zero_grads(model, optimizer)
            micro = split_micro_batches(
                mb,
                alg.micro_batch_size,
                pad_to_multiple=pad_to,
                max_tokens=alg.max_tokens_per_micro_batch,
            )
            out = forward.run(model, micro, loss_fn, forward_only=False, dp_size=groups.dp_size)
            # the mini-batch loss is the sum of the micro-batch shares
            loss = sum(float(m[loss_key]) for m in out) if out else 0.0
            steps.append(optimizer_step(optimizer, scheduler, math.isfinite(loss), groups))
            metrics.update(step_metrics(out, total))
            if on_output is not None:
                on_output(out, rows)
    # the grad norm is global (megatron reduces it over the model), so equal on every rank
    metrics.add_same(f"{prefix}grad_norm", sum(g for _, g, _ in steps) / len(steps))
    metrics.add_same(
        f"{prefix}skipped_steps", sum(1 for ok, _, over in steps if not ok and not over)
    )
    overflows = sum(1 for _, _, over in steps if over)
    if overflows:  # fp16 loss-scale back-offs (the same on every rank: found_inf is reduced)
        metrics.add_same(f"{prefix}overflow_steps", overflows)
    metrics.add_same(f"{prefix}lr", optimizer.param_groups[0]["lr"])
    return metrics


def _assemble_rows(outputs: list[dict], rows: torch.Tensor, shape) -> torch.Tensor:
    """[B, S] host tensor of the micro-batches' `logprobs`; micro-batch row i of the mini-batch
    is batch row rows[i]."""
    out = torch.zeros(shape, dtype=torch.float32)
    for m in outputs:
        idx = m["index"]
        val = m["logprobs"][: len(idx)].float().cpu()
        out[rows[idx], : val.shape[1]] = val[:, : shape[1]]
    return out


def train_value(
    critic, optimizer, scheduler, batch: dict, *, alg, groups, seed: int, pad_to: int = 1
) -> LocalMetrics:
    """Critic regression to the GAE returns; returns this rank's metric shares (last stage) and
    the critic's step results as value_grad_norm, value_skipped_steps, value_lr (every rank)."""
    return _optimizer_steps(
        critic,
        optimizer,
        scheduler,
        batch,
        alg=alg,
        groups=groups,
        seed=seed + 7919,  # the critic's own mini-batch order
        pad_to=pad_to,
        make_loss_fn=lambda tokens, seqs: _value_loss_fn(alg, tokens, seqs),
        loss_key="value_loss",
        prefix="value_",
    )
