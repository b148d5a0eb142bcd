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

The batch is the step's `StepBatch` (`megarl.trainer.experience`); its micro-batches are the
plain dicts of `StepBatch.fields()` that megatron's data iterator hands to the loss functions.
The loss knobs come from the algorithm config's option groups (`alg.policy_loss_options`,
`alg.value_loss_options`); the walk over the batch from a `Schedule`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megarl.algorithms.losses import get_policy_loss, global_denominators, value_loss
from megarl.data.batch import MicroBatching, pad_share, split_micro_batches
from megarl.metrics.reduce import LocalMetrics
from megarl.models import forward
from megarl.models.optim import zero_grads
from megarl.trainer.experience import StepBatch

# metrics that are maxima over tokens, not token means
MAX_METRICS = ("ratio_max", "is_weight_max")
# policy_loss's "kl" (current policy vs reference, the estimator in the loss) is logged as
# "kl_loss"; "kl" is the rollout policy's k3 KL to the reference over the rollout batch
RENAMED = {"kl": "kl_loss"}


def recompute_old_logprobs(alg) -> bool:
    """Whether the old policy's logprobs need a forward pass of their own before the update.

    With one epoch over one mini-batch the update's forward runs on exactly the weights that
    generated the advantages' data, so its detached logprobs *are* the old ones (ratio = 1 by
    construction, as TRL does); a separate pass would change nothing. An off-policy correction
    then weighs each token by exp(those logprobs - the sampler's), which the update's forward
    provides as well. The pass is kept when something reads the old logprobs before the
    update or across optimizer steps: several epochs or mini-batches, the KL penalty in the
    reward, the distillation advantage (teacher - student logprob)."""
    return (
        alg.ppo_epochs > 1 or alg.mini_batches > 1 or alg.kl_options.in_reward or alg.uses_teacher
    )


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """How an update walks this rank's batch: `epochs` passes of `mini_batches` optimizer steps,
    each mini-batch split into micro-batches by `micro`."""

    epochs: int
    """Passes over the batch (`algorithm.ppo_epochs`)."""
    mini_batches: int
    """Optimizer steps per pass (`algorithm.mini_batches`)."""
    micro: MicroBatching
    """How a mini-batch is cut into micro-batches (size, token budget, packing)."""
    seed: int
    """Seed of the mini-batch order of the first epoch (epoch e: seed + e)."""
    positions: torch.Tensor | None = None
    """[B] long: the rows' places in the step's global batch (`mini_batches`); None: rank
    order (`local_positions`)."""

    @classmethod
    def of(cls, alg, *, seed: int, pad_to: int, positions=None) -> Schedule:
        """The schedule of the `algorithm` section `alg`."""
        return cls(
            epochs=alg.ppo_epochs,
            mini_batches=alg.mini_batches,
            micro=MicroBatching.of(alg, pad_to=pad_to),
            seed=seed,
            positions=positions,
        )


LossFn = Callable[[dict, torch.Tensor], tuple[torch.Tensor, dict]]


@dataclass(frozen=True)
class Objective:
    """What an update minimises: `make_loss_fn(global tokens, global sequences)` -> the loss_fn
    of one mini-batch (`megarl.models.forward` contract); `loss_key`, the metric holding a
    micro-batch's share of the mini-batch loss; `prefix`, the prefix of the step results."""

    make_loss_fn: Callable[[float, float], LossFn]
    loss_key: str
    prefix: str


