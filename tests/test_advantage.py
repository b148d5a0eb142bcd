"""Outcome advantage estimators and GAE against pinned numbers and plain-loop references."""

from __future__ import annotations

import math
import random

import pytest
import torch

from megarl.advantage import (
    Advantage,
    DrGRPOAdvantage,
    GRPOAdvantage,
    ReinforcePlusPlusAdvantage,
    RLOOAdvantage,
    compute_gae,
    get_advantage,
    register_advantage,
    whiten,
)

EPS = 1e-8
REWARDS = [0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0]


# ---------------------------------------------------------------- plain-python references
def _mean(xs):
    return sum(xs) / len(xs)


def _std(xs):
    if len(xs) < 2:
        return 0.0
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def ref_grpo(r, g, scale, eps=EPS):
    if g == 1:
        if scale == "group":
            return list(r)
        m, s = _mean(r), _std(r)
        return [(x - m) / (s + eps) if scale == "batch" else x - m for x in r]
    out = []
    batch_std = _std(r)
    for start in range(0, len(r), g):
        grp = r[start : start + g]
        m, s = _mean(grp), _std(grp)
        for x in grp:
            denom = {"group": s + eps, "batch": batch_std + eps, "none": 1.0}[scale]
            out.append((x - m) / denom)
    return out


def ref_rloo(r, g, scale, eps=EPS):
    out = []
    batch_std = _std(r)
    for start in range(0, len(r), g):
        grp = r[start : start + g]
        total, s = sum(grp), _std(grp)
        for x in grp:
            adv = x - (total - x) / (g - 1)
            denom = {"group": s + eps, "batch": batch_std + eps, "none": 1.0}[scale]
            out.append(adv / denom)
    return out


def ref_reinforce_pp(r, g, scale, eps=EPS):
    a = []
    for start in range(0, len(r), g):
        grp = r[start : start + g]
        m = _mean(grp) if g > 1 else 0.0
        a.extend(x - m for x in grp)
    m, s = _mean(a), _std(a)
    return [(x - m) / (1.0 if scale == "none" else s + eps) for x in a]


REFERENCES = {
    "grpo": ref_grpo,
    "rloo": ref_rloo,
    "reinforce++": ref_reinforce_pp,
    "dr_grpo": lambda r, g, scale, eps=EPS: ref_grpo(r, g, "none", eps),
}


def random_rewards(rng: random.Random, n_groups: int, g: int) -> list[float]:
    """Mix of continuous, binary and constant groups."""
    out = []
    for i in range(n_groups):
        kind = i % 3
        if kind == 0:
            out.extend(rng.gauss(0.3, 2.0) for _ in range(g))
        elif kind == 1:
            out.extend(float(rng.random() < 0.4) for _ in range(g))
        else:
            out.extend([rng.uniform(-1, 1)] * g)
    return out


# ---------------------------------------------------------------- pinned numbers
def test_worked_example_none():
    grpo = GRPOAdvantage()(REWARDS, num_generations=4, scale="none")
    rloo = RLOOAdvantage()(REWARDS, num_generations=4, scale="none")
    assert grpo.tolist() == [-0.5, 0.5, -0.5, 0.5, 0.75, -0.25, -0.25, -0.25]
    third = 1 / 3
    expected = [
        -2 * third,
        2 * third,
        -2 * third,
        2 * third,
        1.0,
        -third,
        -third,
        -third,
    ]
    torch.testing.assert_close(rloo, torch.tensor(expected), rtol=0, atol=1e-7)


def test_worked_example_group_default():
    # group 1: std([0,1,0,1]) = sqrt(1/3); group 2: std([1,0,0,0]) = 0.5
    s1 = math.sqrt(1 / 3)
    grpo = GRPOAdvantage()(REWARDS, num_generations=4)
    rloo = RLOOAdvantage()(REWARDS, num_generations=4)
    exp_grpo = [x / (s1 + EPS) for x in (-0.5, 0.5, -0.5, 0.5)] + [
        x / (0.5 + EPS) for x in (0.75, -0.25, -0.25, -0.25)
    ]
    exp_rloo = [x / (s1 + EPS) for x in (-2 / 3, 2 / 3, -2 / 3, 2 / 3)] + [
        x / (0.5 + EPS) for x in (1.0, -1 / 3, -1 / 3, -1 / 3)
    ]
    torch.testing.assert_close(grpo, torch.tensor(exp_grpo), rtol=1e-6, atol=0)
    torch.testing.assert_close(rloo, torch.tensor(exp_rloo), rtol=1e-6, atol=0)
    assert grpo[4].item() == pytest.approx(1.5, rel=1e-6)
    assert rloo[4].item() == pytest.approx(2.0, rel=1e-6)


