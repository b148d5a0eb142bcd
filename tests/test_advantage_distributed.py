"""Distributed advantage stage on real gloo groups (1, 2, 4 ranks) vs the single-process result.

One launch per world size runs every case (estimator x scale x placement x dtype); the parent
builds the canonical global batch (group id, then rank, then local position), runs the
single-process estimator on it and demands bitwise equality (`torch.equal`).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from megarl.advantage import (
    GAEOptions,
    distributed_whiten,
    gae_advantages,
    gather_advantages,
    get_advantage,
    whiten,
)
from megarl.distributed.launch import spawn

ESTIMATORS = ["grpo", "rloo", "reinforce++", "dr_grpo"]
SCALES = ["group", "batch", "none"]


# per-half batches of the 4-rank subgroup check: (rewards, ids, placement) differ per half
_SUB_CASES = [
    {
        "rewards": [0.0, 1.0, 0.5, 0.5, 2.0, 1.0, 0.0, 3.0],
        "group_ids": [0, 0, 0, 0, 1, 1, 1, 1],
        "local_order": [[0, 1, 2], [3, 4, 5, 6, 7]],
        "g": 4,
        "estimator": "rloo",
        "scale": "batch",
        "dtype": torch.float32,
    },
    {
        "rewards": [1.0, -1.0, 0.25, 4.0, 0.0, 0.0],
        "group_ids": [5, 5, 9, 9, 2, 2],
        "local_order": [[5, 0, 3], [1, 2, 4]],
        "g": 2,
        "estimator": "grpo",
        "scale": "batch",
        "dtype": torch.float64,
    },
]


def _local(case: dict, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rewards and group ids, in the local order the case prescribes."""
    idx = case["local_order"][rank]
    rewards = torch.tensor([case["rewards"][i] for i in idx], dtype=case["dtype"])
    ids = torch.tensor([case["group_ids"][i] for i in idx], dtype=torch.int64)
    return rewards, ids


