"""GPU-path defects found by reading megarl against megatron-core 0.16.1 and vLLM 0.32, pinned
down on CPU with stand-ins for the objects only a GPU run builds."""

from __future__ import annotations

import math

import torch


# ------------------------------------------------------------------ fp16 loss scaling
class _FakeOptimizer:
    """What `build_optimizer` and `OptimizerParamScheduler` touch of a megatron optimizer."""

    def __init__(self, scaled: bool):
        self.param_groups = [{"lr": 0.0, "weight_decay": 0.0}]
        self.grad_scaler = object() if scaled else None

    def scale_loss(self, loss):
        return loss * 2.0**32


def test_fp16_loss_scale_overflow_is_not_counted_as_a_diverged_step(monkeypatch):
    from megarl.trainer import update

    monkeypatch.setattr(update.dist, "all_reduce", lambda t, *a, **k: None)

    class Sched:
        def step(self, n):
            pass

    class Refusing(_FakeOptimizer):
        def step(self):
            return False, None, None  # megatron: found_inf in the scaled grads, step skipped

    applied, norm, overflow = update.optimizer_step(Refusing(scaled=True), Sched(), True, None)
    assert (applied, overflow) == (False, True) and math.isnan(norm)
    # a non-finite loss is still a dropped step, not an overflow
    applied, _, overflow = update.optimizer_step(Refusing(scaled=True), Sched(), False, None)
    assert (applied, overflow) == (False, False)
    # bf16 / fp32 (no grad scaler): a refused step stays a skipped step
    _, _, overflow = update.optimizer_step(Refusing(scaled=False), Sched(), True, None)
    assert overflow is False


# ------------------------------------------------------------------ vLLM reload entry point
def test_reload_goes_through_the_workers_entry_point(monkeypatch):
    # vLLM 0.32 `Worker.reload_weights` (v1/worker/gpu_worker.py, also CPUWorker's) wraps the
    # runner's reload in `set_current_vllm_config`; calling the runner directly skips it
    import contextlib

    from megarl.rollout.engine import vllm_patches

    monkeypatch.setattr(vllm_patches, "cpu_experts_prepacked", lambda m: contextlib.nullcontext())
    calls = []

    class Runner:
        def get_model(self):
            return torch.nn.Module()

        def reload_weights(self, **kw):
            calls.append("runner")

    class Worker:
        model_runner = Runner()

        def reload_weights(self, **kw):
            calls.append("worker")
            self.model_runner.reload_weights(**kw)

    vllm_patches.reload(Worker(), iter([]))
    assert calls == ["worker", "runner"]


# ------------------------------------------------------------------ sync timing on GPU
def test_sync_timing_waits_for_queued_cuda_work(monkeypatch):
    from megarl.rollout.sync.reshard import wait_device

    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: waited.append(d))
    wait_device(torch.device("cpu"))
    assert waited == []
    wait_device(torch.device("cuda", 1))
    assert waited == [torch.device("cuda", 1)]
