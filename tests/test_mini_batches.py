"""Mini-batches are drawn over the global batch (`megarl.trainer.update.mini_batches`).

Whatever the DP size, and wherever balancing moved a sample, mini-batch k holds the same samples;
a rank holding whole strata gives every mini-batch the same number of rows; every row is in
exactly one mini-batch; epochs draw anew. Balancing moves whole strata
(`megarl.trainer.balance.strata_partition`). End to end (the trainer's step functions at DP1 and
DP2, with and without balancing, two mini-batches): tests/test_metrics_global.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from megarl.trainer.balance import strata_partition
from megarl.trainer.update import mini_batches


def _global_sets(placement: list[list[int]], count: int, seed: int) -> list[set[int]]:
    """Mini-batch k's positions, over ranks holding the positions `placement[r]`."""
    sets: list[set[int]] = [set() for _ in range(count)]
    for positions in placement:
        pos = torch.tensor(positions)
        rows = mini_batches(pos, count, seed)
        assert sorted(torch.cat(rows).tolist()) == list(range(len(pos)))  # each row once
        for k, r in enumerate(rows):
            assert pos[r].tolist() == sorted(pos[r].tolist())  # in position order
            sets[k] |= set(pos[r].tolist())
    return sets


@pytest.mark.parametrize("count", [2, 3, 4])
def test_mini_batches_hold_the_same_samples_at_every_dp_size(count):
    total = 24
    one = _global_sets([list(range(total))], count, seed=5)
    assert sorted(len(s) for s in one) == [total // count] * count
    for dp in (2, 3, 6):
        n = total // dp
        placement = [list(range(r * n, (r + 1) * n)) for r in range(dp)]
        assert _global_sets(placement, count, seed=5) == one, dp
        if n % count == 0:  # whole strata: equal shares
            for positions in placement:
                sizes = [len(r) for r in mini_batches(torch.tensor(positions), count, 5)]
                assert sizes == [n // count] * count
    # each stratum gives every mini-batch one sample
    for s in range(total // count):
        assert sorted(k for k in range(count) for p in one[k] if p // count == s) == list(
            range(count)
        )


def test_mini_batches_follow_samples_that_balancing_moved():
    count, total = 2, 16
    one = _global_sets([list(range(total))], count, seed=9)
    shuffled = list(range(total))
    random.Random(0).shuffle(shuffled)
    assert _global_sets([shuffled[:8], shuffled[8:]], count, seed=9) == one


def test_epochs_draw_other_mini_batches_and_no_rank_gets_an_empty_one():
    pos = torch.arange(32)
    firsts = {tuple(mini_batches(pos, 2, seed)[0].tolist()) for seed in range(4)}
    assert len(firsts) == 4
    # parts of strata only (positions 0, 1 of stratum 0 and 4, 5 of stratum 1 at count 4)
    rows = mini_batches(torch.tensor([0, 1, 4, 5]), 4, seed=0)
    assert all(len(r) == 1 for r in rows)
    with pytest.raises(ValueError, match="algorithm.mini_batches=4 > 3 local sequences"):
        mini_batches(torch.arange(3), 4, seed=0)


def test_balancing_moves_whole_strata():
    rng = random.Random(1)
    lengths = [rng.randint(1, 200) for _ in range(24)]
    positions = list(range(24))
    rng.shuffle(positions)
    for strata in (2, 3):
        parts = strata_partition(lengths, positions, strata, [12, 12])
        assert sorted(i for p in parts for i in p) == list(range(24))
        for part in parts:
            held = sorted(positions[i] // strata for i in part)
            assert all(held.count(s) == strata for s in set(held)), (strata, held)
    # sizes that cut a stratum: per sample, as without mini-batches
    parts = strata_partition(lengths, positions, 4, [10, 14])
    assert [len(p) for p in parts] == [10, 14]