def test_worked_example_batch():
    # std of all 8 rewards (3 ones): sqrt((3 * (5/8)^2 + 5 * (3/8)^2) / 7) = sqrt(15/56)
    sb = math.sqrt(15 / 56)
    grpo = GRPOAdvantage()(REWARDS, num_generations=4, scale="batch")
    exp = [x / (sb + EPS) for x in (-0.5, 0.5, -0.5, 0.5, 0.75, -0.25, -0.25, -0.25)]
    torch.testing.assert_close(grpo, torch.tensor(exp), rtol=1e-6, atol=0)


def test_g1_semantics():
    r = torch.tensor([1.0, 2.0, 4.0])
    assert torch.equal(GRPOAdvantage()(r, 1, "group"), r)  # unchanged, no baseline
    torch.testing.assert_close(GRPOAdvantage()(r, 1, "none"), r - 7 / 3)
    std = math.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2)
    torch.testing.assert_close(GRPOAdvantage()(r, 1, "batch"), (r - 7 / 3) / (std + EPS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce++", "dr_grpo"])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_constant_groups_give_exact_zero(name, scale, dtype):
    # 0.7 is not representable: a naive float mean of 8 copies misses it by one ulp
    r = torch.tensor([0.7] * 8 + [0.1] * 8 + [3.3] * 8, dtype=dtype)
    adv = get_advantage(name)(r, 8, scale)
    assert torch.equal(adv, torch.zeros(24, dtype=dtype)), adv


# ---------------------------------------------------------------- against references
@pytest.mark.parametrize(
    "name,g",
    [(n, g) for n in REFERENCES for g in (1, 2, 3, 4, 8, 16) if not (n == "rloo" and g == 1)],
)
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_matches_reference(name, scale, g):
    rng = random.Random(f"{name}-{scale}-{g}")
    for n_groups in (1, 2, 7):
        r = random_rewards(rng, n_groups, g)
        got = get_advantage(name)(torch.tensor(r, dtype=torch.float64), g, scale)
        exp = torch.tensor(REFERENCES[name](r, g, scale), dtype=torch.float64)
        # near-constant groups amplify rounding by 1/eps, so compare with an absolute floor
        torch.testing.assert_close(got, exp, rtol=1e-9, atol=1e-6)


def test_float32_close_to_reference():
    rng = random.Random(0)
    r = [rng.gauss(0, 1) for _ in range(64)]
    for name, ref in REFERENCES.items():
        got = get_advantage(name)(torch.tensor(r), 8, "group")
        assert got.dtype == torch.float32
        exp = torch.tensor(ref(r, 8, "group"), dtype=torch.float32)
        torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-5)


def test_dr_grpo_forces_none():
    r = torch.randn(16, dtype=torch.float64)
    for scale in ("group", "batch", "none"):
        assert torch.equal(DrGRPOAdvantage()(r, 4, scale), GRPOAdvantage()(r, 4, "none"))


def test_reinforce_pp_is_whitened():
    r = torch.randn(64, dtype=torch.float64)
    a = ReinforcePlusPlusAdvantage()(r, 8, "batch")
    assert abs(a.mean().item()) < 1e-12
    assert a.std().item() == pytest.approx(1.0, rel=1e-6)


# ---------------------------------------------------------------- inputs and errors
def test_input_forms():
    t = torch.tensor(REWARDS)
    ref = GRPOAdvantage()(t, 4)
    assert torch.equal(GRPOAdvantage()(REWARDS, 4), ref)
    two_components = torch.stack([t * 0.25, t * 0.75], dim=1)  # [B, K] summed over K
    assert torch.equal(GRPOAdvantage()(two_components, 4), ref)
    assert GRPOAdvantage()(torch.tensor([0, 1, 1, 0]), 2).dtype == torch.float32
    assert GRPOAdvantage()(t.double(), 4).dtype == torch.float64
    assert GRPOAdvantage()([], 4).numel() == 0


def test_errors():
    with pytest.raises(ValueError, match=r"B=6.*G=4"):
        GRPOAdvantage()([0.0] * 6, 4)
    with pytest.raises(ValueError, match=r"\['group', 'batch', 'none'\].*'std'"):
        GRPOAdvantage()(REWARDS, 4, "std")
    with pytest.raises(ValueError, match="num_generations must be an int >= 2"):
        RLOOAdvantage()([1.0, 2.0], 1)
    with pytest.raises(ValueError, match="shape"):
        GRPOAdvantage()(torch.zeros(2, 2, 2), 2)
    with pytest.raises(TypeError):
        GRPOAdvantage()(REWARDS, 4, "group", 1e-6)  # eps is keyword-only


def test_rloo_needs_two():
    with pytest.raises(ValueError, match="rloo"):
        get_advantage("rloo")([1.0, 2.0, 3.0], 1, "none")


def test_registry():
    assert isinstance(get_advantage("grpo"), GRPOAdvantage)
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'ppo'.*'grpo'"):
        get_advantage("ppo")
    with pytest.raises(ValueError, match="registered twice"):

        @register_advantage("grpo")
        class Other(Advantage):
            pass


# ---------------------------------------------------------------- GAE
def ref_gae(rewards, values, lengths, gamma, lam):
    adv, ret = [], []
    for r, v, n in zip(rewards, values, lengths, strict=False):
        a_row = [0.0] * len(r)
        last = 0.0
        for t in reversed(range(n)):
            next_v = v[t + 1] if t + 1 < n else 0.0
            delta = r[t] + gamma * next_v - v[t]
            last = delta + gamma * lam * last
            a_row[t] = last
        adv.append(a_row)
        ret.append([a_row[t] + v[t] if t < n else 0.0 for t in range(len(r))])
    return adv, ret


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_matches_reference(gamma, lam):
    g = torch.Generator().manual_seed(1)
    lengths = [5, 1, 8, 3]
    r = torch.randn(4, 8, generator=g, dtype=torch.float64)
    v = torch.randn(4, 8, generator=g, dtype=torch.float64)
    mask = torch.tensor([[t < n for t in range(8)] for n in lengths])
    adv, ret = compute_gae(r, v, mask, gamma, lam)
    exp_adv, exp_ret = ref_gae(r.tolist(), v.tolist(), lengths, gamma, lam)
    torch.testing.assert_close(adv, torch.tensor(exp_adv, dtype=torch.float64))
    torch.testing.assert_close(ret, torch.tensor(exp_ret, dtype=torch.float64))
    assert torch.equal(adv[~mask], torch.zeros_like(adv[~mask]))


def test_gae_outcome_reward_pinned():
    # a single terminal reward 1, zero values, gamma = lam = 1: every token's advantage is 1
    r = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    adv, ret = compute_gae(r, torch.zeros_like(r), mask, 1.0, 1.0)
    assert adv.tolist() == [[1.0, 1.0, 1.0, 0.0]]
    assert ret.tolist() == [[1.0, 1.0, 1.0, 0.0]]


def test_whiten():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    w = whiten(x, mask)
    valid = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0], dtype=torch.float64)
    exp = (valid - 3.0) / math.sqrt(valid.var().item() + EPS)
    torch.testing.assert_close(w[mask.bool()], exp)
    assert w[0, 3].item() == 0.0


def test_independent_of_thread_count():
    """Ranks and the reference may run with different intra-op thread counts; the estimators'
    reductions (rows and whole-batch) must round identically (`advantages._sum`)."""
    r = torch.randn(200_000, generator=torch.Generator().manual_seed(0))
    before = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append([get_advantage(e)(r, 8, "batch") for e in REFERENCES])
            outs[-1].append(GRPOAdvantage()(r.view(-1, 100_000).T.reshape(-1), 2, "group"))
    finally:
        torch.set_num_threads(before)
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other, strict=False))
