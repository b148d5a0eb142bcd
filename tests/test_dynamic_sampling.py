"""DAPO's dynamic sampling (`algorithm.dynamic_sampling`, `megarl.trainer.dynamic_sampling`).

(a) the pure parts: which groups are dropped (exactly those whose rewards are all equal), the
    group ids of a prompt drawn twice in one step, which groups a step trains (stream order,
    trimmed, filled when short), the rounds' seeds, the balance of unequal shares;
(b) the config refusals, naming the keys;
(c) end to end on the embedded default through `megarl train`: every trained group has a
    reward spread, some step needs more than one round, and a run stopped after step 2 and
    resumed at DP2 trains what the straight DP1 run trains in steps 3 and 4 (the same groups,
    the same figures).
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter

import pytest
import torch

from megarl.config import ConfigError, load_config
from megarl.trainer.balance import balanced_partition
from megarl.trainer.dynamic_sampling import choose_groups, groups_with_spread, round_group_ids
from megarl.trainer.seeds import round_seed, step_seed


# ------------------------------------------------------------------ (a) the pure parts
def _keep(rewards, ids):
    return groups_with_spread(
        torch.tensor(rewards, dtype=torch.float32), torch.tensor(ids)
    ).tolist()


def test_dropped_groups_are_exactly_those_with_equal_rewards():
    # group 7: a spread; group 3: all 0; group 5: all equal and nonzero; group 9: one sample
    rewards = [0.0, 1.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.25]
    ids = [7, 7, 3, 3, 5, 5, 5, 9]
    assert _keep(rewards, ids) == [True, True, False, False, False, False, False, False]
    # a group's samples need not be contiguous: 4's rewards differ only at its far end, 1's not
    keep = _keep([0.2, 0.3, 0.2, 0.3, 0.2, 0.7], [4, 1, 4, 1, 4, 4])
    assert keep == [True, False, True, False, True, True]
    assert _keep([], []) == []


def test_float_ties_are_exact():
    # 0.1 + 0.2 != 0.3 in floats: a spread one ulp wide is a spread, equal floats are not
    near = [0.1 + 0.2, 0.3]
    assert near[0] != near[1]
    r = torch.tensor(near, dtype=torch.float64)
    assert groups_with_spread(r, torch.tensor([0, 0])).tolist() == [True, True]
    one = torch.tensor([1.0], dtype=torch.float32)
    ulp = torch.nextafter(one, torch.tensor([2.0]))
    assert groups_with_spread(torch.cat([one, ulp]), torch.tensor([2, 2])).tolist() == [True] * 2
    same = torch.tensor([0.3, 0.3, 0.3], dtype=torch.float64)
    assert groups_with_spread(same, torch.tensor([1, 1, 1])).tolist() == [False] * 3
    with pytest.raises(ValueError, match=r"must both be \[N\]"):
        groups_with_spread(torch.zeros(3), torch.zeros(2, dtype=torch.long))


def test_a_prompt_drawn_again_in_the_step_gets_a_group_id_of_its_own():
    seen: Counter = Counter()
    rows = 10
    assert round_group_ids([3, 7, 1], seen, rows) == [3, 7, 1]
    # the next round crossed an epoch boundary and drew 7 and 3 again
    assert round_group_ids([7, 0, 3], seen, rows) == [17, 0, 13]
    assert round_group_ids([7, 2, 5], seen, rows) == [27, 2, 5]
    assert all(i % rows == r for i, r in zip([17, 13, 27], [7, 3, 7], strict=True))


def test_a_step_trains_the_first_kept_groups_in_stream_order():
    # samples in stream order (n = 2): groups 5, 2, 8 (no spread), 1, 4, 6
    ids = [5, 5, 2, 2, 8, 8, 1, 1, 4, 4, 6, 6]
    keep = [True, True, True, True, False, False, True, True, True, True, True, True]
    assert choose_groups(ids, keep, want=3, floor=2) == ([5, 2, 1], 0)
    # short: three kept groups, fewer than wanted, more than the floor: train those three
    assert choose_groups(ids[:8], keep[:8], want=4, floor=2) == ([5, 2, 1], 0)
    # below the floor: the earliest dropped groups fill up to it, in stream order
    none = [False] * 8
    assert choose_groups(ids[:8], none, want=4, floor=2) == ([5, 2], 2)
    assert choose_groups(ids[:8], [True, True] + [False] * 6, want=4, floor=3) == ([5, 2, 8], 2)


def test_rounds_draw_seeds_of_their_own_and_round_zero_is_the_step():
    assert round_seed(3, 17, 0) == step_seed(3, 17)
    seeds = {round_seed(s, k, r) for s in (0, 1) for k in range(50) for r in range(1024)}
    assert len(seeds) == 2 * 50 * 1024
    steps = {step_seed(s, k) for s in (0, 1) for k in range(10**6)}
    assert not steps & {round_seed(s, k, r) for s in (0, 1) for k in range(50) for r in (1, 9)}


def test_balance_keeps_unequal_shares():
    # a short step of dynamic sampling leaves one rank a group more than the other
    lengths = [30, 2, 28, 3, 25, 4, 1, 26, 2, 27]
    parts = balanced_partition(lengths, 2, [6, 4])
    assert [len(p) for p in parts] == [6, 4]
    assert sorted(i for p in parts for i in p) == list(range(10))
    sums = [sum(lengths[i] for i in p) for p in parts]
    assert max(sums) - min(sums) <= max(lengths)
    assert balanced_partition(lengths, 2) == balanced_partition(lengths, 2, [5, 5])
    with pytest.raises(ValueError, match=r"cannot be dealt as \[6, 3\]"):
        balanced_partition(lengths, 2, [6, 3])


# the step's global rounds (P = 4 groups of n = 2 each, group id = 10 x round + place): round 0
# keeps the groups at places 1, 2, 3, round 1 those at 0 and 1; a spread is rewards (0, 1)
SPREAD = [[False, True, True, True], [True, True, False, False]]


def _round(rnd: int, places: list[int]):
    from megarl.metrics.reduce import LocalMetrics
    from megarl.rollout import Samples
    from megarl.trainer.dynamic_sampling import Round
    from megarl.trainer.experience import Scored

    ids = [10 * rnd + p for p in places for _ in range(2)]
    rewards = [float(k) if SPREAD[rnd][p] else 0.5 for p in places for k in range(2)]
    samples = Samples(
        prompt_index=[j for j in range(len(places)) for _ in range(2)],
        prompt_ids=[[i, i] for i in ids],
        response_ids=[[i, j % 2] for j, i in enumerate(ids)],  # the group, the sample
        response_logprobs=[[-0.5, -0.25] for _ in ids],
        finish_reason=["stop"] * len(ids),
    )
    r = torch.tensor(rewards)
    scored = Scored(rewards=r, per_function={"f": 2 * r}, metrics=LocalMetrics(),
                    group_ids=torch.tensor(ids))  # fmt: skip
    return Round(samples, scored, groups_with_spread(r, torch.tensor(ids)))


def _deal(rank: int, world: int, want: int, floor: int, fill: bool):
    from megarl.trainer.dynamic_sampling import deal

    share = 4 // world
    places = list(range(rank * share, (rank + 1) * share))
    mine, trained, filled = deal(
        [_round(0, places), _round(1, places)], want, floor, fill=fill, group=None
    )
    return (mine.scored.group_ids.tolist(), mine.rollout.response_ids,
            mine.scored.per_function["f"].tolist(), trained, filled)  # fmt: skip


@pytest.mark.slow
def test_the_groups_a_step_trains_and_their_deal_do_not_depend_on_the_dp_size():
    from megarl.distributed.launch import spawn

    (one,) = spawn(_deal, 1, 4, 1, False)
    # 5 kept: the first 4 in stream order (round 0's 1, 2, 3, then round 1's 0)
    assert one[0] == [1, 1, 2, 2, 3, 3, 10, 10] and one[3:] == (4, 0)
    two = spawn(_deal, 2, 4, 2, False)
    # DP2 ranks generated places 0-1 and 2-3 of each round; they train the DP1 run's groups,
    # each its contiguous share of stream order, every sample with its own fields
    assert two[0][0] == [1, 1, 2, 2] and two[1][0] == [3, 3, 10, 10]
    assert [x for t in two for x in t[1]] == one[1] and [x for t in two for x in t[2]] == one[2]
    # 5 kept, short of a floor of 6: the first round's dropped group fills the step
    (fill,) = spawn(_deal, 1, 8, 6, True)
    assert fill[0] == [0, 0, 1, 1, 2, 2, 3, 3, 10, 10, 11, 11] and fill[3:] == (6, 1)


# ------------------------------------------------------------------ (b) the config refusals
ON = "algorithm.dynamic_sampling=true"
SEPARATE = "rollout.placement.mode=separate"


@pytest.mark.parametrize(
    "overrides,expected",
    [
        ([ON, "algorithm.name=ppo"], "algorithm.dynamic_sampling=true with algorithm.name=ppo"),
        ([ON, SEPARATE, "rollout.placement.max_staleness=1"],
         r"dynamic_sampling=true with rollout.placement.max_staleness=1.*accepted: "
         "max_staleness=0"),
        ([ON, "rollout.sampling.n=1"], "rollout.sampling.n=1.*accepted: n >= 2"),
        ([ON, "algorithm.dynamic_sampling_max_rounds=0"],
         "algorithm.dynamic_sampling_max_rounds=0; accepted: 1 to 1024"),
        (["algorithm.dynamic_sampling_max_rounds=1025"],
         "algorithm.dynamic_sampling_max_rounds=1025; accepted: 1 to 1024"),
    ],
)  # fmt: skip
def test_dynamic_sampling_is_refused_where_it_cannot_work(overrides, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(None, overrides)


def test_dynamic_sampling_works_with_separate_engines_and_multi_turn():
    assert load_config(None, [ON, SEPARATE]).algorithm.dynamic_sampling
    assert load_config(None, [ON, "env.name=retry"]).env.multi_turn
    # off: staleness ahead is as it was
    load_config(None, ["algorithm.name=ppo", SEPARATE, "rollout.placement.max_staleness=1"])


# ------------------------------------------------------------------ (c) end to end
DS = [
    "algorithm.dynamic_sampling=true",
    "data.prompts_per_step=4",
    "rollout.sampling.n=3",  # three samples: equal rewards are common
    # at most two rounds: with these seeds steps 2 and 4 refill the step (4 exactly, and 5 groups
    # trimmed to 4), steps 1, 3 and 5 stop short (3, 2 and 3 groups)
    "algorithm.dynamic_sampling_max_rounds=2",
    "trainer.seed=3",
    "data.seed=3",
    "algorithm.mini_batches=1",  # DP1 and DP2 then update on the same mini-batch
    "trainer.steps=5",
    "optim.decay_steps=64",
    "logging.samples_per_step=64",  # samples.jsonl: every trained sample
]


def _kept(row: dict) -> int:
    """Groups with a reward spread over the step's rounds (the trained ones and the surplus)."""
    return int(row["rollout/rounds"] * 4 - row["rollout/groups_dropped"])


