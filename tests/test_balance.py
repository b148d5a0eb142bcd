"""Equal tokens per DP rank (`algorithm.balance_dp_tokens`, `megarl.trainer.balance`).

(a) the partition: equal counts, deterministic, within the longest-first bound of the optimum
    (checked by brute force on small cases), and a skewed step made near-equal;
(b) the exchange over a real gloo DP group: every sample arrives exactly once with its own
    fields (ids, sampler logprobs, routes, reward, prompt id), equal counts, fewer max tokens;
(c) end to end at DP2 through `megarl train`: with one mini-batch the first step's figures
    (reward, loss, KL, mismatch: all global) are those of the unbalanced run.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from megarl.distributed.launch import spawn
from megarl.rollout import Samples
from megarl.trainer.balance import balanced_partition
from tests.test_trainer_e2e import _metrics, _train


# ------------------------------------------------------------------ (a) the partition
def _max_sum(lengths, parts):
    return max(sum(lengths[i] for i in p) for p in parts)


def test_partition_has_equal_counts_and_is_deterministic():
    lengths = [100, 90, 1, 2, 3, 4, 5, 6]
    parts = balanced_partition(lengths, 2)
    assert [len(p) for p in parts] == [4, 4]
    assert sorted(i for p in parts for i in p) == list(range(8))
    assert parts == balanced_partition(lengths, 2)
    # longest first: {100, 4, 2, 1} and {90, 6, 5, 3}; the optimum is 106 ({100, 1, 2, 3})
    assert _max_sum(lengths, parts) == 107
    with pytest.raises(ValueError, match="7 samples cannot be dealt equally to 2 ranks"):
        balanced_partition(lengths[:7], 2)


def test_partition_is_within_the_longest_first_bound_of_the_optimum():
    rng = random.Random(0)
    for _ in range(40):
        parts_n = rng.choice([2, 3])
        lengths = [rng.randint(1, 100) for _ in range(parts_n * rng.randint(2, 3))]
        got = _max_sum(lengths, balanced_partition(lengths, parts_n))
        size = len(lengths) // parts_n
        best = min(
            _max_sum(lengths, [perm[k * size : (k + 1) * size] for k in range(parts_n)])
            for perm in itertools.permutations(range(len(lengths)))
        )
        assert best <= got <= 4 / 3 * best + max(lengths) / size, (lengths, got, best)


def test_a_skewed_step_becomes_near_equal():
    # rank 0 drew the long responses, rank 1 the short ones (64 samples each)
    lengths = [400 + i for i in range(64)] + [20 + i % 7 for i in range(64)]
    parts = balanced_partition(lengths, 2)
    sums = [sum(lengths[i] for i in p) for p in parts]
    assert max(sums) / (sum(sums) / 2) < 1.01  # from 1.90 before
    assert [len(p) for p in parts] == [64, 64]


# ------------------------------------------------------------------ (b) the exchange
def _exchange(rank, world):
    import torch.distributed as dist

    from megarl.trainer.balance import balance_over_dp

    n = 6
    # rank 0's responses are long, rank 1's short; every field encodes the sample's identity
    uid = [rank * 100 + i for i in range(n)]
    resp_len = [(40 if rank == 0 else 3) + i for i in range(n)]
    rollout = Samples(
        prompt_index=list(range(n)),
        prompt_ids=[[u, u] for u in uid],
        response_ids=[[u] * k for u, k in zip(uid, resp_len, strict=True)],
        response_logprobs=[[-u / 1000] * k for u, k in zip(uid, resp_len, strict=True)],
        finish_reason=["stop" if u % 2 else "length" for u in uid],
        routed_experts=[
            np.full((k + 1, 2, 2), u % 7, dtype=np.uint8)
            for u, k in zip(uid, resp_len, strict=True)
        ],
    )
    rewards = torch.tensor([u / 7 for u in uid])
    group_ids = torch.tensor([rank * 3 + i // 2 for i in range(n)])
    positions = torch.tensor([rank * n + i for i in range(n)])
    out, r, g, pos, m = balance_over_dp(rollout, rewards, group_ids, positions, dist.group.WORLD)
    return out, r, g, pos, m


def test_the_exchange_moves_whole_samples_and_equalises_tokens():
    res = spawn(_exchange, 2)
    seen = []
    for out, rewards, group_ids, positions, metrics in res:
        assert len(out) == 6 and rewards.shape == (6,) and group_ids.shape == (6,)
        assert out.prompt_index == group_ids.tolist()
        for j in range(6):
            u = out.prompt_ids[j][0]
            seen.append(u)
            k = len(out.response_ids[j])
            assert out.response_ids[j] == [u] * k
            assert out.response_logprobs[j] == [-u / 1000] * k
            assert out.finish_reason[j] == ("stop" if u % 2 else "length")
            assert out.routed_experts[j].shape == (k + 1, 2, 2)
            assert (out.routed_experts[j] == u % 7).all()
            assert rewards[j] == torch.tensor(u / 7)
            rank, i = divmod(u, 100)
            assert group_ids[j] == rank * 3 + i // 2
            assert positions[j] == rank * 6 + i  # the sample's place travels with it
        assert metrics["dp_tokens_max_over_mean_before"] > 1.7
        assert metrics["dp_tokens_max_over_mean"] < 1.05
    assert sorted(seen) == [0, 1, 2, 3, 4, 5, 100, 101, 102, 103, 104, 105]
    assert res[0][4] == res[1][4]  # every rank logs the same figures


# ------------------------------------------------------------------ (c) end to end
# CI: the same invariance through the trainer's step functions, tests/test_metrics_global.py
@pytest.mark.slow
@pytest.mark.extended
def test_balancing_changes_no_global_figure_at_dp2(tmp_path):
    common = (
        "trainer.steps=1",
        "algorithm.mini_batches=1",
        "algorithm.ppo_epochs=1",
        "algorithm.micro_batch_size=16",
    )
    rows = {}
    for on in ("false", "true"):
        _train(tmp_path / on, *common, f"algorithm.balance_dp_tokens={on}", nproc=2)
        rows[on] = _metrics(tmp_path / on)[0]
    off, on = rows["false"], rows["true"]
    print(
        {
            k: (off.get(k), on.get(k))
            for k in (
                "reward_mean",
                "loss",
                "kl",
                "grad_norm",
                "dp_tokens_max_over_mean_before",
                "dp_tokens_max_over_mean",
            )
        }
    )
    assert "dp_tokens_max_over_mean" not in off
    assert on["dp_tokens_max_over_mean"] <= on["dp_tokens_max_over_mean_before"]
    for k in ("reward_mean", "reward_std", "response_len"):
        assert on[k] == off[k], k
    for k in ("loss", "kl", "logprob_mismatch", "grad_norm", "entropy"):
        assert on[k] == pytest.approx(off[k], rel=1e-5, abs=1e-7), k


def test_simulated_long_tailed_steps():
    """The figures in docs/algorithms.md: 64 prompts x 8 samples, per-prompt difficulty,
    log-normal response lengths capped at 4096 plus a 200-token prompt, 50 steps, seeded."""
    import statistics

    rng = random.Random(0)
    figures = {}
    for dp in (2, 8):
        before, after = [], []
        for _ in range(50):
            lengths = []
            for _p in range(64):
                mu = rng.gauss(6.5, 0.6)
                lengths += [min(4096, int(rng.lognormvariate(mu, 0.5))) + 200 for _ in range(8)]
            n = len(lengths) // dp
            for out, parts in (
                (before, [range(r * n, (r + 1) * n) for r in range(dp)]),
                (after, balanced_partition(lengths, dp)),
            ):
                sums = [sum(lengths[i] for i in p) for p in parts]
                out.append(max(sums) / (sum(sums) / dp))
        figures[dp] = (statistics.median(before), max(before), statistics.median(after))
    print(figures)
    assert figures[8][0] == pytest.approx(1.247, abs=5e-4) and figures[8][1] > 1.6
    assert figures[8][2] < 1.001 and figures[2][2] < 1.0001
