"""Loss value and gradients are invariant to the micro-batch split and to the DP split.

A tiny differentiable "model" (`logits = x @ W^T`, `values = x @ w`) produces logprobs,
entropy and values for a global batch of 8 right-padded sequences of different lengths. For
every aggregation mode and for PPO (all options on), GSPO, CISPO (its weights clipped on some
tokens) and the value loss, the sum of the shares over 1, 2 or 4 micro-batches, and over DP=2
gloo ranks (gradients all-reduced with SUM), must equal the single micro-batch result: relative
error <= 1e-6 (measured ~1e-16 in float64).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megarl.algorithms.losses import (
    AGG_MODES,
    PolicyLossOptions,
    ValueLossOptions,
    get_policy_loss,
    global_denominators,
    value_loss,
)
from megarl.algorithms.off_policy import OffPolicyOptions
from megarl.distributed.launch import spawn

B, T, H, V = 8, 6, 4, 5
MAX_LEN = 8
LOSSES = ["ppo", "gspo", "cispo", "value"]
RTOL = 1e-6


def make_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([6, 1, 3, 5, 2, 6, 4, 1])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    d = torch.float64
    return {
        "x": torch.randn(B, T, H, generator=g, dtype=d),
        "tokens": torch.randint(0, V, (B, T), generator=g),
        "mask": mask,
        "old": -torch.rand(B, T, generator=g, dtype=d) - 1.0,
        "sampler": -torch.rand(B, T, generator=g, dtype=d) - 1.0,
        "ref": -torch.rand(B, T, generator=g, dtype=d) - 1.0,
        "adv": torch.randn(B, 1, generator=g, dtype=d).expand(B, T).contiguous(),
        "old_values": torch.randn(B, T, generator=g, dtype=d),
        "returns": torch.randn(B, T, generator=g, dtype=d),
    }


def make_params(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(V, H, generator=g, dtype=torch.float64),
        torch.randn(H, generator=g, dtype=torch.float64),
    )


def share(
    loss_name: str,
    mode: str,
    params,
    batch: dict,
    rows: slice,
    tokens: float,
    seqs: float,
) -> torch.Tensor:
    w, w_v = params
    mb = {k: v[rows] for k, v in batch.items()}
    logp = torch.log_softmax(mb["x"] @ w.T, dim=-1)  # [b, T, V]
    lp = logp.gather(-1, mb["tokens"].unsqueeze(-1)).squeeze(-1)
    denominators = {
        "global_tokens": tokens,
        "global_seqs": seqs,
        "max_len": MAX_LEN,
    }
    if loss_name == "value":
        loss, _ = value_loss(
            mb["x"] @ w_v,
            mb["old_values"],
            mb["returns"],
            mb["mask"],
            ValueLossOptions(clip=0.2, agg_mode=mode),
            **denominators,
        )
        return loss
    entropy = -(logp.exp() * logp).sum(-1)
    loss, _ = get_policy_loss(loss_name)(
        lp,
        mb["old"],
        mb["adv"],
        mb["mask"],
        PolicyLossOptions(
            clip_low=0.2,
            clip_high=0.28,
            dual_clip=None if loss_name == "cispo" else 3.0,
            cispo_clip_low=0.2,  # tight, so that some of the batch's weights are clipped
            cispo_clip_high=0.28,
            agg_mode=mode,
            off_policy=OffPolicyOptions(kind="tis", high=2.0),
            entropy_coef=0.01,
            kl_coef=0.05,
            kl_kind="k3",
        ),
        sampler_logprobs=mb["sampler"],
        entropy=entropy,
        ref_logprobs=mb["ref"],
        **denominators,
    )
    return loss


def run_split(
    loss_name: str, mode: str, batch: dict, row_range: range, n_micro: int, group=None
) -> tuple[float, torch.Tensor, torch.Tensor]:
    """(loss, grad W, grad w_v) summed over `n_micro` micro-batches of rows `row_range`."""
    params = tuple(p.clone().requires_grad_(True) for p in make_params())
    size = len(row_range) // n_micro
    micro = [
        slice(row_range.start + i * size, row_range.start + (i + 1) * size) for i in range(n_micro)
    ]
    tokens, seqs = global_denominators([batch["mask"][s] for s in micro], group=group)
    total = torch.zeros((), dtype=torch.float64)
    for rows in micro:
        loss = share(loss_name, mode, params, batch, rows, tokens, seqs)
        loss.backward()  # gradients accumulate over micro-batches, like Megatron's schedule
        total += loss.detach()
    # a policy loss does not touch the critic head and vice versa
    return total, *(torch.zeros_like(p) if p.grad is None else p.grad for p in params)


def _dp_worker(rank: int, world_size: int) -> dict:
    batch = make_batch()
    per_rank = B // world_size
    rows = range(rank * per_rank, (rank + 1) * per_rank)
    out = {}
    for loss_name in LOSSES:
        for mode in AGG_MODES:
            for n_micro in (1, 2):
                loss, gw, gv = run_split(loss_name, mode, batch, rows, n_micro, group=None)
                stacked = torch.cat([loss.reshape(1), gw.reshape(-1), gv.reshape(-1)])
                dist.all_reduce(stacked)  # SUM: shares add up to the global loss and gradient
                out[(loss_name, mode, n_micro)] = stacked.numpy()
    return out


def _flat(loss, gw, gv) -> torch.Tensor:
    return torch.cat([loss.reshape(1), gw.reshape(-1), gv.reshape(-1)])


def _max_rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Max elementwise relative error; exact zeros (the unused head) must stay exact."""
    zero = ref == 0
    assert torch.equal(got[zero], ref[zero])
    return ((got - ref).abs()[~zero] / ref.abs()[~zero]).max().item()


@pytest.mark.parametrize("loss_name", LOSSES)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batch_invariance(loss_name, mode):
    batch = make_batch()
    ref = _flat(*run_split(loss_name, mode, batch, range(B), 1))
    used = ref[1 : 1 + V * H] if loss_name != "value" else ref[1 + V * H :]
    assert used.abs().min() > 0  # every gradient entry of the head in use is exercised
    for n_micro in (2, 4):
        got = _flat(*run_split(loss_name, mode, batch, range(B), n_micro))
        assert _max_rel_err(got, ref) <= RTOL, (loss_name, mode, n_micro)


def test_modes_differ():
    """Guard against a vacuous test: the aggregation modes do weigh tokens differently."""
    batch = make_batch()
    values = {m: run_split("ppo", m, batch, range(B), 1)[0].item() for m in AGG_MODES}
    assert len({round(v, 12) for v in values.values()}) == len(AGG_MODES)


def test_dp_invariance():
    batch = make_batch()
    results = spawn(_dp_worker, 2)
    for key in results[0]:
        loss_name, mode, _n_micro = key
        ref = _flat(*run_split(loss_name, mode, batch, range(B), 1))
        for res in results:
            got = torch.from_numpy(res[key])
            assert _max_rel_err(got, ref) <= RTOL, key
