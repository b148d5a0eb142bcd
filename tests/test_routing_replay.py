"""MoE routing replay (R3), trainer side, and its building blocks.

Pure: routes collated onto the batch, the router's token layout (sequence-major, the sequence
shard of sequence parallelism), rows with repeated experts, the config checks, and the CPU
capture's lookup of a sample's routes by its tokens.

Distributed (`tests/routing_worker.py`): routes recorded from a single-rank megatron forward
(forward hooks on the routers, independent of the replay code) are replayed at EP2, TP2 + SP,
PP2 and DP2 through the batch path (micro-batches grouped by length, PP padding): the logprobs
must equal the reference's (<= 1e-5), while routes with every expert shifted must change them
(the check can fail), and routes of the wrong shape are refused naming both sides.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from megarl.models.routing import (
    RoutingReplayError,
    _distinct,
    _token_layout,
    collate_routes,
)

# ----------------------------------------------------------------------------- pure


EXTENDED = pytest.mark.extended  # CI replays at EP2; the other layouts in make test-slow


def test_collate_routes_aligns_with_tokens_and_fills_the_rest():
    r0 = np.array([[[1, 3]], [[0, 2]]], dtype=np.uint8)  # 2 tokens, 1 layer, top-2
    r1 = np.array([[[2, 1]], [[3, 0]], [[1, 2]]], dtype=np.uint8)
    out = collate_routes([r0, r1], torch.tensor([3, 3]), 5)
    assert out.shape == (2, 5, 1, 2) and out.dtype == torch.uint8
    assert out[0, :2].tolist() == r0.tolist() and out[1, :3].tolist() == r1.tolist()
    assert out[0, 2:, 0].tolist() == [[0, 1]] * 3  # the last token and padding: experts 0..k-1
    with pytest.raises(RoutingReplayError, match="sample 1: routes for 3 tokens, but it has 5"):
        collate_routes([r0, r1], torch.tensor([3, 5]), 5)
    with pytest.raises(RoutingReplayError, match=r"\[layers, top_k\]"):
        collate_routes([r0, r1[:, :, :1]], torch.tensor([3, 3]), 5)


class _Group:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def _router(sp: bool, tp: int = 1, rank: int = 0):
    return types.SimpleNamespace(
        config=types.SimpleNamespace(sequence_parallel=sp), tp_group=_Group(tp, rank)
    )


def test_token_layout_is_sequence_major_and_sharded_like_sequence_parallelism():
    x = torch.arange(2 * 4).view(2, 4)  # [b=2, s=4]: value = b * 4 + s
    assert _token_layout(x, _router(False)).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    # TP=2 with SP: rank 1 routes sequence positions 2, 3 of both rows
    assert _token_layout(x, _router(True, 2, 1)).tolist() == [2, 6, 3, 7]
    with pytest.raises(RoutingReplayError, match="not a multiple of TP=3"):
        _token_layout(x, _router(True, 3, 0))


def test_rows_with_a_repeated_expert_become_distinct():
    idx = torch.tensor([[2, 0], [0, 0], [3, 3]])
    assert _distinct(idx).tolist() == [[2, 0], [0, 1], [0, 1]]


def test_routing_replay_needs_a_moe_model():
    from megarl.models.hf_config import arch_from_hf
    from megarl.rollout.config import EngineConfig, RolloutConfigError
    from megarl.rollout.engine.routes import check_routing_replay
    from tests.tiny import TINY_LLAMA, TINY_QWEN3_MOE

    with pytest.raises(RolloutConfigError, match="routing_replay=true needs a MoE model"):
        check_routing_replay(arch_from_hf(TINY_LLAMA), EngineConfig(routing_replay=True))
    check_routing_replay(arch_from_hf(TINY_QWEN3_MOE), EngineConfig(routing_replay=True))


def test_cpu_capture_finds_routes_by_tokens_and_refuses_gaps():
    from megarl.rollout.engine.routes import RoutesError, _take

    rows = np.arange(5 * 2 * 2, dtype=np.uint8).reshape(5, 2, 2)
    chunks = {  # request a: prefill of 3 tokens, then two decode steps; request b: a gap
        "a": [
            (np.array([0, 1, 2]), np.array([7, 8, 9]), rows[:3]),
            (np.array([3]), np.array([4]), rows[3:4]),
            (np.array([4]), np.array([5]), rows[4:5]),
        ],
        "b": [(np.array([0, 2]), np.array([7, 9]), rows[:2])],
    }
    worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(_megarl_routes=chunks))
    with pytest.raises(
        RoutesError, match=r"vLLM request b: no routes recorded for positions \[1\]"
    ):
        _take(worker)
    del chunks["b"]
    got = _take(worker)
    assert list(got) == [(7, 8, 9, 4, 5)] and np.array_equal(got[(7, 8, 9, 4, 5)], rows)
    assert chunks == {}  # taken: the next call starts empty


# ----------------------------------------------------------------------------- distributed
REPLAY_TOL = 1e-5


@pytest.fixture(scope="module")
def reference():
    from megarl.distributed.launch import spawn
    from tests import routing_worker

    return spawn(routing_worker.reference, 1)[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param({"expert_parallel": 2}, id="ep2"),
        pytest.param(
            {"tensor_parallel": 2, "sequence_parallel": True}, id="tp2-sp", marks=EXTENDED
        ),
        pytest.param({"pipeline_parallel": 2}, id="pp2", marks=EXTENDED),
        pytest.param({}, id="dp2", marks=EXTENDED),
    ],
)
def test_replayed_routes_reproduce_the_reference_at_every_layout(reference, layout):
    from megarl.distributed.launch import spawn
    from tests import routing_worker

    results = spawn(routing_worker.replay, 2, layout, reference)
    mask = reference["mask"].bool()
    scored = 0
    for res in results:
        if res["replayed"] is None:  # not the last pipeline stage
            continue
        scored += 1
        replayed = (res["replayed"] - reference["logprobs"]).abs()[mask].max().item()
        natural = (res["natural"] - reference["logprobs"]).abs()[mask].max().item()
        shifted = (res["shifted"] - reference["logprobs"]).abs()[mask].max().item()
        print(f"{layout}: replayed {replayed:.2e}, natural {natural:.2e}, shifted {shifted:.2e}")
        assert replayed <= REPLAY_TOL and natural <= REPLAY_TOL
        assert shifted > 100 * REPLAY_TOL  # replay is in effect: other experts, other logprobs
    assert scored >= 1
    for res in results:
        msg = res["wrong_layers"]
        assert "rollout routes have 1 layers x top-2" in msg and "2 MoE layers x top-2" in msg


@pytest.mark.slow
def test_expert_parallel_ranks_with_fewer_micro_batches_pad_with_empty_ones(reference):
    from megarl.distributed.launch import spawn
    from tests import routing_worker

    results = spawn(routing_worker.uneven, 2, reference, timeout=300)
    for res in results:
        n = res["rows"]
        mask = reference["mask"][:n].bool()
        width = res["logprobs"].shape[1]
        diff = (res["logprobs"] - reference["logprobs"][:n, :width]).abs()[mask[:, :width]]
        assert diff.max().item() <= REPLAY_TOL
    assert [r["rows"] for r in results] == [routing_worker.B, routing_worker.B - 1]
