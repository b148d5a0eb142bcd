"""Distributed advantage stage: rewards live on the DP ranks that scored them.

Each DP rank holds `b_local` rewards and, per sample, the global id of the prompt group it
belongs to. A group (exactly `num_generations` samples) may be split across ranks and ranks may
hold different numbers of samples. The stage

1. all-gathers the local sizes, then one padded all-gather of a flat int32 buffer per rank
   holding the run-length encoded group ids and the rewards (bit-exact reinterpretation);
2. orders the global batch canonically: by group id, then by (rank, local position) — a stable
   sort of the rank-major gathered order (skipped when the gathered ids are already sorted,
   the usual "ranks hold consecutive prompts" layout, where it would be the identity);
3. runs the single-process estimator (`advantages.py`) on that batch on every rank;
4. returns each rank the entries of its own samples.

Because step 3 is literally the single-process code on the same tensor, the result is bitwise
equal to calling the estimator on the canonically ordered concatenation of all ranks' rewards
(the tests check this with `torch.equal`), and the estimators' reductions do not depend on the
thread count (`advantages._sum`). Placement changes the order of members inside a group only
through (rank, position), which is why the canonical order is defined that way.
The price is O(global batch) work per rank; for 1M rewards that is milliseconds (see the
`advantage` benchmark), cheaper than any scatter protocol's extra collective.

GAE needs no gather (it is per sequence); only its whitening needs global statistics, computed
here with one all-reduce of float64 sums (`distributed_whiten`).

A group of size 1 takes the same path (the collectives are then copies).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.algorithms.advantages import GAEOptions, compute_gae, get_advantage


def _words(x: torch.Tensor) -> torch.Tensor:
    """Flat int32 view of a contiguous tensor whose element size is a multiple of 4 bytes."""
    return x.contiguous().reshape(-1).view(torch.int32)


def _gather_rewards_and_ids(
    rewards: torch.Tensor, ids: torch.Tensor, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """All ranks' `(rewards [sum n], ids [sum n])` in rank order, and the per-rank sizes.

    Ids travel run-length encoded (a rank usually holds whole groups, G equal ids in a row), so
    the payload is ~4 + 12/G bytes per float32 sample instead of 12. One size exchange, then
    one padded all-gather of a flat int32 buffer per rank:
    `[run ids (int64) | run lengths (int32) | rewards]`.
    """
    world = dist.get_world_size(group)
    run_ids, run_lengths = torch.unique_consecutive(ids, return_counts=True)
    # on the rewards' device: NCCL only moves device tensors
    meta = torch.tensor(
        [rewards.shape[0], run_ids.numel()], dtype=torch.int64, device=rewards.device
    )
    metas = [torch.empty_like(meta) for _ in range(world)]
    dist.all_gather(metas, meta, group=group)
    metas = torch.stack(metas).tolist()  # one device sync for all sizes
    sizes = [int(m[0]) for m in metas]
    runs = [int(m[1]) for m in metas]
    n_max = max(sizes)
    k_max = max(runs) + max(runs) % 2  # even, so the rewards block is 8-byte aligned
    # rewards narrower than 4 bytes (bf16/fp16) travel as float32: exact, cast back below
    wire = rewards if rewards.element_size() % 4 == 0 else rewards.to(torch.float32)
    r_words = wire.element_size() // 4
    buf = torch.zeros(3 * k_max + r_words * n_max, dtype=torch.int32, device=rewards.device)
    k = run_ids.numel()
    buf[: 2 * k] = _words(run_ids)  # int64 block first: byte 0 is 8-byte aligned
    buf[2 * k_max : 2 * k_max + k] = run_lengths.to(torch.int32)
    buf[3 * k_max : 3 * k_max + r_words * rewards.shape[0]] = _words(wire)
    chunks = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(chunks, buf, group=group)
    all_ids = torch.cat(
        [
            torch.repeat_interleave(
                c[: 2 * kr].view(torch.int64), c[2 * k_max : 2 * k_max + kr], output_size=n
            )
            for c, kr, n in zip(chunks, runs, sizes, strict=False)
        ]
    )
    all_rewards = torch.cat(
        [
            c[3 * k_max : 3 * k_max + r_words * n].view(wire.dtype)
            for c, n in zip(chunks, sizes, strict=False)
        ]
    )
    return all_rewards.to(rewards.dtype), all_ids, sizes


def gather_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    *,
    estimator: str,
    num_generations: int,
    scale: str,
    group: dist.ProcessGroup | None,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Advantages of this rank's samples, computed over the global (DP) batch.

    rewards: `[b_local]` (or `[b_local, K]`, summed over K), floating.
    group_index: `[b_local]` integer id of each sample's prompt group, global across ranks.
    estimator: a registered name ("grpo", "rloo", "reinforce++", "dr_grpo", ...).
    group: the DP process group (None: the default world group).
    Returns `[b_local]`, bitwise equal to `get_advantage(estimator)(global_rewards, G, scale)`
    on the canonical global order, restricted to this rank's samples.
    Raises ValueError (on every rank, as all see the same gathered data) if any group id does
    not have exactly `num_generations` members.
    """
    adv_fn = get_advantage(estimator)
    rewards = rewards if rewards.dim() == 1 else rewards.sum(dim=-1)
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.float32)
    if group_index.shape != rewards.shape:
        raise ValueError(
            f"group_index must have one id per reward: shape {tuple(group_index.shape)} vs "
            f"rewards {tuple(rewards.shape)}"
        )
    if group_index.is_floating_point() or group_index.is_complex():
        raise ValueError(f"group_index must be an integer tensor; got {group_index.dtype}")
    all_rewards, all_ids, sizes = _gather_rewards_and_ids(
        rewards, group_index.to(device=rewards.device, dtype=torch.int64), group
    )
    start = sum(sizes[: dist.get_rank(group)])
    n_local = rewards.shape[0]

    if bool((all_ids[1:] >= all_ids[:-1]).all()):
        # already canonical: the stable sort below would be the identity
        _check_groups(all_ids, num_generations)
        adv = adv_fn(all_rewards, num_generations, scale, eps=eps)
        return adv[start : start + n_local]
    # Stable sort keeps (rank, local position) order inside a group id.
    order = torch.sort(all_ids, stable=True).indices
    _check_groups(all_ids[order], num_generations)
    adv_sorted = adv_fn(all_rewards[order], num_generations, scale, eps=eps)
    # position_in_sorted[j] = where gathered sample j landed after sorting
    position_in_sorted = torch.empty_like(order)
    position_in_sorted[order] = torch.arange(order.numel(), device=order.device)
    return adv_sorted[position_in_sorted[start : start + n_local]]


