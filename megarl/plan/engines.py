"""The vLLM engines of a trainer rank in the memory plan: the policy's (`vllm_rows`) and a judge's
(`judge_rows`, `reward.judge`: its own engine, awake in every phase)."""

from __future__ import annotations

from megarl.models.builder import num_params
from megarl.plan import formulas as fm
from megarl.plan.formulas import gib
from megarl.plan.records import ALL, Row
from megarl.trainer.judge import judge_arch, refuse_on_gpu

SYNC_BUCKET = 256 * 2**20
VLLM_ACTIVATIONS = 1 * fm.GiB
"""vLLM's forward-pass working memory when its KV cache is set in bytes (an assumption)."""


def vllm_rows(cfg, arch, device: str, gpu_mem: float, e: int) -> list[Row]:
    """The policy's engine: awake in the rollout (all phases unless it sleeps), its weights woken
    for the sync, and the colocated sync's buffers (GPU)."""
    ro = cfg.rollout.engine
    weights = num_params(arch) * e / ro.tensor_parallel
    kv_tok = fm.kv_bytes_per_token(arch, elem=e, vllm_tp=ro.tensor_parallel)
    sleeps = device == "gpu" and ro.sleep_between_steps
    awake = ("rollout",) if sleeps else ALL
    rows = []
    if device == "gpu" and ro.kv_cache_memory_bytes is None:
        budget = ro.gpu_memory_utilization * gpu_mem
        kv_tokens = max(0, budget - weights - VLLM_ACTIVATIONS) / kv_tok
        rows.append(
            Row(
                "vLLM (awake)",
                budget,
                f"gpu_memory_utilization {ro.gpu_memory_utilization} x GPU: weights "
                f"{gib(weights)} (TP {ro.tensor_parallel}) + KV ~{kv_tokens:,.0f} tokens "
                f"at {kv_tok:,} B",
                awake,
            )
        )
    else:
        kv = ro.kv_cache_memory_bytes or (256 * 2**20 if device == "cpu" else 0)
        extra = VLLM_ACTIVATIONS if device == "gpu" else 0
        rows.append(
            Row(
                "vLLM (awake)",
                weights + kv + extra,
                f"weights {gib(weights)} + KV cache {gib(kv)} ({kv // kv_tok:,} tokens"
                f" at {kv_tok:,} B){' + 1 GiB working memory' if extra else ''}",
                awake,
            )
        )
    if sleeps:
        rows.append(
            Row(
                "vLLM weights (woken for sync)",
                weights,
                f"{num_params(arch):,} params x {e} B / vLLM TP {ro.tensor_parallel}",
                ("sync",),
            )
        )
    # allocated once by the colocated sync; dense GPU parameters need no staging
    if device == "gpu":
        rows.append(
            Row(
                "weight-sync buffers",
                2 * SYNC_BUCKET,
                "send + receive buffers of one 256 MiB bucket (megarl.rollout.sync.colocated)",
            )
        )
    return rows


def judge_rows(cfg, device: str, gpu_mem: float, e: int) -> list[Row]:
    """The judge's engine, held through every phase (it never sleeps): GPU, its share of the
    device (`reward.judge.gpu_memory_utilization`); CPU, the judge's weights and its KV cache
    (the judge's shape read from `reward.judge.model`)."""
    jc = cfg.reward.judge
    if jc.model is None or cfg.algorithm.offline:
        return []
    if device == "gpu":
        refuse_on_gpu(cfg)
        budget = jc.gpu_memory_utilization * gpu_mem
        text = f"reward.judge.gpu_memory_utilization {jc.gpu_memory_utilization} x GPU"
        return [Row("judge vLLM engine", budget, text, ALL)]
    weights = num_params(judge_arch(cfg)) * e
    text = f"weights {gib(weights)} + KV cache {gib(jc.kv_cache_memory_bytes)}"
    return [Row("judge vLLM engine", weights + jc.kv_cache_memory_bytes, text, ALL)]
