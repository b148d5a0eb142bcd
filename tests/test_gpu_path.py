"""What can be checked on CPU of the GPU path: the decisions each GPU-only branch
takes, as pure functions, and the dispatch plan that makes every prompt be generated once.

Numbers that only a GPU can give (NCCL, Transformer-Engine, vLLM on CUDA) are checked by
`tools/gpu_check.sh` when a GPU is at hand; here each decision's logic is pinned down."""

from __future__ import annotations

import json
import math

import pytest
import torch

from megarl.models.hf_config import ModelConfigError, PrecisionConfig, arch_from_hf
from megarl.rollout.config import EngineConfig, RolloutConfigError
from megarl.rollout.engine.checks import CPU_KV_CACHE_BYTES, check_kv_cache
from megarl.rollout.engine.stop_tokens import resolve_stop_tokens
from tests.tiny import TINY_LLAMA

ARCH = arch_from_hf(TINY_LLAMA)  # 4 layers, 2 KV heads, head_dim 16


# ------------------------------------------------------------------ device-mapped process group
def test_backend_on_gpu_maps_cpu_tensors_to_gloo(monkeypatch):
    from megarl.distributed import device

    monkeypatch.setattr(device, "use_gpu", lambda: True)
    assert device.backend() == "cpu:gloo,cuda:nccl"
    monkeypatch.setattr(device, "use_gpu", lambda: False)
    assert device.backend() == "gloo"


# ------------------------------------------------------------------ KV cache sizing
def test_kv_cache_defaults_to_gpu_memory_utilization_and_a_cpu_size():
    cfg = EngineConfig()
    assert cfg.kv_cache_memory_bytes is None
    assert check_kv_cache(ARCH, cfg, dtype="fp32", gpu=False) == CPU_KV_CACHE_BYTES


def test_kv_cache_too_small_for_one_sequence_is_refused_with_the_arithmetic():
    # 2 x 4 layers x 2 KV heads x 16 x 4 B = 1024 B per token; max_model_len 256 -> 256 KiB
    cfg = EngineConfig(kv_cache_memory_bytes=2**20, max_model_len=2048)
    with pytest.raises(RolloutConfigError) as e:
        check_kv_cache(ARCH, cfg, dtype="fp32", gpu=False)
    msg = str(e.value)
    assert "kv_cache_memory_bytes=1048576" in msg and "1024 tokens" in msg
    assert "max_model_len=2048" in msg and "2 x 4 attention layers x 2 KV heads" in msg
    ok = EngineConfig(kv_cache_memory_bytes=2**20, max_model_len=1024)
    assert check_kv_cache(ARCH, ok, dtype="fp32", gpu=False) == 2**20


def test_kv_cache_on_gpu_is_checked_against_the_memory_budget(monkeypatch):
    class Props:
        total_memory = 80 * 2**30

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: Props())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    big = arch_from_hf(
        {
            **TINY_LLAMA,
            "hidden_size": 8192,
            "intermediate_size": 28672,
            "num_hidden_layers": 80,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "max_position_embeddings": 8192,
        }
    )
    # 70B in bf16 at vLLM TP 2 is ~65 GiB per GPU: 0.5 x 80 GiB cannot hold it
    with pytest.raises(RolloutConfigError, match="gpu_memory_utilization=0.5"):
        check_kv_cache(big, EngineConfig(tensor_parallel=2), dtype="bf16", gpu=True)
    fits = EngineConfig(tensor_parallel=8, gpu_memory_utilization=0.6)
    assert check_kv_cache(big, fits, dtype="bf16", gpu=True) is None


def test_vllm_start_is_refused_early_when_the_trainer_left_too_little_free(monkeypatch):
    """vLLM V1 will not start unless gpu_memory_utilization x the GPU is free; the engine is
    built after the trainer's models, so megarl checks first (after freeing torch's cached
    blocks) and names the value that fits."""
    from megarl.rollout.engine.checks import check_free_memory

    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    free = {"bytes": 40 * 2**30}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (free["bytes"], 80 * 2**30))
    with pytest.raises(RolloutConfigError) as e:
        check_free_memory(EngineConfig(gpu_memory_utilization=0.8))
    msg = str(e.value)
    assert "gpu_memory_utilization=0.8 asks vLLM for 64.0 GiB of this GPU's 80.0 GiB" in msg
    assert "only 40.0 GiB are free" in msg and "at most 0.49" in msg and "megarl plan" in msg
    assert calls == ["empty_cache"]  # before reading the free memory
    check_free_memory(EngineConfig(gpu_memory_utilization=0.5))  # 40 of 80 GiB: fits
    free["bytes"] = 2**29
    with pytest.raises(RolloutConfigError, match="the trainer alone leaves no room"):
        check_free_memory(EngineConfig(gpu_memory_utilization=0.5))