def _worker(rank: int, world_size: int, cases: list[dict], gae_inputs: dict) -> dict:
    out: dict = {"adv": [], "errors": []}
    for case in cases:
        rewards, ids = _local(case, rank)
        try:
            adv = gather_advantages(
                rewards,
                ids,
                estimator=case["estimator"],
                num_generations=case["g"],
                scale=case["scale"],
                group=None,
            )
        except ValueError as err:
            out["errors"].append(str(err))
            adv = None
        out["adv"].append(adv)
    # subgroups: with 4 ranks, {0, 1} and {2, 3} each compute on their own batch
    if world_size == 4:
        halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        case = _SUB_CASES[rank // 2]
        rewards, ids = _local(case, rank % 2)
        out["sub"] = gather_advantages(
            rewards,
            ids,
            estimator=case["estimator"],
            num_generations=case["g"],
            scale=case["scale"],
            group=halves[rank // 2],
        )
    rows = gae_inputs["rows"][rank]
    mask = gae_inputs["mask"][rows]
    out["whiten"] = distributed_whiten(gae_inputs["x"][rows], mask, group=None)
    out["gae"] = gae_advantages(
        gae_inputs["r"][rows],
        gae_inputs["v"][rows],
        mask,
        GAEOptions(gamma=0.99, lam=0.95),
        group=None,
    )
    return out


def _placements(rng: random.Random, n: int, g: int, world: int) -> dict[str, list[list[int]]]:
    """Sample indices per rank: contiguous uneven (one rank may be empty), whole groups,
    and a random scatter with shuffled local order."""
    cuts = sorted(rng.randint(0, n) for _ in range(world - 1))
    bounds = [0, *cuts, n]
    contiguous = [list(range(bounds[r], bounds[r + 1])) for r in range(world)]
    whole = [[] for _ in range(world)]
    for grp in range(n // g):
        whole[rng.randrange(world)].extend(range(grp * g, (grp + 1) * g))
    scatter = [[] for _ in range(world)]
    for i in range(n):
        scatter[rng.randrange(world)].append(i)
    for lst in scatter:
        rng.shuffle(lst)
    return {"contiguous": contiguous, "whole": whole, "scatter": scatter}


def _cases(world: int) -> list[dict]:
    rng = random.Random(world)
    cases = []
    for g in (1, 4):
        n_groups = 6
        n = n_groups * g
        rewards = [rng.choice([0.0, 1.0, 0.7, rng.gauss(0, 1)]) if i % 3 else 0.7 for i in range(n)]
        # non-contiguous ids, unsorted for G=1: the stage may only rely on id order/equality
        id_of_group = rng.sample(range(10_000), n_groups)
        if g > 1:
            id_of_group.sort()
        group_ids = [id_of_group[i // g] for i in range(n)]
        for pname, local_order in _placements(rng, n, g, world).items():
            for est in ESTIMATORS:
                if est == "rloo" and g == 1:
                    continue
                for scale in SCALES:
                    for dtype in (torch.float32, torch.float64, torch.bfloat16):
                        cases.append(
                            {
                                "rewards": rewards,
                                "group_ids": group_ids,
                                "g": g,
                                "estimator": est,
                                "scale": scale,
                                "dtype": dtype,
                                "placement": pname,
                                "local_order": local_order,
                            }
                        )
    # one malformed case: a group id with 3 members instead of 4
    bad = dict(cases[-1])
    bad["group_ids"] = [*bad["group_ids"][:-1], 123_456]
    bad["bad"] = True
    cases.append(bad)
    return cases


def _expected(case: dict, world: int) -> list[torch.Tensor]:
    """Single-process result on the canonical concatenation, split back per rank."""
    keys = []  # (group id, rank, local position) -> global sample index
    for rank in range(world):
        for pos, i in enumerate(case["local_order"][rank]):
            keys.append((case["group_ids"][i], rank, pos, i))
    keys.sort()
    canonical = torch.tensor([case["rewards"][k[3]] for k in keys], dtype=case["dtype"])
    adv = get_advantage(case["estimator"])(canonical, case["g"], case["scale"])
    by_sample = {k[3]: adv[j] for j, k in enumerate(keys)}
    return [
        torch.stack([by_sample[i] for i in case["local_order"][r]])
        if case["local_order"][r]
        else torch.empty(0, dtype=case["dtype"])
        for r in range(world)
    ]


def _gae_inputs(world: int) -> dict:
    g = torch.Generator().manual_seed(7)
    b, t = 2 * world + 1, 6
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    rows = [list(range(b))[r::world] for r in range(world)]  # uneven: rank 0 gets one more
    return {
        "x": torch.randn(b, t, generator=g, dtype=torch.float64),
        "r": torch.randn(b, t, generator=g, dtype=torch.float64),
        "v": torch.randn(b, t, generator=g, dtype=torch.float64),
        "mask": mask,
        "rows": rows,
    }


@pytest.mark.parametrize("world", [1, 2, 4])
def test_gather_advantages_bitwise(world):
    cases = _cases(world)
    gae_inputs = _gae_inputs(world)
    results = spawn(_worker, world, cases, gae_inputs)

    checked = 0
    for c, case in enumerate(cases):
        if case.get("bad"):
            for res in results:
                assert res["adv"][c] is None
                # the last group lost a member to the new id 123456 (which has 1)
                assert (
                    "has 3 samples across the DP group, expected num_generations=4"
                    in (res["errors"][0])
                )
                assert "(2 of 7 groups wrong)" in res["errors"][0]
            continue
        expected = _expected(case, world)
        for rank in range(world):
            got = results[rank]["adv"][c]
            assert got.dtype == case["dtype"]
            assert torch.equal(got, expected[rank]), (
                case["estimator"],
                case["scale"],
                rank,
            )
            checked += 1
        if case["placement"] == "contiguous" and case["group_ids"] == sorted(case["group_ids"]):
            # canonical order == original order: equals the plain single-process call
            full = get_advantage(case["estimator"])(
                torch.tensor(case["rewards"], dtype=case["dtype"]),
                case["g"],
                case["scale"],
            )
            assert torch.equal(torch.cat([r["adv"][c] for r in results]), full)
    assert checked >= len(cases) - 1

    if world == 4:
        for half, case in enumerate(_SUB_CASES):
            expected = _expected(case, 2)
            for local_rank in range(2):
                got = results[2 * half + local_rank]["sub"]
                assert torch.equal(got, expected[local_rank])

    # GAE whitening over all ranks' tokens == single-process whitening (up to rounding)
    x, mask = gae_inputs["x"], gae_inputs["mask"]
    full_w = whiten(x, mask)
    full_adv = whiten(_gae_full(gae_inputs)[0], mask)
    for rank in range(world):
        rows = gae_inputs["rows"][rank]
        torch.testing.assert_close(results[rank]["whiten"], full_w[rows], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(results[rank]["gae"][0], full_adv[rows], rtol=1e-12, atol=1e-12)


def _gae_full(inputs: dict):
    from megarl.advantage import compute_gae

    return compute_gae(inputs["r"], inputs["v"], inputs["mask"], 0.99, 0.95)
