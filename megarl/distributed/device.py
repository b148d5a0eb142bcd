"""Device selection, and the CPU emulation of CUDA that megatron-core needs.

megatron-core assumes CUDA in many places: `torch.cuda.current_device()` as a tensor device,
literal `device="cuda"` arguments, `Tensor.type() == "torch.cuda.FloatTensor"` checks in the
DistributedOptimizer and grad clipping, `.cuda()` calls, `torch.cuda.synchronize()`, and the CUDA
RNG-states tracker around initialisation and dropout. On a machine without a GPU we run the *same*
megatron code on CPU tensors by (all process-local, installed once by `setup()`):

- a `TorchFunctionMode` that rewrites any CUDA `device=` argument (and `Tensor.to("cuda")`) to CPU;
- `torch.cuda.current_device()` -> `torch.device("cpu")`, `Tensor.cuda()` -> identity,
  `torch.cuda.synchronize()` / stream and event calls -> no-ops;
- `Tensor.type()` with no argument reporting the `torch.cuda.*Tensor` name for CPU tensors, because
  megatron dispatches on that string;
- a CPU RNG-states tracker for `megatron.core.tensor_parallel.random`, whose "CUDA RNG state"
  (saved around a recomputed layer) is the CPU generator's.

Nothing here is active when CUDA is available: the GPU path is megatron-core unmodified. Causal
masks are passed explicitly by our forward steps so megatron never builds one on "cuda".
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings

import torch
from torch.overrides import TorchFunctionMode

from megarl.distributed import heap

log = logging.getLogger(__name__)
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*not installed.*")
warnings.filterwarnings("ignore", message=".*Falling back to Torch Norm.*")


def use_gpu() -> bool:
    """GPU unless MEGARL_DEVICE=cpu or no CUDA device exists."""
    if os.environ.get("MEGARL_DEVICE", "").lower() == "cpu":
        return False
    return torch.cuda.is_available()


def device() -> torch.device:
    if use_gpu():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def backend() -> str:
    """The process-group backend. On GPU a device-mapped one: CUDA tensors go through NCCL, CPU
    tensors (rewards, flags, metrics, object collectives) through gloo, so no collective needs
    its tensors moved and object collectives stay in host memory (torch picks "cpu" for them
    when the group has a CPU backend)."""
    return "cpu:gloo,cuda:nccl" if use_gpu() else "gloo"


def cpu_half_precision_note(dtype: str) -> str | None:
    """Why `dtype` ("bf16" / "fp16") will be slow on this CPU, or None when it has native
    instructions for it (AVX512-BF16 or AMX for bf16, AMX-FP16 for fp16). Without them torch
    emulates the GEMMs: measured on a 2-core AVX2 EPYC (2026-12-01), a 4352x512 @ 512x1024 bf16
    matmul ran at 1.1 GFLOP/s against 60 in fp32, and one RL step of the 18.9M-parameter peer
    workload took 200 s to train in bf16 against ~3 s in fp32."""
    if dtype == "bf16":
        if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported():
            return None
        isa = "AVX512-BF16 or AMX"
    elif dtype == "fp16":
        if torch.cpu._is_amx_fp16_supported():
            return None
        isa = "AMX-FP16"
    else:
        return None
    return (
        f"precision.dtype={dtype} on a CPU without {isa} instructions (torch's capability: "
        f"{torch.backends.cpu.get_cpu_capability()}): its matrix products are emulated, often "
        "50x slower than fp32; use precision.dtype=fp32 on this machine"
    )


def setup() -> None:
    """Select the device for this process: on GPU set the local CUDA device, on CPU install the
    emulation and glibc's heap reuse (`megarl.distributed.heap`) (idempotent)."""
    _patch_missing_te()
    if use_gpu():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        return
    install_cpu_emulation()
    heap.reuse_heap_blocks()  # the passes' temporaries from reused heap pages, not fresh mmaps


