"""A judge model's vLLM engine in this process, beside the policy's: built from an HF directory
with the judge's real weights (frozen; no sync ever writes it), generating answers to token-id
prompts under a time limit.

Placement: every trainer process holds one and judges the samples it scores, so the policy's
engines (colocated or separate) never switch weights. CPU: a TP=1 engine with its own KV cache.
GPU (not run yet): it takes `gpu_memory_utilization` of the device; TP=1 beside colocated TP=1
engines only (vLLM's groups are process-wide: a second engine of another TP fails
`ensure_model_parallel_initialized`, vllm/distributed/parallel_state.py:2392; the trainer
refuses the other layouts).
"""

from __future__ import annotations

import logging
import os
import time

from megarl.convert.hf_io import LazyHFTensors
from megarl.models.hf_config import arch_from_hf
from megarl.rollout.config import EngineConfig, SamplingConfig
from megarl.rollout.engine.engine import RolloutEngine, write_model_dir
from megarl.rollout.engine.stop_tokens import resolve_stop_tokens

log = logging.getLogger(__name__)


class JudgeEngine:
    """The judge's engine (module docstring); `generate` is `megarl.rewards.judge.Generate`."""

    def __init__(
        self,
        model_dir: str,
        out_dir: str,
        *,
        tokenizer,
        max_tokens: int,
        temperature: float,
        max_model_len: int,
        kv_cache_memory_bytes: int,
        gpu_memory_utilization: float,
        dtype: str = "fp32",
    ):
        """`model_dir`: the judge's HF directory; `out_dir`: the run's (the engine reads its
        config.json from out_dir/judge_model); `tokenizer`: the judge's (its EOS ids end an
        answer); temperature 0 = greedy. Collective as any engine start."""
        self.arch = arch_from_hf(model_dir, where=f"reward.judge.model={model_dir}")
        engine_dir = os.path.join(out_dir, "judge_model")
        write_model_dir(engine_dir, self.arch)  # every rank: the same bytes, atomically
        sampling = SamplingConfig(
            n=1, temperature=temperature or 1.0, max_tokens=max_tokens,
            stop_token_ids=resolve_stop_tokens(None, tokenizer, self.arch.hf_config, [model_dir]),
        )  # fmt: skip
        cfg = EngineConfig(
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            gpu_memory_utilization=gpu_memory_utilization,
            sleep_between_steps=False,
            max_model_len=max_model_len,
        )
        t0 = time.perf_counter()
        self.engine = RolloutEngine(engine_dir, self.arch, sampling, cfg, dtype=dtype)
        tensors = LazyHFTensors(model_dir)
        self.engine.weights.load_hf((name, tensors.get(name)) for name in tensors)
        log.info(
            "judge engine up with %s's weights (%.2f GB on disk) in %.1f s",
            model_dir, tensors.total_bytes() / 1e9, time.perf_counter() - t0,
        )  # fmt: skip
        self.max_tokens, self.greedy = max_tokens, temperature == 0
        self._calls = 0

    def generate(self, prompts: list[list[int]], timeout_s: float):
        """(answer token ids, finished) per prompt; requests unfinished after `timeout_s`
        seconds are dropped (answer [], finished False)."""
        engine, deadline = self.engine, time.monotonic() + timeout_s
        self._calls += 1
        keys = [f"judge/{self._calls}/{i}" for i in range(len(prompts))]
        for key, ids in zip(keys, prompts, strict=True):
            engine.submit(
                key, ids, seed=self._calls, max_tokens=self.max_tokens, greedy=self.greedy
            )
        answers: dict[str, list[int]] = {}
        while engine.has_unfinished() and time.monotonic() < deadline:
            for key, ids, _, _ in engine.step():
                answers[key] = ids
        if engine.has_unfinished():
            engine.abort_submitted()
        return [answers.get(k, []) for k in keys], [k in answers for k in keys]

    def close(self) -> None:
        self.engine.close()