def _check_groups(sorted_ids: torch.Tensor, num_generations: int) -> None:
    """Every group id in the (sorted) global batch must have exactly `num_generations` members.

    Fast check: the ids reshape to `[N, G]` rows that are constant with strictly increasing
    heads. Only on failure are the groups counted, to name the first wrong one.
    """
    g = num_generations
    if sorted_ids.numel() % g == 0:
        rows = sorted_ids.view(-1, g)
        heads = rows[:, 0]
        if bool((rows == heads[:, None]).all()) and bool((heads[1:] > heads[:-1]).all()):
            return
    uniq, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    bad = (counts != g).nonzero().flatten()
    i = int(bad[0])
    raise ValueError(
        f"group id {int(uniq[i])} has {int(counts[i])} samples across the DP group, expected "
        f"num_generations={g} ({bad.numel()} of {uniq.numel()} groups wrong)"
    )


def distributed_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    *,
    group: dist.ProcessGroup | None,
    shift_mean: bool = True,
    eps: float = 1e-8,
) -> torch.Tensor:
    """`whiten` with the statistics of all valid tokens of all ranks in `group`.

    x, mask: `[B_local, T]`. Mean and unbiased variance come from one all-reduce of float64
    `(count, sum, sum of squares)`; equal to single-process `whiten` on the concatenated batch up
    to float rounding (not bitwise: the reduction order differs).
    """
    valid = mask.bool()
    xd = torch.where(valid, x.detach().to(torch.float64), 0.0)
    stats = torch.stack([valid.sum().to(torch.float64), xd.sum(), (xd * xd).sum()])
    dist.all_reduce(stats, group=group)
    n, s, ss = stats.unbind()
    mean = s / n.clamp(min=1)
    var = (ss - n * mean * mean) / (n - 1).clamp(min=1)
    out = (x - mean.to(x.dtype)) * torch.rsqrt(var.clamp(min=0) + eps).to(x.dtype)
    if not shift_mean:
        out = out + mean.to(x.dtype)
    return torch.where(valid, out, 0.0)


def gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    opts: GAEOptions,
    *,
    group: dist.ProcessGroup | None,
    whiten_advantages: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level PPO advantages with a critic on this rank's `[B_local, T]` sequences
    (`token_rewards`, `values`, `mask`: `[B_local, T]`; gamma and lambda from `opts`).

    GAE is per sequence, so only the whitening of the advantages is global (over every valid
    token of the DP group). Returns are left unwhitened (they are the critic's targets).
    """
    adv, returns = compute_gae(token_rewards, values, mask, opts.gamma, opts.lam)
    if whiten_advantages:
        adv = distributed_whiten(adv, mask, group=group)
    return adv, returns
