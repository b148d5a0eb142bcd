"""DAPO's dynamic sampling (`algorithm.dynamic_sampling`): a step trains groups whose rewards
differ.

A group (one prompt's n samples) whose rewards are all equal has a zero group-relative
advantage (GRPO family, n >= 2): it adds no policy gradient but costs a reference, a forward
and a backward pass. With dynamic sampling a step generates in rounds. Each round is one whole
step's worth of the prompt stream (`data.prompts_per_step` prompts, each DP rank its share, the
sampler advancing as for a step, so the stream consumed does not depend on the DP size), scored,
and its groups without a reward spread dropped (`groups_with_spread`). Rounds go on until the
kept groups of the whole DP group number prompts_per_step, or
`algorithm.dynamic_sampling_max_rounds` rounds ran.

Decisions are global. The kept count is all-reduced over DP after each round; the step trains
the first prompts_per_step kept groups in stream order (round, then the prompt's place in the
round's global list), dealt to the DP ranks in contiguous shares of that order, as the sampler
deals a plain step's prompts. The trained set, and which rank trains which group, therefore do
not depend on which rank generated a group: DP1 trains what DP2 trains. The deal is one object
all-gather of the kept samples over the DP group (the step's kept batch in host memory on each
rank, as `algorithm.balance_dp_tokens` holds it).

A step the bound stops short (K < prompts_per_step kept groups) trains on its K groups (the
ranks' shares then differ by at most one group) and logs a warning. Every rank needs at least
ceil(algorithm.mini_batches / n) groups: when K is below that times the DP size, the first
round's earliest dropped groups fill the step up to it (`rollout/groups_filled`; their advantage
is zero).

Group ids stay distinct within a step: rounds may draw a prompt twice (across an epoch boundary,
or from a small dataset), so the k-th draw of dataset row i in one step has group id
i + k x rows (`round_group_ids`; id mod rows is the row). Without a repeat the id is the row,
as without dynamic sampling.

Each round samples with its own seed (`megarl.trainer.seeds.round_seed`; round 0 with the
step's seed). The sampler advances by every round and a checkpoint holds it after the step's
rounds, so a resumed run continues the stream where the straight run does.

Metrics (global): `rollout/rounds`, `rollout/groups_dropped` (groups without a reward spread,
over the step's rounds), `rollout/groups_trained`, `rollout/groups_filled`, and
`rollout/samples_generated` over every round. The reward functions' metrics (`reward/<name>`)
cover every sample of every round; `reward_mean` and `reward_std` the trained samples.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable

import torch
import torch.distributed as dist

from megarl.metrics.reduce import LocalMetrics
from megarl.rollout import Samples
from megarl.trainer.experience import Scored

log = logging.getLogger("megarl")


def groups_with_spread(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Which samples belong to a group whose rewards are not all equal.

    rewards: [N] float, each sample's total reward.
    group_ids: [N] integer, each sample's group (a group's samples may lie anywhere).
    Returns keep: [N] bool, False exactly for the samples of the groups with zero reward
    variance: every reward of the group equal to the others (compared exactly, so a group of
    one sample is dropped, and two rewards one ulp apart are a spread)."""
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(
            f"groups_with_spread: rewards {tuple(rewards.shape)} and group_ids "
            f"{tuple(group_ids.shape)} must both be [N]"
        )
    if rewards.numel() == 0:
        return torch.zeros(0, dtype=torch.bool)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    groups = int(inverse.max()) + 1
    hi = torch.full((groups,), -torch.inf, dtype=rewards.dtype)
    lo = torch.full((groups,), torch.inf, dtype=rewards.dtype)
    hi = hi.scatter_reduce(0, inverse, rewards, "amax")
    lo = lo.scatter_reduce(0, inverse, rewards, "amin")
    return (hi != lo)[inverse]


def round_group_ids(prompts: list[int], seen: Counter, rows: int) -> list[int]:
    """The group id of each prompt of one round's global list `prompts` (dataset rows, distinct
    within the round): row + k x `rows` where k is how often the step's earlier rounds drew the
    row. Counts the round's rows into `seen`."""
    ids = [p + seen[p] * rows for p in prompts]
    seen.update(prompts)
    return ids


@dataclasses.dataclass(frozen=True)
class Round:
    """One round's samples on this rank, labelled with the step's group ids."""

    rollout: Samples
    """This rank's samples of the round (`prompt_index`: this rank's prompts)."""
    scored: Scored
    """Their scores; `group_ids` the step's group ids (`round_group_ids`)."""
    keep: torch.Tensor
    """[B] bool: the sample's group has a reward spread (`groups_with_spread`)."""