def mini_batches(positions: torch.Tensor, count: int, seed: int) -> list[torch.Tensor]:
    """Row indices of `count` mini-batches of this rank's rows, drawn over the global batch.

    positions: [b] long, each row's place in the step's global batch (`Scored.positions`).
    Stratified: the global batch is cut into strata of `count` consecutive positions and each
    stratum hands one row to every mini-batch, in an order seeded by (`seed`, stratum). So a
    mini-batch holds the same samples whatever the DP size or whichever rank holds a sample,
    and a rank holding whole strata gives every mini-batch b / count rows. A mini-batch left
    empty on this rank (it holds parts of strata only: a short dynamic-sampling step) takes the
    last row of the largest one. Rows of a mini-batch are in position order."""
    num_rows = len(positions)
    if num_rows < count:
        raise ValueError(f"algorithm.mini_batches={count} > {num_rows} local sequences per step")
    order = positions.argsort(stable=True)
    strata, slot = positions[order] // count, positions[order] % count
    which = torch.empty(num_rows, dtype=torch.long)
    for stratum in strata.unique().tolist():
        gen = torch.Generator().manual_seed((seed * 0x9E3779B97F4A7C15 + stratum) % 2**63)
        rows = strata == stratum
        which[rows] = torch.randperm(count, generator=gen)[slot[rows]]
    out = [order[which == k].tolist() for k in range(count)]
    for empty in (k for k in range(count) if not out[k]):
        out[empty].append(max(out, key=len).pop())
    return [torch.tensor(rows, dtype=torch.long) for rows in out]


def local_positions(num_rows: int, groups) -> torch.Tensor:
    """[num_rows] positions of this DP rank's rows in the global batch when every rank holds
    `num_rows` in rank order (`Scored.positions` when the step says nothing else)."""
    return groups.dp_rank * num_rows + torch.arange(num_rows)


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


def _policy_loss_fn(alg, sampling, vocab_size: int, groups, tokens: float, seqs: float):
    """loss_fn(micro_batch, logits) -> (share of the mini-batch policy loss, metrics): the loss
    `alg.policy_loss` with `alg.policy_loss_options`."""
    opts = alg.policy_loss_options
    loss_of = get_policy_loss(alg.policy_loss)  # the registry: a name it lacks raises here

    def loss_fn(micro, logits):
        kw = dict(vocab_size=vocab_size, tp_group=groups.tp, temperature=sampling.temperature)
        ent = None
        if opts.entropy_coef > 0:
            lp, ent = forward.token_logprobs_and_entropy(micro, logits, **kw)
        else:
            lp = forward.token_logprobs(micro, logits, **kw)
        old = micro.get("old_logprobs")
        loss, m = loss_of(
            lp,
            lp.detach() if old is None else old,  # see recompute_old_logprobs
            micro["advantages"],
            micro["loss_mask"],
            opts,
            global_tokens=tokens,
            global_seqs=seqs,
            max_len=sampling.max_tokens,
            sampler_logprobs=micro["sampler_logprobs"] if opts.off_policy.active else None,
            entropy=ent,
            ref_logprobs=micro["ref_logprobs"] if opts.kl_coef > 0 else None,
        )
        out = _shares(m, loss, micro["loss_mask"], tokens)
        if old is None:  # the old logprobs, for the metrics (mismatch, KL to the reference)
            out.update(index=micro["index"], logprobs=lp.detach())
        return loss, out

    return loss_fn