@pytest.mark.parametrize("separate", [False, True])
def test_a_gpu_engine_is_launched_in_process_sized_and_sleeping_as_placed(separate):
    """vLLM's arguments on GPU: the external launcher (one engine rank per trainer process),
    sleep mode and memory share as the placement decides (`EngineConfig.placed`), and with
    in-flight updates no async scheduling (a forward of the old weights would stay queued)."""
    from megarl.rollout.engine.engine import llm_kwargs

    cfg = EngineConfig(kv_cache_memory_bytes=2**30).placed(separate=separate)
    for between_steps, async_scheduling in ((False, None), (True, False)):
        kw = llm_kwargs(
            "/m", ARCH, cfg, dtype="bf16", seed=3, gpu=True, kv_bytes=2**30,
            between_steps=between_steps,
        )  # fmt: skip
        assert kw["distributed_executor_backend"] == "external_launcher"
        assert kw["enable_sleep_mode"] is (not separate)
        assert kw["gpu_memory_utilization"] == (0.9 if separate else 0.5)
        assert kw.get("async_scheduling") is async_scheduling
        assert "enable_chunked_prefill" not in kw  # CPU only
    cpu = llm_kwargs("/m", ARCH, cfg, dtype="fp32", seed=3, gpu=False, kv_bytes=2**30)
    assert "distributed_executor_backend" not in cpu and cpu["enable_chunked_prefill"] is False


# ------------------------------------------------------------------ stop tokens
def test_stop_tokens_default_to_the_models_eos_ids(tmp_path):
    class Tok:
        eos_token_id = 2

    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 128009]}))
    hf = {"eos_token_id": [2, 128001]}
    assert resolve_stop_tokens(None, Tok(), hf, [str(tmp_path)]) == (2, 128001, 128009)
    assert resolve_stop_tokens((), Tok(), hf) == ()  # explicitly none
    assert resolve_stop_tokens((7,), Tok(), hf) == (7,)


# ------------------------------------------------------------------ batches to the device
def test_micro_batches_move_to_the_model_device_except_host_indices():
    from megarl.models.forward import to_device

    mb = {"tokens": torch.ones(2, 3, dtype=torch.long), "index": torch.arange(2), "k": None}
    out = to_device(mb, torch.device("meta"))
    assert out["tokens"].device.type == "meta"
    assert out["index"].device.type == "cpu" and out["k"] is None


# ------------------------------------------------------------------ FP8 shapes
def test_sequence_multiple_pads_for_fp8_and_sequence_parallel():
    from megarl.models.forward import sequence_multiple

    assert sequence_multiple(4, False, None) == 1
    assert sequence_multiple(4, True, None) == 4
    assert sequence_multiple(1, False, "delayed") == 16
    assert sequence_multiple(4, True, "delayed") == 64  # 16 local tokens per TP rank
    assert sequence_multiple(2, True, "mxfp8") == 64
    # blockwise all-gathers quantized inputs under SP: 128 tokens (TE's all-gather check)
    assert sequence_multiple(2, True, "blockwise") == 256
    assert sequence_multiple(2, False, "blockwise") == 16


