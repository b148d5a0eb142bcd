"""Sequence packing (`megarl.data.packing`): the bins, the row layout, and that packed forward and
backward passes equal the unpacked ones.

The model tests run the real megatron-core models on gloo ranks: a tiny Llama (GQA, padded
vocabulary) and a tiny Qwen3 (q/k norms, tied embeddings), with ragged sequences. Packed and
unpacked passes over the same batch must give the same per-token logprobs, critic values and
parameter gradients (<= 1e-6, fp32) at 1 rank, TP2 + sequence parallelism, and PP2.
"""

from __future__ import annotations

import pytest
import torch

from megarl.data.batch import MicroBatching, collate, pad_share, split_micro_batches
from megarl.data.packing import PackedRows, first_fit_decreasing, model_layout
from megarl.distributed.launch import spawn
from tests import parity_worker as pw
from tests.test_convert_common import DEEPSEEK_V3, GPT_OSS
from tests.tiny import TINY_LLAMA, TINY_QWEN3

# DeepSeek-V3: multi-latent attention packed (keys wider than values, the rotary key per segment)
# gpt-oss: a sequence's window and sinks must not see the segments packed before it
ARCHS = {"llama": TINY_LLAMA, "qwen3": TINY_QWEN3, "deepseek_v3": DEEPSEEK_V3, "gpt_oss": GPT_OSS}
TOL = 1e-6


# ------------------------------------------------------------------------------ bins and rows
def test_first_fit_decreasing_places_every_item_once_within_the_budget():
    sizes = [7, 3, 9, 2, 5, 5, 1, 12, 4]
    bins = first_fit_decreasing(sizes, 12)
    assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
    assert all(sum(sizes[i] for i in b) <= 12 for b in bins)
    assert bins == [[7], [2, 1], [0, 4], [5, 8, 3, 6]]  # largest first, first bin with room
    assert first_fit_decreasing([20, 1], 12) == [[0], [1]]  # too large: a bin of its own
    with pytest.raises(ValueError, match="budget"):
        first_fit_decreasing([1], 0)


def test_packed_rows_pack_and_unpack_the_micro_batch_layout():
    seq_len = torch.tensor([3, 1, 2])
    rows = PackedRows.of(seq_len, pad_to=4)  # 6 real tokens in a row of 8
    assert rows.length == 8 and rows.real == 6
    assert rows.cu_seqlens.tolist() == [0, 3, 4, 6, 8] and rows.max_seqlen == 3
    x = torch.tensor([[1, 2, 3], [4, 0, 0], [5, 6, 0]])
    assert rows.pack(x).tolist() == [[1, 2, 3, 4, 5, 6, 0, 0]]
    y = torch.arange(8.0).view(1, 8, 1).requires_grad_()
    back = rows.unpack(y, 3, 3)
    assert back[..., 0].tolist() == [[0, 1, 2], [3, 0, 0], [4, 5, 0]]
    back.sum().backward()  # the tail padding receives no gradient
    assert y.grad[0, :, 0].tolist() == [1, 1, 1, 1, 1, 1, 0, 0]
    longer = rows.padded_to(11)
    assert longer.cu_seqlens.tolist() == [0, 3, 4, 6, 11] and longer.length == 11
    assert torch.equal(longer.rows, rows.rows) and longer.max_seqlen == 5
    exact = PackedRows.of(seq_len)
    assert exact.cu_seqlens.tolist() == [0, 3, 4, 6] and exact.padded_to(6) is exact


def test_packed_micro_batches_hold_every_row_once_without_padding():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, 30, (40,), generator=g).tolist()
    prompts = [[1] * 2 for _ in lengths]
    responses = [[5] * (n - 2) for n in lengths]
    batch = collate(prompts, responses, pad_id=0, pad_to_multiple=2)
    unpacked = split_micro_batches(batch, MicroBatching(size=8, pad_to=2))
    packed = split_micro_batches(batch, MicroBatching(size=8, pad_to=2, pack=True))
    width = batch["tokens"].shape[1]
    assert sorted(i for m in packed for i in m["index"].tolist()) == list(range(40))
    for m in packed:
        p = m["packing"]
        assert p.real == m["seq_len"].sum() <= 8 * width  # the budget: size x the batch width
        assert p.length % 2 == 0 and p.length - p.real < 2
        tokens = model_layout(m, m["tokens"])
        assert tokens.shape == (1, p.length)
        assert tokens[0, : p.real].tolist() == sum(
            (m["tokens"][r, : int(n)].tolist() for r, n in enumerate(m["seq_len"])), []
        )
    real, computed = pad_share(packed)
    assert real == sum(lengths) and computed - real < 2 * len(packed)
    assert pad_share(unpacked)[1] - real > 10 * (computed - real)
    assert len(packed) <= len(unpacked)
    budget = split_micro_batches(batch, MicroBatching(size=8, max_tokens=50, pack=True))
    assert all(m["packing"].real <= 50 for m in budget)