def _value_loss_fn(alg, tokens: float, seqs: float):
    """loss_fn(micro_batch, values) -> (share of the mini-batch value loss, metrics): the value
    loss with `alg.value_loss_options`, weighted by `alg.value_coef`."""
    opts = alg.value_loss_options

    def loss_fn(micro, values):
        loss, m = value_loss(
            forward.per_token(micro, values.squeeze(-1).float()),
            micro["old_values"],
            micro["returns"],
            micro["loss_mask"],
            opts,
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
    batch: StepBatch,
    *,
    alg,
    sampling,
    vocab_size: int,
    groups,
    seed: int,
    pad_to: int = 1,
    positions: torch.Tensor | None = None,
) -> LocalMetrics:
    """PPO/GRPO-family policy update on this rank's batch; returns this rank's metrics (shares
    on the last stage; optimizer figures on every rank). Without `batch.old_logprobs`
    (`recompute_old_logprobs` false: one epoch, one mini-batch) the update's own detached
    logprobs serve as the old ones, and are stored into `batch.old_logprobs` (last stage).
    `sampling`: what the samples were drawn with (`rollout.sampling`: its temperature);
    `positions`: the rows' places in the global batch (`Schedule.positions`)."""
    reuse = batch.old_logprobs is None and groups.is_last_stage
    if reuse and (alg.ppo_epochs > 1 or alg.mini_batches > 1):
        raise ValueError("train_policy: old_logprobs are required with several epochs/mini-batches")

    def keep_old_logprobs(out: list[dict], rows: torch.Tensor) -> None:
        if reuse:
            batch.old_logprobs = _assemble_rows(out, rows, batch.tokens.shape)

    objective = Objective(
        lambda tokens, seqs: _policy_loss_fn(alg, sampling, vocab_size, groups, tokens, seqs),
        loss_key="loss",
        prefix="",
    )
    schedule = Schedule.of(alg, seed=seed, pad_to=pad_to, positions=positions)
    return _optimizer_steps(
        actor, optimizer, scheduler, batch, schedule, objective, groups, keep_old_logprobs
    )


def _optimizer_steps(
    model,
    optimizer,
    scheduler,
    batch: StepBatch,
    schedule: Schedule,
    objective: Objective,
    groups,
    on_output: Callable[[list[dict], torch.Tensor], None] | None = None,
) -> LocalMetrics:
    """`schedule.epochs` x `schedule.mini_batches` optimizer steps of `model` on `batch`.

    A non-finite sum of `objective.loss_key` (the micro-batch shares of the mini-batch loss) on
    any rank drops that step's gradients. Besides the loss metrics, every rank gets the step
    results under `objective.prefix`: grad_norm (mean over steps), skipped_steps (dropped for a
    non-finite loss), overflow_steps (fp16 loss-scale back-offs, when any) and lr.
    `on_output(micro-batch outputs, the mini-batch's rows)` sees each step's outputs."""
    metrics = LocalMetrics()
    steps = []
    prefix = objective.prefix
    total = schedule.epochs * schedule.mini_batches
    positions = schedule.positions
    if positions is None:
        positions = local_positions(len(batch), groups)
    for epoch in range(schedule.epochs):
        order = mini_batches(positions, schedule.mini_batches, schedule.seed + epoch)
        for rows in order:
            mb = batch.select(rows)
            tokens, seqs = global_denominators([mb.loss_mask], group=groups.dp)
            loss_fn = objective.make_loss_fn(tokens, seqs)
            zero_grads(model, optimizer)
            micro = split_micro_batches(mb.fields(), schedule.micro)
            real, computed = pad_share(micro)  # the policy's and the critic's split alike
            metrics.add_ratio("train/pad_share", computed - real, computed)
            out = forward.forward_backward(
                model, micro, loss_fn, forward_only=False, dp_size=groups.dp_size
            )
            # the mini-batch loss is the sum of the micro-batch shares
            loss = sum(float(m[objective.loss_key]) for m in out) if out else 0.0
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
    critic,
    optimizer,
    scheduler,
    batch: StepBatch,
    *,
    alg,
    groups,
    seed: int,
    pad_to: int = 1,
    positions: torch.Tensor | None = None,
) -> LocalMetrics:
    """Critic regression to the GAE returns; returns this rank's metric shares (last stage) and
    the critic's step results as value_grad_norm, value_skipped_steps, value_lr (every rank)."""
    objective = Objective(
        lambda tokens, seqs: _value_loss_fn(alg, tokens, seqs),
        loss_key="value_loss",
        prefix="value_",
    )
    # seed + 7919: the critic's own mini-batch order
    schedule = Schedule.of(alg, seed=seed + 7919, pad_to=pad_to, positions=positions)
    return _optimizer_steps(critic, optimizer, scheduler, batch, schedule, objective, groups)