def test_fp8_refuses_weight_shapes_that_cannot_be_padded():
    from megarl.distributed import ParallelConfig
    from megarl.models.mcore_config import check_fp8_shapes

    fp8 = PrecisionConfig(dtype="bf16", fp8="hybrid")
    arch = arch_from_hf({**TINY_LLAMA, "intermediate_size": 136})
    with pytest.raises(ModelConfigError, match=r"MLP width / TP = 136 / 1"):
        check_fp8_shapes(arch, ParallelConfig(), fp8)
    check_fp8_shapes(ARCH, ParallelConfig(), fp8)  # 64 / 128 / 64: fine
    with pytest.raises(ModelConfigError, match="divisible by 16"):
        check_fp8_shapes(ARCH, ParallelConfig(tensor_parallel=8), fp8)
    # multi-latent attention: its own GEMMs (DeepSeek-V3's fit at TP 8; a latent of 520 not)
    ds = arch_from_hf("examples/models/deepseek-v3")
    check_fp8_shapes(ds, ParallelConfig(tensor_parallel=8), fp8)
    odd = arch_from_hf({**ds.hf_config, "kv_lora_rank": 520})
    with pytest.raises(ModelConfigError, match=r"kv_lora_rank \+ qk_rope_head_dim = 584"):
        check_fp8_shapes(odd, ParallelConfig(tensor_parallel=8), fp8)
    # gpt-oss: every GEMM fits 16 at TP 8, but blockwise under SP all-gathers a hidden of 2880
    oss = arch_from_hf("examples/models/gpt-oss-120b")
    experts = dict(expert_parallel=8, expert_tensor_parallel=1)  # (biased experts: ETP 1)
    sp = ParallelConfig(tensor_parallel=8, sequence_parallel=True, **experts)
    check_fp8_shapes(oss, sp, fp8)
    block = PrecisionConfig(dtype="bf16", fp8="e4m3", fp8_recipe="blockwise")
    check_fp8_shapes(oss, ParallelConfig(tensor_parallel=8, **experts), block)
    with pytest.raises(ModelConfigError, match="hidden_size = 2880 .blockwise with sequence"):
        check_fp8_shapes(oss, sp, block)


def test_attention_sinks_on_transformer_engine_are_refused_where_it_has_no_backend():
    """megatron needs TE >= 2.8 for sinks; TE before 2.12 cannot attend them on packed rows."""
    from megarl.models.mcore_config import te_attention_refusal

    oss = arch_from_hf("examples/models/gpt-oss-20b")
    assert te_attention_refusal(ARCH, packed=True, te_version="2.4.0") is None  # no sinks
    assert "pack_sequences: false" in te_attention_refusal(oss, packed=True, te_version="2.9.0")
    assert "pack_sequences: false" in te_attention_refusal(oss, packed=True, te_version=None)
    assert te_attention_refusal(oss, packed=False, te_version="2.9.0") is None
    assert te_attention_refusal(oss, packed=True, te_version="2.12.0") is None
    assert ">= 2.8" in te_attention_refusal(oss, packed=False, te_version="2.7.1")


# ------------------------------------------------------------------ no silent fallback
def test_missing_transformer_engine_on_gpu_is_an_error():
    from megarl.models.builder import BuildConfig, resolve_use_te

    pytest.importorskip("megatron.core")
    try:
        import transformer_engine  # noqa: F401

        pytest.skip("Transformer-Engine is installed here")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="transformer_engine: false"):
        resolve_use_te(PrecisionConfig(dtype="bf16"), BuildConfig(), gpu=True)
    local = PrecisionConfig(dtype="bf16", transformer_engine=False)
    assert resolve_use_te(local, BuildConfig(), gpu=True) is False
    assert resolve_use_te(PrecisionConfig(), BuildConfig(), gpu=False) is False
    with pytest.raises(ModelConfigError, match="needs a CUDA GPU"):
        resolve_use_te(PrecisionConfig(transformer_engine=True), BuildConfig(), gpu=False)
    with pytest.raises(ModelConfigError, match="transformer_engine=false"):
        PrecisionConfig(dtype="bf16", fp8="hybrid", transformer_engine=False)


# ------------------------------------------------------------------ context parallel
def test_context_parallel_is_refused_until_implemented():
    from megarl.distributed import ParallelConfig
    from megarl.distributed.topology import TopologyError

    with pytest.raises(TopologyError, match="context_parallel=2: context parallelism is not"):
        ParallelConfig(context_parallel=2)


# ------------------------------------------------------------------ FP8 MFU
def test_fp8_runs_report_mfu_against_the_fp8_and_the_bf16_peak():
    from megarl.metrics.throughput import precision_mfu

    h100 = "NVIDIA H100 80GB HBM3"
    got = precision_mfu(h100, torch.bfloat16, True, 1979e12 * 8 * 0.3, 8)
    assert got["mfu"] == pytest.approx(0.3)
    assert got["mfu_bf16"] == pytest.approx(0.3 * 1979 / 989)  # the data sheets' peaks
    assert precision_mfu(h100, torch.bfloat16, False, 989e12 * 0.5, 1) == {
        "mfu": pytest.approx(0.5)
    }
    assert precision_mfu("cpu", torch.float32, False, 1e12, 1) == {}


