"""KL estimators: pinned values, clamping, unbiasedness of k1/k3, reward-penalty form."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algorithms.kl import apply_kl_penalty, kl_penalty


def test_pinned_values():
    lp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -1.0, -0.5]], dtype=torch.float64)
    d = [-0.5, 1.0, 0.0]  # ref - lp
    expected = {
        "k1": [0.5, -1.0, 0.0],
        "abs": [0.5, 1.0, 0.0],
        "k2": [0.125, 0.5, 0.0],
        "k3": [math.exp(x) - x - 1 for x in d],
    }
    for kind, exp in expected.items():
        got = kl_penalty(lp, ref, kind)
        torch.testing.assert_close(got, torch.tensor([exp], dtype=torch.float64))


def test_k3_nonnegative_and_clamped():
    lp = torch.zeros(1, 4)
    ref = torch.tensor([[-50.0, -3.0, 3.0, 50.0]])
    k3 = kl_penalty(lp, ref, "k3")
    # d = -50 -> clamped to -20: e^-20 + 19 -> 10; d = +/-3 and 50: e^3 - 4 = 16.1 -> 10
    torch.testing.assert_close(k3, torch.tensor([[10.0, math.exp(-3) + 2, 10.0, 10.0]]))


def test_k1_k3_unbiased_for_kl():
    """With y ~ q (the policy), E[k1] = E[k3] = KL(q || p); k3 has the lower variance."""
    g = torch.Generator().manual_seed(0)
    q = torch.softmax(torch.randn(6, generator=g, dtype=torch.float64), 0)
    p = torch.softmax(torch.randn(6, generator=g, dtype=torch.float64), 0)
    kl = (q * (q / p).log()).sum().item()
    y = torch.multinomial(q, 200_000, replacement=True, generator=g)
    lp, ref = q.log()[y][None, :], p.log()[y][None, :]
    k1, k3 = kl_penalty(lp, ref, "k1"), kl_penalty(lp, ref, "k3")
    for est in (k1, k3):
        stderr = est.std().item() / math.sqrt(est.numel())
        assert abs(est.mean().item() - kl) < 4 * stderr
    assert k3.std() < k1.std()


def test_gradient_of_k2_is_kl_gradient_direction():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]])
    kl_penalty(lp, ref, "k2").sum().backward()
    torch.testing.assert_close(lp.grad, (lp - ref).detach())


def test_apply_kl_penalty():
    r = torch.tensor([[0.0, 0.0, 1.0, 5.0]])
    lp = torch.tensor([[-1.0, -1.0, -1.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -2.0, -9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    shaped, kl = apply_kl_penalty(r, lp, ref, mask, coef=0.1, kind="k1")
    torch.testing.assert_close(kl, torch.tensor([[0.5, 0.0, 1.0, 0.0]]))
    torch.testing.assert_close(shaped, torch.tensor([[-0.05, 0.0, 0.9, 0.0]]))
    assert not shaped.requires_grad


def test_errors():
    with pytest.raises(ValueError, match=r"\['abs', 'k1', 'k2', 'k3'\].*'k4'"):
        kl_penalty(torch.zeros(1, 2), torch.zeros(1, 2), "k4")
    with pytest.raises(ValueError, match="same shape"):
        kl_penalty(torch.zeros(1, 2), torch.zeros(1, 3), "k1")