def _rows(path, name="metrics.jsonl"):
    with open(os.path.join(path, name)) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A DP1 run of 4 steps (a checkpoint after each), and a DP2 run resumed from its step-1
    checkpoint, balancing tokens over DP: (dp1 dir, dp2 dir)."""
    from tests.test_trainer_e2e import _train

    tmp = tmp_path_factory.mktemp("dynamic_sampling")
    dp1, dp2 = tmp / "dp1", tmp / "dp2"
    _train(dp1, *DS, "trainer.save_every=1", "trainer.keep_last=0")
    shutil.copytree(dp1 / "checkpoints" / "step_000001", dp2 / "checkpoints" / "step_000001")
    _train(dp2, *DS, "algorithm.balance_dp_tokens=true", nproc=2)
    return dp1, dp2


def _groups(path) -> dict:
    """{(step, prompt id, prompt): [(completion, reward), ...]} of samples.jsonl."""
    out: dict = {}
    for s in _rows(path, "samples.jsonl"):
        out.setdefault((s["step"], s["prompt_id"], s["prompt"]), []).append(
            (s["completion"], s["reward"])
        )
    return {k: sorted(v) for k, v in out.items()}


@pytest.mark.slow
def test_every_trained_group_has_a_reward_spread_and_rounds_refill_the_step(runs):
    dp1, _ = runs
    rows = _rows(dp1)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    trained = [int(r["rollout/groups_trained"]) for r in rows]
    kept = [_kept(r) for r in rows]
    # the bound (2 rounds) ends some steps short; the others fill their 4 groups in 2 rounds,
    # one trims its 5 kept groups to 4
    assert trained == [min(k, 4) for k in kept], (kept, trained)
    assert any(r["rollout/rounds"] == 2 and t == 4 for r, t in zip(rows, trained, strict=True))
    assert max(kept) > 4 and min(trained) < 4 and min(trained) >= 2, kept
    assert all(r["rollout/groups_filled"] == 0 for r in rows)
    for r in rows:  # every round generated a whole step's prompts x n
        assert r["rollout/samples_generated"] == r["rollout/rounds"] * 4 * 3
    with open(str(dp1) + ".log") as f:
        log = f.read()
    for step, t in enumerate(trained, 1):  # the short steps say so, the others do not
        line = f"after algorithm.dynamic_sampling_max_rounds=2 rounds; step {step} trains {t} "
        assert (line in log) == (t < 4), (step, t)
    # samples.jsonl holds every trained sample: no group's rewards are all equal
    groups = _groups(dp1)
    assert len(groups) == sum(trained), sorted(groups)
    assert all(len(v) == 3 and len({x[1] for x in v}) > 1 for v in groups.values()), groups


@pytest.mark.slow
def test_a_run_resumed_at_dp2_trains_the_groups_of_the_straight_dp1_run(runs):
    dp1, dp2 = runs
    straight, resumed = _rows(dp1)[1:], _rows(dp2)
    assert [r["step"] for r in resumed] == [2, 3, 4, 5]
    # what DP2 must get right: 5 kept groups trimmed to the first 4 of the stream, and a step
    # of 3 groups (the DP2 ranks hold 1 and 2, then balanced by tokens: 3 and 6 samples)
    assert max(_kept(r) for r in resumed) > 4
    assert 3 in [r["rollout/groups_trained"] for r in resumed]
    for a, b in zip(straight, resumed, strict=True):
        # the same rounds, groups and samples (seeds follow the prompts' places in the stream)
        for key in (
            "rollout/rounds",
            "rollout/groups_dropped",
            "rollout/groups_trained",
            "rollout/samples_generated",
            "reward_mean",
            "reward_std",
            "response_len",
        ):
            assert a[key] == b[key], (key, a[key], b[key])
        for key in ("loss", "kl", "entropy"):  # the update, up to the order of float sums
            assert abs(a[key] - b[key]) <= 1e-5, (key, a[key], b[key])
    assert {k: v for k, v in _groups(dp1).items() if k[0] > 1} == _groups(dp2)


@pytest.mark.slow
@pytest.mark.extended
def test_separate_engines_draw_and_train_the_colocated_runs_groups(runs, tmp_path):
    """One trainer rank and one engine rank (staleness 0), steps 1-2: the same rounds, groups,
    rewards and samples as the colocated DP1 run."""
    from tests.test_trainer_e2e import _train

    dp1, _ = runs
    sep = tmp_path / "separate"
    _train(sep, *DS, "trainer.steps=2", SEPARATE, "rollout.placement.ranks=1", nproc=2)
    for a, b in zip(_rows(dp1)[:2], _rows(sep), strict=True):
        for key in ("rollout/rounds", "rollout/groups_dropped", "rollout/groups_trained"):
            assert a[key] == b[key], (key, a[key], b[key])
        for key in ("reward_mean", "reward_std", "loss", "kl"):
            assert abs(a[key] - b[key]) <= 1e-5, (key, a[key], b[key])
    assert {k: v for k, v in _groups(dp1).items() if k[0] <= 2} == _groups(sep)


@pytest.mark.slow
@pytest.mark.extended
def test_multi_turn_trajectories_are_dropped_and_refilled_by_their_reward_spread(tmp_path):
    """Trajectories of up to 3 turns (`tests.envs_for_tests:CopyAgain`), 3 steps: every trained
    group's rewards differ, and some step needed a second round."""
    from tests.test_multi_turn_e2e import ENV
    from tests.test_trainer_e2e import _train

    out = tmp_path / "multi_turn"
    _train(out, *ENV, *DS, "trainer.steps=3", "rollout.sampling.n=3")
    rows = _rows(out)
    assert max(r["rollout/rounds"] for r in rows) == 2, rows
    assert max(r["rollout/turns"] for r in rows) > 1, rows
    groups = _groups(out)
    assert len(groups) == sum(int(r["rollout/groups_trained"]) for r in rows)
    assert all(len({x[1] for x in v}) > 1 for v in groups.values()), groups