# ------------------------------------------------------------------ dispatch plan
def _megatron_dp_of(world: int, tp: int, pp: int) -> list[int]:
    """DP rank of every global rank under megatron's default order tp-cp-ep-dp-pp (TP fastest,
    PP slowest; CP = EP = 1)."""
    dp = world // (tp * pp)
    return [(r // tp) % dp for r in range(world)]


LAYOUTS = [  # world, trainer TP, PP, vLLM TP'
    (16, 4, 2, 2),  # instances inside TP groups; each DP share split over 4 x 2 ranks
    (16, 2, 1, 4),  # TP' > TP: an instance spans two DP ranks
    (8, 8, 1, 8),  # one instance = one DP rank
    (8, 2, 2, 1),  # CPU-like: every rank its own engine
    (4, 1, 1, 1),  # pure DP
    (64, 8, 4, 8),  # a 70B layout on 8 nodes
]


@pytest.mark.parametrize("world,tp,pp,vtp", LAYOUTS)
def test_every_prompt_is_generated_exactly_once(world, tp, pp, vtp):
    from megarl.rollout.placement.dispatch import DispatchPlan

    dp_of = _megatron_dp_of(world, tp, pp)
    plan = DispatchPlan.create(dp_of, vtp)
    prompts = 10  # per DP rank; deliberately not a multiple of the instances per DP rank
    counts = {d: prompts for d in set(dp_of)}
    generated = [req for i in range(len(plan.instances)) for req in plan.requests(i, counts)]
    assert sorted(generated) == sorted((d, j) for d in counts for j in range(prompts))
    for i, ranks in enumerate(plan.instances):
        # an instance only generates prompts of DP ranks it holds, and hands them to one of them
        for d, _ in plan.requests(i, counts):
            assert dp_of[plan.leader(d, i)] == d and plan.leader(d, i) in ranks
    # the work is spread: no instance generates more than its even share, rounded up
    per_instance = [len(plan.requests(i, counts)) for i in range(len(plan.instances))]
    share = prompts * len(counts) / len(plan.instances)
    assert max(per_instance) <= math.ceil(share) + len(counts)


def test_dispatch_refuses_a_vllm_tp_that_does_not_divide_the_world():
    from megarl.rollout.placement.dispatch import DispatchPlan

    with pytest.raises(ValueError, match="rollout.engine.tensor_parallel=3 must divide"):
        DispatchPlan.create([0] * 8, 3)


# ------------------------------------------------------------------ vLLM's model runner
@pytest.mark.parametrize(
    "runner, gpu, replay, env",
    [
        ("auto", True, True, {}),  # vLLM's choice (V2 with Triton), honouring the user's env
        ("auto", False, False, {}),
        ("v2", True, True, {"VLLM_USE_V2_MODEL_RUNNER": "1"}),
        ("v1", True, False, {"VLLM_USE_V2_MODEL_RUNNER": "0"}),
        ("v1", False, True, {"VLLM_USE_V2_MODEL_RUNNER": "0"}),  # CPU replay: megarl's capture
    ],
)
def test_the_model_runner_asked_for_is_what_vllm_is_told(runner, gpu, replay, env):
    from megarl.rollout.engine.checks import model_runner_env

    cfg = EngineConfig(model_runner=runner, routing_replay=replay)
    assert model_runner_env(cfg, gpu=gpu) == env


@pytest.mark.parametrize(
    "runner, gpu, replay, message",
    [
        ("v2", False, False, "model_runner=v2 on CPU: vLLM's Model Runner V2 needs Triton"),
        ("v1", True, True, "returns the routed experts from Model Runner V2 only"),
        ("v3", True, False, "model_runner='v3'; accepted: auto | v1 | v2"),
    ],
)
def test_a_model_runner_vllm_cannot_run_is_refused_before_it_starts(runner, gpu, replay, message):
    from megarl.rollout.engine.checks import model_runner_env

    with pytest.raises(RolloutConfigError, match=message):
        model_runner_env(EngineConfig(model_runner=runner, routing_replay=replay), gpu=gpu)


# ------------------------------------------------------------------ sync timing on GPU
def test_sync_timing_waits_for_queued_cuda_work(monkeypatch):
    """CUDA copies and NCCL calls are queued: the sync's seconds are measured after
    `torch.cuda.synchronize` (the one stand-in here is torch's CUDA call)."""
    from megarl.rollout.sync.reshard import wait_device

    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: waited.append(d))
    wait_device(torch.device("cpu"))
    assert waited == []
    wait_device(torch.device("cuda", 1))
    assert waited == [torch.device("cuda", 1)]