# ------------------------------------------------------------------------------ the models
def _batch():
    g = torch.Generator().manual_seed(3)
    lengths = [(4, 9), (2, 1), (7, 13), (3, 4), (5, 2), (2, 11), (6, 6), (3, 8)]
    prompts = [torch.randint(3, 250, (p,), generator=g).tolist() for p, _ in lengths]
    responses = [torch.randint(3, 250, (r,), generator=g).tolist() for _, r in lengths]
    return prompts, responses


def pack_job(rank: int, world: int, states: dict, layout: dict) -> dict:
    from megarl.convert.layout import gather_full_state, load_full_state
    from megarl.distributed import ParallelConfig, Topology
    from megarl.models import forward
    from megarl.models.builder import build_model
    from megarl.models.hf_config import PrecisionConfig, arch_from_hf
    from megarl.models.optim import wire_grad_finalization, zero_grads
    from megarl.trainer import experience as xp

    out = {}
    for name, hf in ARCHS.items():
        arch, par = arch_from_hf(hf), ParallelConfig(**layout)
        if arch.linear_bias and arch.is_moe and par.tensor_parallel > 1:  # biased experts: ETP 1
            par = ParallelConfig(**layout, expert_parallel=2, expert_tensor_parallel=1)
        groups = Topology.for_model(par, world, arch).initialize(seed=0)
        pad_to = forward.sequence_multiple(groups.tp_size, par.sequence_parallel, None)
        prompts, responses = _batch()
        batch = collate(prompts, responses, pad_id=0, pad_to_multiple=pad_to)
        weights = torch.linspace(-1, 1, batch["tokens"].numel()).view_as(batch["loss_mask"])
        batch["advantages"] = weights * batch["loss_mask"]
        tokens = float(batch["loss_mask"].sum())
        actor = build_model(arch, par, PrecisionConfig(), role="actor")
        load_full_state(actor, states[name])
        wire_grad_finalization(actor)
        critic = build_model(arch, par, PrecisionConfig(), role="critic")
        value_head = 0.1 * torch.randn(1, arch.hidden_size, generator=torch.Generator())
        load_full_state(critic, {**states[name], "output_layer.weight": value_head})
        res = {}
        for pack in (False, True):
            micro = MicroBatching(size=3, pad_to=pad_to, pack=pack)

            def loss_fn(mb, logits, arch=arch, groups=groups, tokens=tokens):
                lp = forward.token_logprobs(mb, logits, vocab_size=arch.vocab_size,
                                            tp_group=groups.tp, temperature=0.8)
                loss = -(lp * mb["advantages"]).sum() / tokens
                return loss, {"index": mb["index"], "logprobs": lp.detach()}

            zero_grads(actor)
            outs = forward.forward_backward(
                actor, split_micro_batches(batch, micro), loss_fn, forward_only=False,
                dp_size=groups.dp_size,
            )
            grads = gather_full_state(actor, grads=True)
            lp = xp.forward_logprobs(actor, batch, micro=micro, vocab_size=arch.vocab_size,
                                     groups=groups, temperature=0.8)
            values = xp.forward_values(critic, batch, micro=micro, groups=groups)
            res[pack] = {
                "lp_train": xp._assemble(outs, "logprobs", batch["tokens"].shape)
                if groups.is_last_stage else None,
                "lp": lp,
                "values": values,
                "grads": grads,
                "micro_batches": len(split_micro_batches(batch, micro)),
            }
        out[name] = res
    return out


@pytest.fixture(scope="module")
def states():
    return spawn(pw.make_states, 1, ARCHS, 0)[0]


LAYOUTS = [
    pytest.param(dict(), 1, id="1rank"),
    pytest.param(dict(tensor_parallel=2, sequence_parallel=True), 2, id="tp2-sp"),
    pytest.param(dict(pipeline_parallel=2), 2, id="pp2"),
]


@pytest.mark.slow
@pytest.mark.parametrize("layout,world", LAYOUTS)
def test_packed_passes_equal_unpacked_ones(states, layout, world):
    results = spawn(pack_job, world, states, layout, timeout=600)
    prompts, responses = _batch()
    mask = collate(prompts, responses, pad_id=0)["loss_mask"].bool()
    for name in ARCHS:
        last = next(r[name] for r in reversed(results) if r[name][True]["lp"] is not None)
        plain, packed = last[False], last[True]
        width = mask.shape[1]
        errs = {
            key: float((packed[key][:, :width] - plain[key][:, :width])[mask].abs().max())
            for key in ("lp", "lp_train", "values")
        }
        g0, g1 = results[0][name][False]["grads"], results[0][name][True]["grads"]
        assert set(g0) == set(g1)
        errs["grads"] = max(float((g1[k] - g0[k]).abs().max()) for k in g0)
        print(f"{name} {layout}: packed vs unpacked max |diff| {errs}; micro-batches "
              f"{plain['micro_batches']} -> {packed['micro_batches']}")
        assert max(errs.values()) <= TOL, errs
        assert packed["micro_batches"] < plain["micro_batches"]
