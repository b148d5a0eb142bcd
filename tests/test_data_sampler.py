"""Prompt sampler (epochs, DP shares, resume) and batch packing (collate, micro-batches)."""

from __future__ import annotations

import pytest
import torch

from megarl.data import MicroBatching, PromptSampler, collate, split_micro_batches


def _global_steps(n, p, steps, dp_size=1, seed=0, shuffle=True, state=None):
    """Each step's global prompt list, rebuilt from every rank's share (and checked against
    every rank's `last_global_indices`)."""
    samplers = [
        PromptSampler(n, prompts_per_step=p, dp_rank=r, dp_size=dp_size, seed=seed, shuffle=shuffle)
        for r in range(dp_size)
    ]
    if state is not None:
        for s in samplers:
            s.load_state_dict(state)
    out = []
    for _ in range(steps):
        shares = [s.next_step() for s in samplers]
        step = [i for share in shares for i in share]
        assert all(len(share) == p // dp_size for share in shares)
        for s in samplers:
            assert s.last_global_indices == step  # identical global order on every rank
            assert s.last_global_indices[s.rank_slice] == shares[s.dp_rank]
        out.append(step)
    return out, samplers[0]


@pytest.mark.parametrize("n,p,dp", [(55, 8, 2), (12, 8, 4), (9, 9, 3), (40, 8, 8)])
def test_every_prompt_once_per_epoch_and_steps_distinct(n, p, dp):
    steps, sampler = _global_steps(n, p, steps=7 * n // p + 3, dp_size=dp)
    stream = [i for s in steps for i in s]
    for e in range(len(stream) // n):
        assert sorted(stream[e * n : (e + 1) * n]) == list(range(n)), f"epoch {e}"
    for s in steps:
        assert len(set(s)) == p  # group ids of a step are distinct, even across epochs
    assert sampler.epoch == len(stream) // n and sampler.position == len(stream) % n


def test_order_is_seeded_permutation():
    (first,), _ = _global_steps(20, 4, steps=1, seed=3)
    import numpy as np

    assert first == np.random.default_rng(3).permutation(20)[:4].tolist()
    (a,), _ = _global_steps(20, 4, steps=1, seed=4)
    assert a != first
    plain, _ = _global_steps(10, 5, steps=3, shuffle=False)
    assert plain == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [0, 1, 2, 3, 4]]


@pytest.mark.parametrize("n,p", [(55, 8), (12, 8)])
def test_resume_mid_epoch_equals_uninterrupted(n, p):
    full, _ = _global_steps(n, p, steps=30, dp_size=2)
    head, sampler = _global_steps(n, p, steps=11, dp_size=2)
    state = sampler.state_dict()
    assert (state["epoch"], state["position"]) == divmod(11 * p, n)
    tail, _ = _global_steps(n, p, steps=19, dp_size=2, state=state)
    assert head + tail == full
    # a different DP size continues the same global sequence
    tail4, s4 = _global_steps(n, p, steps=19, dp_size=4, state=state)
    assert tail4 == full[11:]
    tail1, _ = _global_steps(n, p, steps=19, dp_size=1, state=state)
    assert tail1 == full[11:]
    assert s4.steps == 30


def test_sampler_errors():
    with pytest.raises(ValueError, match=r"prompts_per_step=6 .* 4 .*6 % 4 = 2"):
        PromptSampler(10, prompts_per_step=6, dp_size=4)
    with pytest.raises(ValueError, match="prompts_per_step=8 > 5"):
        PromptSampler(5, prompts_per_step=8)
    s = PromptSampler(10, prompts_per_step=2, seed=1)
    with pytest.raises(ValueError, match="seed=1.*seed=2"):
        PromptSampler(10, prompts_per_step=2, seed=2).load_state_dict(s.state_dict())


# ---------------------------------------------------------------- collate
def test_collate_positions_by_hand():
    pad = 0
    b = collate([[5, 6], [7, 8, 9]], [[10, 11, 12], [13]], pad)
    assert b["tokens"].tolist() == [[5, 6, 10, 11, 12], [7, 8, 9, 13, 0]]
    assert b["targets"].tolist() == [[6, 10, 11, 12, 0], [8, 9, 13, 0, 0]]
    assert b["loss_mask"].tolist() == [[0, 1, 1, 1, 0], [0, 0, 1, 0, 0]]
    assert b["loss_mask"].dtype == torch.float32
    assert b["prompt_len"].tolist() == [2, 3]
    assert b["response_len"].tolist() == [3, 1]
    assert b["seq_len"].tolist() == [5, 4]
    # every masked target is a response token, and every response token is a masked target
    for row, r in enumerate([[10, 11, 12], [13]]):
        assert b["targets"][row][b["loss_mask"][row].bool()].tolist() == r
    padded = collate([[1]], [[2, 3]], pad_id=7, pad_to_multiple=4)
    assert padded["tokens"].tolist() == [[1, 2, 3, 7]]
    assert padded["targets"].tolist() == [[2, 3, 7, 7]]
    assert padded["loss_mask"].tolist() == [[1, 1, 0, 0]]
    empty = collate([[1, 2]], [[]], pad_id=0)
    assert empty["loss_mask"].sum() == 0
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        collate([[1], []], [[2], [3]], 0)


def test_split_micro_batches_groups_by_length_and_trims_padding():
    prompts = [[1, 2], [3], [4, 5, 6], [7]]
    responses = [[9], [9, 9, 9, 9, 9], [9], [9]]
    b = collate(prompts, responses, pad_id=0)  # seq_len 3, 6, 4, 2 -> S = 6
    b["advantages"] = torch.arange(4.0)
    b["old_logprobs"] = torch.randn(4, 6)
    b["ids"] = ["a", "b", "c", "d"]
    micro = split_micro_batches(b, MicroBatching(size=2))
    # longest first: rows 1 (6), 2 (4) | 0 (3), 3 (2)
    assert [m["index"].tolist() for m in micro] == [[1, 2], [0, 3]]
    assert [m["tokens"].shape[1] for m in micro] == [6, 3]
    m1 = micro[1]
    assert m1["tokens"].tolist() == [[1, 2, 9], [7, 9, 0]]
    assert torch.equal(m1["old_logprobs"], b["old_logprobs"][[0, 3], :3])
    assert m1["advantages"].tolist() == [0.0, 3.0] and m1["ids"] == ["a", "d"]
    assert m1["loss_mask"].tolist() == b["loss_mask"][[0, 3], :3].tolist()
    # every row once, no masked position lost by trimming
    assert sorted(i for m in micro for i in m["index"].tolist()) == [0, 1, 2, 3]
    assert sum(m["loss_mask"].sum() for m in micro) == b["loss_mask"].sum()
    odd = split_micro_batches(b, MicroBatching(size=3))
    assert [m["index"].tolist() for m in odd] == [[0, 1, 2], [3]]
    assert odd[1]["tokens"].shape == (1, 2)
    b8 = collate(prompts, responses, pad_id=0, pad_to_multiple=4)
    by_row = split_micro_batches(b8, MicroBatching(size=1, pad_to=4))
    assert [m["tokens"].shape[1] for m in by_row] == [
        8,
        4,
        4,
        4,
    ]
    with pytest.raises(ValueError, match="not a multiple"):
        split_micro_batches(b, MicroBatching(size=2, pad_to=4))


def test_token_budget_closes_micro_batches():
    lengths = [10, 3, 7, 2, 9, 4]
    b = collate([[1]] * 6, [[5] * (n - 1) for n in lengths], pad_id=0)
    # budget 20 tokens: 10+9 -> 2 x 10 = 20 ok; + 7 -> 3 x 10 = 30 no; 7 4 -> 2 x 7 = 14,
    # + 3 -> 21 no; 3 2 -> 6
    micro = split_micro_batches(b, MicroBatching(size=8, max_tokens=20))
    assert [m["index"].tolist() for m in micro] == [[0, 4], [2, 5], [1, 3]]
    for m in micro:
        assert m["tokens"].numel() <= 20
    # a row longer than the budget gets a micro-batch of its own
    alone = split_micro_batches(b, MicroBatching(size=8, max_tokens=5))
    assert [m["index"].tolist() for m in alone][:2] == [
        [0],
        [4],
    ]
    # micro_batch_size still caps
    assert len(split_micro_batches(b, MicroBatching(size=2, max_tokens=1000))) == 3
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        split_micro_batches(b, MicroBatching(size=2, max_tokens=0))