def sample_step(run, one_round: Callable[[int], tuple[Samples, Scored]]) -> tuple[Samples, Scored]:
    """This DP rank's share of the step's trained groups: rounds of `one_round(round)` (generate
    and score one step's worth of prompts, sampled with the round's seed) until
    `data.prompts_per_step` groups with a reward spread are kept over the DP group, or
    `algorithm.dynamic_sampling_max_rounds` rounds ran (module docstring). Collective over the
    world. Returns (samples, scored) whose `prompt_index` / `group_ids` are the group ids."""
    cfg, g, sampler = run.cfg, run.groups, run.data.sampler
    want, n = cfg.data.prompts_per_step, cfg.rollout.sampling.n
    floor = g.dp_size * -(-cfg.algorithm.mini_batches // n)  # fewest groups a step can train
    seen: Counter = Counter()
    rounds: list[Round] = []
    kept = dropped = 0
    generated = 0
    metrics = LocalMetrics()
    while kept < want and len(rounds) < cfg.algorithm.dynamic_sampling_max_rounds:
        rollout, scored = one_round(len(rounds))
        step_ids = round_group_ids(sampler.last_global_indices, seen, sampler.num_rows)
        of_row = dict(zip(sampler.last_global_indices, step_ids, strict=True))
        ids = torch.tensor([of_row[int(p)] for p in scored.group_ids], dtype=torch.long)
        scored = dataclasses.replace(scored, group_ids=ids)
        keep = groups_with_spread(scored.rewards, ids)
        counts = torch.tensor(
            [len(set(ids[keep].tolist())), len(set(ids[~keep].tolist()))], dtype=torch.float64
        )
        dist.all_reduce(counts, group=g.dp)
        kept, dropped = kept + int(counts[0]), dropped + int(counts[1])
        generated += run.rollout.samples_generated()
        metrics.update(scored.metrics)
        rounds.append(Round(rollout, scored, keep))
    mine, trained, filled = deal(rounds, want, floor, fill=kept < floor, group=g.dp)
    if kept < want:
        log.warning(
            "dynamic sampling: %d of %d groups with a reward spread after "
            "algorithm.dynamic_sampling_max_rounds=%d rounds; step %d trains %d groups",
            kept, want, len(rounds), run.step + 1, trained,
        )  # fmt: skip
    total = torch.tensor([float(generated)], dtype=torch.float64)
    dist.all_reduce(total)  # every sample is counted by one rank of the world
    for key, value in (
        ("rollout/rounds", len(rounds)),
        ("rollout/groups_dropped", dropped),
        ("rollout/groups_trained", trained),
        ("rollout/groups_filled", filled),
        ("rollout/samples_generated", total.item()),
    ):
        metrics.add_same(key, value)
    return mine.rollout, dataclasses.replace(mine.scored, metrics=metrics)


def deal(
    rounds: list[Round], want: int, floor: int, *, fill: bool, group
) -> tuple[Round, int, int]:
    """This DP rank's share of the groups a step trains, from every rank's `rounds` (collective
    over the DP `group`): the first `want` groups with a spread in stream order (round, then
    rank, then the rank's order), with `fill` the first round's earliest dropped groups up to
    `floor` groups, dealt in contiguous shares of stream order (rank r of D takes the groups
    [r T / D, (r + 1) T / D) of the T chosen). Returns (this rank's samples and their scores, in
    stream order, `prompt_index` and `group_ids` the group ids, its `keep` all true but for
    filled groups; T; how many of the T were filled)."""
    every, rewards, spread, parts = _gather(rounds, fill, group)
    trained, filled = choose_groups(every.prompt_index, spread, want, floor)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mine = set(trained[rank * len(trained) // world : (rank + 1) * len(trained) // world])
    rows = [i for i, gid in enumerate(every.prompt_index) if gid in mine]
    chosen = set(trained)
    place = {i: p for p, i in enumerate(i for i, g in enumerate(every.prompt_index) if g in chosen)}
    scored = Scored(
        rewards=rewards[rows],
        per_function={k: v[rows] for k, v in parts.items()},
        metrics=LocalMetrics(),
        group_ids=torch.tensor([every.prompt_index[i] for i in rows], dtype=torch.long),
        positions=torch.tensor([place[i] for i in rows], dtype=torch.long),  # in stream order
    )
    keep = torch.tensor([spread[i] for i in rows], dtype=torch.bool)
    return Round(every.take(rows), scored, keep), len(trained), filled


def _gather(rounds: list[Round], fill: bool, group) -> tuple:
    """Every rank's kept samples of every round (and with `fill` the first round's dropped ones
    too), in stream order: round, then rank, then the rank's order. Returns (samples, their
    `prompt_index` the group ids; rewards [M]; whether each one's group has a spread [M];
    {reward function: [M]}). Collective over the DP `group`."""
    pieces = []
    for r, rd in enumerate(rounds):
        keep = rd.keep.tolist()
        rows = [i for i, k in enumerate(keep) if k or (fill and r == 0)]
        ids = rd.scored.group_ids.tolist()
        pieces.append(
            (
                rd.rollout.take(rows, prompt_index=[ids[i] for i in rows]),
                rd.scored.rewards[rows],
                {k: v[rows] for k, v in rd.scored.per_function.items()},
                [keep[i] for i in rows],
            )
        )
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, pieces, group=group)
    ordered = [rank_pieces[r] for r in range(len(rounds)) for rank_pieces in gathered]
    every = Samples.concat([p[0] for p in ordered])
    rewards = torch.cat([p[1] for p in ordered])
    parts = {k: torch.cat([p[2][k] for p in ordered]) for k in rounds[0].scored.per_function}
    return every, rewards, [k for p in ordered for k in p[3]], parts


def choose_groups(ids: list[int], keep: list[bool], want: int, floor: int) -> tuple[list[int], int]:
    """The group ids a step trains, in stream order, from the samples' group ids `ids` and
    whether their group has a spread (`keep`), both in stream order: the first `want` kept
    groups, then (when fewer than `floor`) the earliest dropped groups up to `floor`. Returns
    (groups, how many of them were dropped groups)."""
    order = list(dict.fromkeys(ids))
    spread = {gid for gid, k in zip(ids, keep, strict=True) if k}
    chosen = [gid for gid in order if gid in spread][:want]
    extra = [gid for gid in order if gid not in spread][: max(0, floor - len(chosen))]
    picked = set(chosen) | set(extra)
    return [gid for gid in order if gid in picked], len(extra)