def _patch_missing_te() -> None:
    """megatron-core 0.16.1's MoE router references `te_general_gemm`, which is undefined when
    Transformer-Engine is absent (NameError); define it as None so the torch path is taken."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    _patch_mla_without_te()
    _patch_gdn_without_fla()
    _patch_optimizer_step_state()


def _patch_mla_without_te() -> None:
    """Without Transformer-Engine, megatron-core 0.16.1's `extensions.transformer_engine` leaves
    MagicMock placeholders that `multi_latent_attention.py:54-62` imports as `HAVE_TE = True`;
    its `isinstance(self.linear_proj, TELinear)` (line 185) then raises. Say there is no TE."""
    from megatron.core.transformer import multi_latent_attention as mla

    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        mla.HAVE_TE = False


def _patch_gdn_without_fla() -> None:
    """Without flash-linear-attention (Triton: never on CPU) megatron-core 0.16.1's GatedDeltaNet
    refuses to build (ssm/gated_delta_net.py:104-107). Give it a torch q / k L2 norm (fla's:
    x / sqrt(sum x^2 + 1e-6), in fp32) and megatron's own torch chunked delta rule, which it
    runs in deterministic mode (:370-380; a copy of transformers' reference kernel)."""
    from megatron.core.ssm import gated_delta_net as gdn

    if gdn.HAVE_FLA:
        return

    def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
        y = x.float()
        return (y * torch.rsqrt((y * y).sum(dim, keepdim=True) + eps)).to(x.dtype)

    gdn.l2norm = l2norm
    gdn.chunk_gated_delta_rule = gdn.torch_chunk_gated_delta_rule
    gdn.HAVE_FLA = True
    gdn.megarl_torch_delta_rule = True  # (a GPU build warns: correct, but slow)


def _patch_optimizer_step_state() -> None:
    """Without TE/Apex megatron-core 0.16.1 uses torch Adam, which keeps a per-parameter 'step'
    tensor; the DistributedOptimizer restores 'step' separately and then copies every state key
    from the checkpoint tensors, which have no 'step' (KeyError on every checkpoint load). Keep
    the already-restored 'step' instead."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    orig = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(orig, "_megarl_patched", False):
        return

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            gi, go = self.model_param_group_index_map[model_param]
            state = self.optimizer.state[self.optimizer.param_groups[gi]["params"][go]]
            if "step" in state:
                tensors = {**tensors, "step": state["step"]}
        return orig(self, model_param, tensors)

    _set_main_param_and_optimizer_states._megarl_patched = True
    DistributedOptimizer._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states


def _is_cuda(dev) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return isinstance(dev, int) and not isinstance(dev, bool)


class _CudaToCpu(TorchFunctionMode):
    """Rewrite CUDA device arguments to CPU for every torch function call."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func in (torch.Tensor.to, torch.Tensor.cuda) or getattr(func, "__name__", "") == "to":
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


def install_cpu_emulation() -> None:
    """Once per process (the patched `Tensor.type` carries the mark: the process's torch is the
    state, not this module)."""
    if getattr(torch.Tensor.type, "megarl_cpu_emulation", False):
        return
    mode = _CudaToCpu()
    mode.__enter__()  # process-wide for the rest of the process' life

    orig_type = torch.Tensor.type

    def _type(self, dtype=None, non_blocking=False, **kw):
        if dtype is None and not kw and self.device.type == "cpu" and self.dtype in _TYPE_NAMES:
            return _TYPE_NAMES[self.dtype]
        if isinstance(dtype, str) and ".cuda." in dtype:
            dtype = dtype.replace(".cuda.", ".")
        return orig_type(self, dtype, non_blocking, **kw) if dtype is not None else orig_type(self)

    _type.megarl_cpu_emulation = True
    torch.Tensor.type = _type
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.empty_cache = lambda: None
    torch.cuda.memory_allocated = lambda *a, **k: 0
    torch.cuda.max_memory_allocated = lambda *a, **k: 0
    torch.cuda.current_stream = lambda *a, **k: _NullStream()
    torch.cuda.default_stream = lambda *a, **k: _NullStream()
    torch.cuda.Stream = _NullStream
    torch.cuda.Event = _NullEvent
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    _install_rng_tracker()
    _patch_moe_host_splits()
    _patch_uneven_sequence_collectives()
    log.debug("megatron-core CUDA emulation installed: running on CPU")


class _NullStream:
    def __init__(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def record_event(self, *a, **k):
        return _NullEvent()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _NullEvent:
    def __init__(self, *a, **k):
        pass

    def record(self, *a, **k):
        pass

    def wait(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _patch_moe_host_splits() -> None:
    """The alltoall MoE dispatcher turns its split sizes into numpy only `if tensor.is_cuda`;
    on CPU they would stay tensors, which `all_to_all_single` rejects."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    orig = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.numpy()
        return orig(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _install_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """megatron's tracker semantics (named, seeded RNG streams entered with `fork`) over CPU
        generator states."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise ValueError(f"seed {seed} already exists")
            if name in self.states_:
                raise ValueError(f"rng state {name} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise ValueError(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    def initialize_rng_tracker(*args, force_reset: bool = False, **kwargs):
        if force_reset or not isinstance(mrandom._CUDA_RNG_STATE_TRACKER, CpuRNGStatesTracker):
            mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
            mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

    mrandom.initialize_rng_tracker = initialize_rng_tracker
    # activation recompute (`CheckpointFunction`) saves and restores "the CUDA RNG state" around
    # the recomputed forward; on CPU that state is the CPU generator's (one generator only)
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, *args, **kwargs: torch.set_rng_state(new_state)
    # torch.cuda.manual_seed is lazy on CPU builds; make megatron's "default state" seeding real
    # (torch.manual_seed itself calls torch.cuda.manual_seed_all, so seed the CPU generator only)
    torch.cuda.manual_seed = lambda seed: torch.random.default_generator.manual_seed(int(seed))
    torch.cuda.manual_seed_all = lambda seed: None
    initialize_rng_tracker(force_reset=True)


def _patch_uneven_sequence_collectives() -> None:
    """gloo has no all-gather / reduce-scatter of unequal pieces, which megatron's alltoall MoE
    dispatcher uses at TP > 1 with EP > 1 (its expert-TP ranks receive different token counts:
    `output_split_sizes` / `input_split_sizes`). Emulated: all-gather padded to the largest
    piece, then cut; reduce-scatter as an all-reduce of the whole buffer, then this rank's
    piece. Equal pieces keep megatron's own path."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    gather, scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def gather_v(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        n = max(output_split_sizes)
        padded = input_.new_zeros((n, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in output_split_sizes]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([p[:k] for p, k in zip(parts, output_split_sizes, strict=True)])

    def scatter_v(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        start = sum(input_split_sizes[: group.rank()])
        return total[start : start + input_split_sizes[group.rank()]]

    mappings._gather_along_first_dim = gather_v
    mappings._reduce_scatter_along_first_dim = scatter_v
