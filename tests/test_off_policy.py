"""Off-policy corrections (megarl.algorithms.off_policy) against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algorithms.config import AlgorithmConfig
from megarl.algorithms.off_policy import OffPolicyOptions, importance_weights
from megarl.errors import ConfigError

# one row of 4 tokens (the last is padding) with token ratios k = e^{0.5}, e^{-1}, e^{2}
OLD = torch.tensor([[0.5, -1.0, 2.0, 7.0]], dtype=torch.float64)
BEHAVIOUR = torch.zeros(1, 4, dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1, 0]])
K = [math.exp(0.5), math.exp(-1.0), math.exp(2.0)]


def _weights(kind, low=0.5, high=2.0):
    w, m = importance_weights(OLD, BEHAVIOUR, MASK, OffPolicyOptions(kind=kind, low=low, high=high))
    return w[0].tolist(), {k: v.item() for k, v in m.items()}


def test_none_weighs_nothing_and_reports_the_raw_ratios():
    w, m = _weights("none")
    assert w == [1.0, 1.0, 1.0, 0.0]
    assert m["is_ratio_mean"] == pytest.approx(sum(K) / 3)
    assert m["is_clipped_frac"] == 0.0


def test_tis_truncates_at_the_cap():
    w, m = _weights("tis", high=2.0)
    assert w == pytest.approx([K[0], K[1], 2.0, 0.0])
    assert m["is_weight_max"] == pytest.approx(2.0)
    assert m["is_clipped_frac"] == pytest.approx(1 / 3)
    assert m["is_weight_mean"] == pytest.approx((K[0] + K[1] + 2.0) / 3)


def test_icepop_masks_both_sides_of_its_band():
    # e^{-1} = 0.37 < 0.5 and e^{2} = 7.4 > 5: only e^{0.5} = 1.65 stays, with its own ratio
    w, m = _weights("icepop", low=0.5, high=5.0)
    assert w == pytest.approx([K[0], 0.0, 0.0, 0.0])
    assert m["is_clipped_frac"] == pytest.approx(2 / 3)
    w, _ = _weights("icepop", low=0.3, high=8.0)
    assert w == pytest.approx(K + [0.0])


def test_decoupled_drops_tokens_above_the_cap():
    w, _ = _weights("decoupled", high=2.0)
    assert w == pytest.approx([K[0], K[1], 0.0, 0.0])


def test_mis_weighs_the_whole_sequence_by_its_ratio():
    # rho = e^{0.5 - 1 + 2} = e^{1.5} = 4.48 (padding excluded): above a cap of 2 the row is
    # dropped, under a cap of 5 every valid token carries rho
    w, m = _weights("mis", high=2.0)
    assert w == [0.0, 0.0, 0.0, 0.0]
    assert m["is_clipped_frac"] == 1.0
    w, m = _weights("mis", high=5.0)
    assert w == pytest.approx([math.exp(1.5)] * 3 + [0.0])
    assert m["is_ratio_mean"] == pytest.approx(math.exp(1.5))


def test_weights_carry_no_gradient_and_stay_finite():
    old = torch.tensor([[300.0, 0.0]], requires_grad=True)
    w, _ = importance_weights(
        old, torch.zeros(1, 2), torch.ones(1, 2), OffPolicyOptions(kind="tis")
    )
    assert not w.requires_grad and torch.isfinite(w).all()


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="accepted: \\('none', 'tis'"):
        OffPolicyOptions(kind="is")
    with pytest.raises(ValueError, match="0 <= low < 1 < high"):
        OffPolicyOptions(kind="tis", high=0.9)
    with pytest.raises(ValueError, match="shapes differ"):
        importance_weights(OLD, BEHAVIOUR[:, :2], MASK, OffPolicyOptions())
    with pytest.raises(ConfigError, match="algorithm.off_policy_correction='ice'"):
        AlgorithmConfig(off_policy_correction="ice")
    with pytest.raises(ConfigError, match="algorithm.is_low=1.2"):
        AlgorithmConfig(off_policy_correction="icepop", is_low=1.2)
    opts = AlgorithmConfig(off_policy_correction="icepop", is_low=0.4, is_high=5.0)
    assert opts.policy_loss_options.off_policy == OffPolicyOptions(kind="icepop", low=0.4, high=5.0)
