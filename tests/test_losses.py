"""Policy/value losses and aggregation against pinned numbers and plain-loop references."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algorithms.losses import (
    AGG_MODES,
    PolicyLossOptions,
    ValueLossOptions,
    aggregate,
    cispo_loss,
    get_policy_loss,
    global_denominators,
    policy_loss,
    register_policy_loss,
    value_loss,
)
from megarl.algorithms.off_policy import OffPolicyOptions


@pytest.fixture(autouse=True)
def _float64():
    """float64 so that references agree to ~1e-12; restored for the other test modules."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def _batch(seed: int = 0, b: int = 4, t: int = 5):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 2, 4, 1])[:b]
    mask = torch.arange(t)[None, :] < lengths[:, None]
    lp = -torch.rand(b, t, generator=g) * 2
    old = lp + 0.3 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, 1, generator=g).expand(b, t).clone()
    return lp, old, adv, mask


# ---------------------------------------------------------------- aggregation
def ref_aggregate(values, mask, mode, max_len=None):
    """Plain loops over the *global* batch: no shares, no external denominators."""
    rows = [
        [v for v, m in zip(vr, mr, strict=False) if m]
        for vr, mr in zip(values.tolist(), mask.tolist(), strict=False)
    ]
    nonempty = [r for r in rows if r]
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in nonempty) / len(nonempty)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in nonempty) / len(nonempty)
    return sum(sum(r) / max_len for r in nonempty) / len(nonempty)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_matches_reference(mode):
    values = torch.randn(5, 7, generator=torch.Generator().manual_seed(3))
    lengths = torch.tensor([7, 3, 0, 1, 5])  # one empty row: counts in no denominator
    mask = torch.arange(7)[None, :] < lengths[:, None]
    tokens, seqs = global_denominators([mask], group=None)
    assert (tokens, seqs) == (16.0, 4.0)
    got = aggregate(values, mask, mode, global_tokens=tokens, global_seqs=seqs, max_len=10)
    assert got.item() == pytest.approx(ref_aggregate(values, mask, mode, 10), rel=1e-12)


def test_aggregate_pinned():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    kw = {"global_tokens": 4, "global_seqs": 2, "max_len": 4}
    assert aggregate(values, mask, "token-mean", **kw).item() == 2.5
    assert aggregate(values, mask, "seq-mean-token-sum", **kw).item() == 5.0
    assert aggregate(values, mask, "seq-mean-token-mean", **kw).item() == 3.0
    assert aggregate(values, mask, "seq-mean-token-sum-norm", **kw).item() == 1.25


def test_aggregate_errors():
    v, m = torch.ones(2, 2), torch.ones(2, 2)
    with pytest.raises(ValueError, match="needs global_tokens"):
        aggregate(v, m, "token-mean", global_seqs=2)
    with pytest.raises(ValueError, match="needs global_seqs"):
        aggregate(v, m, "seq-mean-token-mean", global_tokens=4)
    with pytest.raises(ValueError, match="needs max_len"):
        aggregate(v, m, "seq-mean-token-sum-norm", global_seqs=2)
    with pytest.raises(ValueError, match=r"agg_mode must be one of \['token-mean'"):
        aggregate(v, m, "mean")
    with pytest.raises(ValueError, match="must be > 0"):
        aggregate(v, m, "token-mean", global_tokens=0)


# ---------------------------------------------------------------- policy loss
def ref_weight(old, sampler, mask, b, t, kind, low, high):
    """The off-policy weight of token (b, t) in plain python (megarl.algorithms.off_policy)."""
    if kind == "none":
        return 1.0
    if kind == "mis":
        rho = math.exp(sum(old[b][u] - sampler[b][u] for u in range(len(old[b])) if mask[b][u]))
        return rho if rho <= high else 0.0
    k = math.exp(old[b][t] - sampler[b][t])
    if kind == "tis":
        return min(k, high)
    if kind == "icepop":
        return k if low <= k <= high else 0.0
    return k if k <= high else 0.0  # decoupled


def ref_token_loss(lp, old, adv, mask, sampler, *, clip_low, clip_high, dual_clip, correction):
    """Per-token PPO loss in plain python: [B][T] lists (0 outside the mask)."""
    out = []
    for b in range(len(lp)):
        row = []
        for t in range(len(lp[b])):
            if not mask[b][t]:
                row.append(0.0)
                continue
            ratio = math.exp(lp[b][t] - old[b][t])
            a = adv[b][t]
            loss = max(-a * ratio, -a * min(max(ratio, 1 - clip_low), 1 + clip_high))
            if dual_clip is not None and a < 0:
                loss = min(loss, -a * dual_clip)
            loss *= ref_weight(old, sampler, mask, b, t, *correction)
            row.append(loss)
        out.append(row)
    return torch.tensor(out)


@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize(
    "correction",
    [
        ("none", 0.5, 2.0),
        ("tis", 0.5, 2.0),
        ("icepop", 0.8, 1.5),
        ("mis", 0.5, 3.0),
        ("decoupled", 0.5, 1.5),
    ],
)
@pytest.mark.parametrize("clips", [(0.2, 0.2), (0.2, 0.28)])
def test_ppo_matches_reference(dual_clip, correction, clips):
    lp, old, adv, mask = _batch()
    old = lp + 0.8 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(9))
    # mis needs some sequences under its cap: a smaller gap there
    scale = 0.1 if correction[0] == "mis" else 0.5
    sampler = old + scale * torch.randn(lp.shape, generator=torch.Generator().manual_seed(4))
    per_token = ref_token_loss(
        lp.tolist(),
        old.tolist(),
        adv.tolist(),
        mask.tolist(),
        sampler.tolist(),
        clip_low=clips[0],
        clip_high=clips[1],
        dual_clip=dual_clip,
        correction=correction,
    )
    kind, low, high = correction
    loss, metrics = policy_loss(
        lp,
        old,
        adv,
        mask,
        PolicyLossOptions(
            clip_low=clips[0],
            clip_high=clips[1],
            dual_clip=dual_clip,
            off_policy=OffPolicyOptions(kind=kind, low=low, high=high),
        ),
        sampler_logprobs=sampler,
        global_tokens=mask.sum().item(),
    )
    exp = ref_aggregate(per_token, mask, "token-mean")
    assert loss.item() == pytest.approx(exp, rel=1e-12)
    ratio = torch.exp(lp - old)[mask]
    assert metrics["ratio_max"].item() == pytest.approx(ratio.max().item(), rel=1e-12)
    assert metrics["ratio_mean"].item() == pytest.approx(ratio.mean().item(), rel=1e-12)
    if dual_clip is not None:
        assert "dual_clip_frac" in metrics
    assert "mismatch_kl" in metrics and ("is_weight_mean" in metrics) == (kind != "none")


def test_ppo_pinned_clipping():
    # one sequence, 3 tokens; ratios e^{0.5}, 1, e^{-0.5}; A = +1 then -1
    lp = torch.tensor([[0.5, 0.0, -0.5]])
    old = torch.zeros(1, 3)
    mask = torch.ones(1, 3)
    opts = PolicyLossOptions()
    pos, m_pos = policy_loss(lp, old, torch.ones(1, 3), mask, opts, global_tokens=3)
    # A>0: token0 clipped to 1.2, token1 1.0, token2 unclipped e^{-0.5} (min picks it)
    assert pos.item() == pytest.approx(-(1.2 + 1.0 + math.exp(-0.5)) / 3, rel=1e-12)
    assert m_pos["clip_frac"].item() == pytest.approx(1 / 3)
    neg, _m_neg = policy_loss(lp, old, -torch.ones(1, 3), mask, opts, global_tokens=3)
    # A<0: token0 unclipped e^{0.5}, token1 1.0, token2 clipped to 0.8
    assert neg.item() == pytest.approx((math.exp(0.5) + 1.0 + 0.8) / 3, rel=1e-12)
    # dual clip at 1.5 caps token0's e^{0.5} = 1.65 at 1.5
    dual_opts = PolicyLossOptions(dual_clip=1.5)
    dual, m_dual = policy_loss(lp, old, -torch.ones(1, 3), mask, dual_opts, global_tokens=3)
    assert dual.item() == pytest.approx((1.5 + 1.0 + 0.8) / 3, rel=1e-12)
    assert m_dual["dual_clip_frac"].item() == pytest.approx(1 / 3)
    # clip-higher 0.7: token0's ratio 1.65 is no longer clipped for A>0
    hi_opts = PolicyLossOptions(clip_high=0.7)
    hi, _ = policy_loss(lp, old, torch.ones(1, 3), mask, hi_opts, global_tokens=3)
    assert hi.item() == pytest.approx(-(math.exp(0.5) + 1.0 + math.exp(-0.5)) / 3, rel=1e-12)


def test_gspo_matches_sequence_objective():
    """GSPO-token with seq-mean-token-mean has the value and gradient of the GSPO objective
    (1/B) sum_b max(-A s_b, -A clip(s_b)),  s_b = exp(mean_t (lp - old))."""
    lp, old, adv, mask = _batch(seed=5)
    old = lp + 0.05 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(2))
    lp1 = lp.clone().requires_grad_(True)
    loss, _ = get_policy_loss("gspo")(
        lp1, old, adv, mask, PolicyLossOptions(agg_mode="seq-mean-token-mean"), global_seqs=4
    )
    loss.backward()
    lp2 = lp.clone().requires_grad_(True)
    m = mask.double()
    s = torch.exp(((lp2 - old) * m).sum(-1) / m.sum(-1))
    a = adv[:, 0]
    ref = torch.maximum(-a * s, -a * s.clamp(0.8, 1.2)).mean()
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    torch.testing.assert_close(lp1.grad, lp2.grad, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------- CISPO
def ref_agg_weights(mask, mode, max_len=None):
    """d aggregate / d value of each token [B][T], in plain python over the global batch."""
    lengths = [sum(1 for m in row if m) for row in mask]
    seqs = sum(1 for n in lengths if n)
    per_row = {
        "token-mean": lambda n: 1 / sum(lengths),
        "seq-mean-token-sum": lambda n: 1 / seqs,
        "seq-mean-token-mean": lambda n: 1 / (n * seqs),
        "seq-mean-token-sum-norm": lambda n: 1 / (max_len * seqs),
    }[mode]
    return [[per_row(n) if m else 0.0 for m in row] for row, n in zip(mask, lengths, strict=True)]


def ref_cispo(lp, old, adv, mask, sampler, ref, entropy, *, low, high, correction, coefs, mode):
    """CISPO's loss and its gradient by lp in plain python, derived by hand: with the detached
    weight w = clip(exp(lp - old), 1 - low, 1 + high) and the off-policy weight c, a token's
    loss is -c w A lp (+ the k1 KL kl_coef (lp - ref), - entropy_coef H), so its gradient is
    -c w A (+ kl_coef), times the token's weight in the aggregate."""
    entropy_coef, kl_coef = coefs
    agg_w = ref_agg_weights(mask, mode, max_len=7)
    loss, grad, clipped = 0.0, [], 0
    for b in range(len(lp)):
        row = []
        for t in range(len(lp[b])):
            if not mask[b][t]:
                row.append(0.0)
                continue
            ratio = math.exp(lp[b][t] - old[b][t])
            w = min(max(ratio, 1 - low), 1 + high)
            clipped += w != ratio
            c = ref_weight(old, sampler, mask, b, t, *correction)
            value = -c * w * adv[b][t] * lp[b][t]
            value += kl_coef * (lp[b][t] - ref[b][t]) - entropy_coef * entropy[b][t]
            loss += agg_w[b][t] * value
            row.append(agg_w[b][t] * (-c * w * adv[b][t] + kl_coef))
        grad.append(row)
    return loss, torch.tensor(grad), clipped / sum(sum(1 for m in row if m) for row in mask)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("correction", [("none", 0.5, 2.0), ("tis", 0.5, 2.0), ("mis", 0.5, 3.0)])
@pytest.mark.parametrize("clips", [(1.0, 4.0), (0.2, 0.28), (0.0, 0.5)])
def test_cispo_matches_reference(mode, correction, clips):
    """Value and gradient of CISPO (with off-policy weights, entropy and a k1 KL term) against
    the hand-derived plain-python reference, at three clip ranges and every aggregation."""
    lp, _old, _adv, mask = _batch(seed=7)
    g = torch.Generator().manual_seed(11)
    old = lp + 1.2 * torch.randn(lp.shape, generator=g)  # ratios e^{+-2.4}: both bounds bite
    adv = torch.randn(lp.shape, generator=g)  # per-token, both signs
    scale = 0.1 if correction[0] == "mis" else 0.5
    sampler = old + scale * torch.randn(lp.shape, generator=g)
    ref, entropy = lp - 0.3 * torch.rand(lp.shape, generator=g), torch.rand(lp.shape, generator=g)
    kind, low, high = correction
    opts = PolicyLossOptions(
        cispo_clip_low=clips[0],
        cispo_clip_high=clips[1],
        agg_mode=mode,
        off_policy=OffPolicyOptions(kind=kind, low=low, high=high),
        entropy_coef=0.01,
        kl_coef=0.1,
        kl_kind="k1",
    )
    tokens, seqs = global_denominators([mask])
    x = lp.clone().requires_grad_(True)
    loss, metrics = get_policy_loss("cispo")(
        x,
        old,
        adv,
        mask,
        opts,
        global_tokens=tokens,
        global_seqs=seqs,
        max_len=7,
        sampler_logprobs=sampler,
        entropy=entropy,
        ref_logprobs=ref,
    )
    loss.backward()
    lists = (t.tolist() for t in (lp, old, adv, mask, sampler, ref, entropy))
    exp_loss, exp_grad, exp_clip_frac = ref_cispo(
        *lists, low=clips[0], high=clips[1], correction=correction, coefs=(0.01, 0.1), mode=mode
    )
    assert 0 < exp_clip_frac < 1  # some weights clipped, some not: both branches are checked
    assert loss.item() == pytest.approx(exp_loss, rel=1e-12)
    torch.testing.assert_close(x.grad, exp_grad, rtol=1e-12, atol=1e-15)
    assert metrics["clip_frac"].item() == pytest.approx(exp_clip_frac, rel=1e-12)
    ratio = torch.exp(lp - old)[mask]
    assert metrics["ratio_max"].item() == pytest.approx(ratio.max().item(), rel=1e-12)
    assert metrics["ratio_mean"].item() == pytest.approx(ratio.mean().item(), rel=1e-12)
    assert ("is_weight_mean" in metrics) == (kind != "none") and "dual_clip_frac" not in metrics


def test_cispo_keeps_the_gradient_of_a_clipped_token():
    """The defining property: a token whose ratio is out of range keeps the gradient of its
    logprob, scaled by the clipped weight, where PPO's gradient there is 0."""
    # one sequence, 3 tokens; ratios e^{0.5} = 1.65, 1, e^{-0.5} = 0.61; both clip to [0.8, 1.2]
    lp = torch.tensor([[0.5, 0.0, -0.5]])
    old, mask = torch.zeros(1, 3), torch.ones(1, 3)
    cispo = PolicyLossOptions(cispo_clip_low=0.2, cispo_clip_high=0.2)
    ppo = PolicyLossOptions(clip_low=0.2, clip_high=0.2)
    for sign in (1.0, -1.0):
        adv = sign * torch.ones(1, 3)
        grads = {}
        for name, opts in (("cispo", cispo), ("ppo", ppo)):
            x = lp.clone().requires_grad_(True)
            loss, _ = get_policy_loss(name)(x, old, adv, mask, opts, global_tokens=3)
            loss.backward()
            grads[name] = x.grad[0].tolist()
        # weights 1.2, 1, 0.8: d(-w A lp)/d lp / 3 tokens
        assert grads["cispo"] == pytest.approx([-sign * 1.2 / 3, -sign / 3, -sign * 0.8 / 3])
        clipped_token = 0 if sign > 0 else 2  # PPO clips r > 1.2 for A > 0, r < 0.8 for A < 0
        assert grads["ppo"][clipped_token] == 0.0
        assert grads["cispo"][clipped_token] != 0.0
    # A = -1: -(-1) (1.2 * 0.5 + 1 * 0 + 0.8 * -0.5) / 3; both out-of-range weights count
    value, m = cispo_loss(lp, old, -torch.ones(1, 3), mask, cispo, global_tokens=3)
    assert value.item() == pytest.approx((1.2 * 0.5 - 0.8 * 0.5) / 3, rel=1e-12)
    assert m["clip_frac"].item() == pytest.approx(2 / 3)
    assert m["ratio_max"].item() == pytest.approx(math.exp(0.5), rel=1e-12)


def test_cispo_gradient_is_ppos_where_nothing_is_clipped():
    """Inside the clip range CISPO's gradient -w A d lp is PPO's -A r d lp: the two differ
    only where a weight is clipped."""
    lp, old, adv, mask = _batch(seed=3)
    grads = []
    wide = {"cispo": PolicyLossOptions(), "ppo": PolicyLossOptions(clip_low=0.99, clip_high=50.0)}
    for name, opts in wide.items():
        x = lp.clone().requires_grad_(True)
        loss, metrics = get_policy_loss(name)(x, old, adv, mask, opts, global_tokens=12)
        loss.backward()
        assert metrics["clip_frac"].item() == 0.0
        grads.append(x.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-15)


def test_entropy_and_kl_terms():
    lp, old, adv, mask = _batch()
    ref_lp = lp - 0.1
    entropy = torch.rand(lp.shape, generator=torch.Generator().manual_seed(1))
    kw = {"global_tokens": mask.sum().item()}
    base, _ = policy_loss(lp, old, adv, mask, PolicyLossOptions(), **kw)
    loss, metrics = policy_loss(
        lp,
        old,
        adv,
        mask,
        PolicyLossOptions(entropy_coef=0.01, kl_coef=0.1, kl_kind="k1"),
        entropy=entropy,
        ref_logprobs=ref_lp,
        **kw,
    )
    # k1 = lp - ref = 0.1 on every token
    exp = base.item() - 0.01 * entropy[mask].mean().item() + 0.1 * 0.1
    assert loss.item() == pytest.approx(exp, rel=1e-12)
    assert metrics["kl"].item() == pytest.approx(0.1, rel=1e-12)
    assert metrics["entropy"].item() == pytest.approx(entropy[mask].mean().item(), rel=1e-12)


def test_policy_loss_errors():
    lp, old, adv, mask = _batch()
    kw = {"global_tokens": 10}
    with pytest.raises(ValueError, match="ratio_level"):
        policy_loss(lp, old, adv, mask, PolicyLossOptions(ratio_level="seq"), **kw)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        policy_loss(lp, old, adv, mask, PolicyLossOptions(dual_clip=0.5), **kw)
    with pytest.raises(ValueError, match="sampler_logprobs"):
        policy_loss(
            lp, old, adv, mask, PolicyLossOptions(off_policy=OffPolicyOptions(kind="tis")), **kw
        )
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(lp, old, adv, mask, PolicyLossOptions(kl_coef=0.1), **kw)
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(lp, old, adv, mask, PolicyLossOptions(entropy_coef=0.1), **kw)
    with pytest.raises(ValueError, match="needs global_tokens"):
        policy_loss(lp, old, adv, mask, PolicyLossOptions())
    with pytest.raises(ValueError, match="dual_clip=3.0 is PPO's cap.*set it to None"):
        cispo_loss(lp, old, adv, mask, PolicyLossOptions(dual_clip=3.0), **kw)
    for bad in ({"cispo_clip_low": 1.5}, {"cispo_clip_low": -0.1}, {"cispo_clip_high": 0.0}):
        with pytest.raises(ValueError, match=r"accepted: 0 <= cispo_clip_low <= 1 and cispo_cl"):
            cispo_loss(lp, old, adv, mask, PolicyLossOptions(**bad), **kw)
    with pytest.raises(ValueError, match="sampler_logprobs"):
        cispo_loss(
            lp, old, adv, mask, PolicyLossOptions(off_policy=OffPolicyOptions(kind="tis")), **kw
        )


def test_policy_loss_registry():
    lp, old, adv, mask = _batch()
    a, _ = get_policy_loss("ppo")(lp, old, adv, mask, PolicyLossOptions(), global_tokens=12)
    b, _ = policy_loss(lp, old, adv, mask, PolicyLossOptions(), global_tokens=12)
    assert a.item() == b.item()
    with pytest.raises(ValueError, match=r"unknown policy loss 'grpo'.*'gspo', 'ppo'"):
        get_policy_loss("grpo")
    with pytest.raises(ValueError, match="registered twice"):
        register_policy_loss("ppo")(policy_loss)


@pytest.mark.parametrize("loss_name", ["ppo", "cispo"])
def test_empty_mask_is_finite(loss_name):
    lp, old, adv, _ = _batch()
    mask = torch.zeros_like(lp, dtype=torch.bool)
    opts = PolicyLossOptions()
    loss, metrics = get_policy_loss(loss_name)(lp, old, adv, mask, opts, global_tokens=5)
    assert loss.item() == 0.0
    assert all(torch.isfinite(v) for v in metrics.values())


# ---------------------------------------------------------------- value loss
def test_value_loss_pinned():
    values = torch.tensor([[1.0, 0.0, 2.0]])
    old = torch.tensor([[0.5, 0.0, 2.0]])
    returns = torch.tensor([[0.0, 1.0, 2.0]])
    mask = torch.tensor([[1, 1, 0]])
    # token0: unclipped (1-0)^2 = 1, clipped V=0.7 -> 0.49, max 1; token1: 1 and 1
    clip, no_clip = ValueLossOptions(clip=0.2), ValueLossOptions(clip=None)
    loss, _m = value_loss(values, old, returns, mask, clip, global_tokens=2)
    assert loss.item() == pytest.approx(0.5 * (1 + 1) / 2)
    # token0 with V moving toward the target: V=0.1 from old 0.5 -> clipped 0.3, err 0.09 vs 0.01
    loss2, m2 = value_loss(values - 0.9, old, returns, mask, clip, global_tokens=2)
    assert loss2.item() == pytest.approx(0.5 * (0.09 + (1 + 0.9) ** 2) / 2)
    assert m2["vf_clip_frac"].item() == pytest.approx(0.5)
    loss3, _ = value_loss(values - 0.9, old, returns, mask, no_clip, global_tokens=2)
    assert loss3.item() == pytest.approx(0.5 * (0.01 + 1.9**2) / 2)


def test_outcome_advantages_broadcast():
    lp, old, adv, mask = _batch()
    per_token, _ = policy_loss(lp, old, adv, mask, PolicyLossOptions(), global_tokens=12)
    per_seq, _ = policy_loss(lp, old, adv[:, 0], mask, PolicyLossOptions(), global_tokens=12)
    assert per_seq.item() == per_token.item()


@pytest.mark.parametrize("loss_name", ["ppo", "gspo", "cispo"])
def test_garbage_in_padding_does_not_leak(loss_name):
    """Padding may hold -inf logprobs or NaN values; masked math must ignore it (NaN * 0 = NaN)."""
    lp, old, adv, mask = _batch()
    dirty = lp.masked_fill(~mask, float("-inf"))
    dirty_old = old.masked_fill(~mask, float("nan"))
    dirty_ent = torch.rand(lp.shape).masked_fill(~mask, float("nan"))
    opts = PolicyLossOptions(entropy_coef=0.01, kl_coef=0.1, agg_mode="seq-mean-token-mean")
    kw = {"global_tokens": 12, "ref_logprobs": old, "global_seqs": 4}
    results = []
    for a, b, e in ((lp, old, dirty_ent.nan_to_num(0.0)), (dirty, dirty_old, dirty_ent)):
        x = a.clone().requires_grad_(True)
        loss, metrics = get_policy_loss(loss_name)(x, b, adv, mask, opts, entropy=e, **kw)
        loss.backward()
        results.append((loss, x.grad))
        assert all(torch.isfinite(v) for v in metrics.values()), metrics
    assert results[0][0].item() == results[1][0].item()
    assert torch.equal(results[0][1], results[1][1])
    v, _ = value_loss(
        lp.masked_fill(~mask, float("nan")), old, old, mask, ValueLossOptions(), global_tokens=12
    )
    assert torch.isfinite(v)
