"""megatron-core's optimizer (DistributedOptimizer when DP shards it) and LR schedule."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from megarl.models.builder import drop_preserved_init

LR_STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    lr: float = 1e-5
    """Peak learning rate."""
    min_lr: float = 0.0
    """Floor of the decay schedule."""
    weight_decay: float = 0.0
    """Decoupled (AdamW) weight decay."""
    adam_beta1: float = 0.9
    """Adam's decay rate of the gradient's running mean."""
    adam_beta2: float = 0.999
    """Adam's decay rate of the squared gradient's running mean."""
    adam_eps: float = 1e-8
    """Added to Adam's denominator for numerical stability."""
    clip_grad: float = 1.0
    """Global grad-norm clip (across TP/PP/DP); 0 disables."""
    warmup_steps: int = 0
    """Linear warm-up steps."""
    decay_steps: int | None = None
    """Steps of LR decay after warm-up; None = the run's total steps."""
    lr_decay_style: str = "constant"
    """One of constant, linear, cosine."""
    distributed: bool = True
    """Shard optimizer state over DP (megatron DistributedOptimizer)."""

    def __post_init__(self):
        if self.lr_decay_style not in LR_STYLES:
            raise ValueError(f"optim.lr_decay_style={self.lr_decay_style!r}; accepted: {LR_STYLES}")
        if self.lr <= 0:
            raise ValueError(f"optim.lr={self.lr} must be > 0")


def build_optimizer(
    chunks: list[torch.nn.Module],
    cfg: OptimConfig,
    *,
    dtype: str,
    total_steps: int = 1,
    fp8_recipe: str | None = None,
):
    """(optimizer, lr scheduler) for DDP-wrapped `chunks` that hold their starting weights. The
    optimizer's fp32 masters are read from the parameters as they are now (`reload_masters`) and
    its Adam state is allocated (`allocate_state`). Also wires megatron's grad finalisation (DP
    reduce, TP reduce of sequence-parallel/qk-norm grads, tied-embedding sync) into the chunks'
    config, which the schedule calls after the last backward. `fp8_recipe`:
    `precision.fp8_recipe` when FP8 is on (megatron's DistributedOptimizer shards FP8
    parameters by it), else None."""
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    oc = megatron_config(cfg, dtype=dtype, fp8_recipe=fp8_recipe)
    wire_grad_finalization(chunks)
    opt = get_megatron_optimizer(oc, chunks)
    expert_norm_filter(opt)
    reload_masters(opt, chunks)
    allocate_state(opt)
    if dtype == "fp16":
        # megatron's fp16 optimizer unscales the grads by its dynamic loss scale before the
        # step; the schedule scales the loss by it only through `config.grad_scale_func`
        # (Megatron-LM's training loop sets the same). Without it the grads reach Adam 2**16 x
        # too small. bf16 / fp32: scale 1, nothing to wire.
        chunks[0].config.grad_scale_func = opt.scale_loss
    decay = cfg.decay_steps or max(1, total_steps - cfg.warmup_steps)
    sched = OptimizerParamScheduler(
        opt,
        init_lr=0.0 if cfg.warmup_steps else cfg.lr,
        max_lr=cfg.lr,
        min_lr=cfg.min_lr,
        lr_warmup_steps=cfg.warmup_steps,
        lr_decay_steps=cfg.warmup_steps + decay,
        lr_decay_style=cfg.lr_decay_style,
        start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )
    return opt, sched


def expert_norm_filter(opt) -> None:
    """Give the expert optimizer the expert-TP group for its duplicate filter. megatron-core
    0.16.1 hands every optimizer the dense TP group (optimizer/__init__.py:468-473), so the grad
    norm counts an expert parameter that is not TP-split (gpt-oss's expert fc2 biases) on dense
    TP rank 0 only (optimizer.py:156-159), while at EP > 1 the other TP ranks hold other experts:
    at TP 2 x EP 2 the norm missed half the experts' biases (0.523 for 0.534), and clipping
    then scaled the updates by it."""
    from megatron.core import parallel_state as ps

    for sub in getattr(opt, "chained_optimizers", [opt]):
        if any(g.get("is_expert_parallel") for g in sub.optimizer.param_groups):
            sub.tp_group = ps.get_expert_tensor_parallel_group()


def megatron_config(cfg: OptimConfig, *, dtype: str, fp8_recipe: str | None = None):
    """megatron-core's `OptimizerConfig` for `cfg` at parameter dtype `dtype` (fp32, bf16,
    fp16). `fp8_recipe` goes to it as Megatron-LM passes `--fp8-recipe`: the
    DistributedOptimizer shards an FP8 parameter as a flat view only under "delayed"
    (megatron-core 0.16.1 `optimizer/distrib_optimizer.py:364`)."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam",
        lr=cfg.lr,
        min_lr=cfg.min_lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_eps=cfg.adam_eps,
        clip_grad=cfg.clip_grad,
        bf16=dtype == "bf16",
        fp16=dtype == "fp16",
        # fp16's dynamic loss scale starts at 2**16 (torch's GradScaler default), not megatron's
        # 2**32: with one optimizer step per RL step, each overflow back-off costs a rollout
        initial_loss_scale=2.0**16,
        params_dtype=torch.float32,
        use_distributed_optimizer=cfg.distributed,
        fp8_recipe=fp8_recipe,
    )


def reload_masters(optimizer, chunks: list[torch.nn.Module]) -> None:
    """Set the optimizer's fp32 masters from the parameters as they are now, then drop the
    high-precision init values Transformer-Engine kept on the parameters (`drop_preserved_init`).

    Why: with `precision.fp8_param` megatron builds the layers under TE's
    `fp8_model_init(preserve_high_precision_init_val=torch.is_grad_enabled())`
    (megatron-core 0.16.1 `fp8_utils.py:640-645`), so each FP8 weight keeps a host copy of its
    random initial value, and the DistributedOptimizer takes its masters from that copy
    (`optimizer/distrib_optimizer.py:384-393`), not from the weights loaded into the model
    afterwards: the first step would write random init + update into every weight. Megatron-LM
    calls `reload_model_params()` after loading weights without the optimizer's state for the
    same reason (`megatron/training/checkpointing.py`, `load_checkpoint`). For 16-bit and fp32
    parameters it sets the masters to the values they already hold."""
    optimizer.reload_model_params()
    drop_preserved_init(chunks)


def allocate_state(optimizer) -> None:
    """Allocate Adam's state now, as the inner optimizer's first `step()` would (zero moments;
    torch's per-parameter step count at 0, TE FusedAdam's per-group count untouched), without
    taking a step: the first real step is then the same, bit for bit.

    Why: neither torch's Adam nor TE's FusedAdam allocates its moments before the first step, so
    the memory in use after the models are built (what the free-memory check before vLLM starts
    reads: `megarl.rollout.engine.checks.check_free_memory`) would be 8 bytes per parameter of this
    rank's shard short of the steady state."""
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(o, "optimizer", None)
        if inner is None:  # a stub: this rank holds no trainable parameter of the model
            continue
        if isinstance(inner, torch.optim.Adam) or hasattr(inner, "initialize_state"):
            for group in inner.param_groups:
                for p in group["params"]:
                    if len(inner.state[p]) == 0:
                        _init_state(inner, group, p)
        elif getattr(o, "init_state_fn", None) is not None:  # what megatron loads state into
            o.init_state_fn(inner, o.config)


def _init_state(inner, group: dict, p: torch.Tensor) -> None:
    if isinstance(inner, torch.optim.Adam):  # also AdamW: as torch's `Adam._init_group`
        if group.get("fused") or group.get("capturable"):
            step = torch.zeros((), dtype=torch.float32, device=p.device)
        else:  # torch keeps it on the CPU then, in the default float dtype
            f64 = torch.get_default_dtype() == torch.float64
            step = torch.tensor(0.0, dtype=torch.float64 if f64 else torch.float32)
        state = inner.state[p]
        state["step"] = step
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if group.get("amsgrad"):
            state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    else:  # TE FusedAdam: what its step() calls for a parameter without state
        remainders = getattr(inner, "store_param_remainders", False) and p.dtype == torch.bfloat16
        if "store_param_remainders" in inspect.signature(inner.initialize_state).parameters:
            inner.initialize_state(p, store_param_remainders=remainders)
        else:
            inner.initialize_state(p)


def wire_grad_finalization(chunks: list[torch.nn.Module]) -> None:
    from megatron.core.distributed import finalize_model_grads

    config = chunks[0].config
    config.finalize_model_grads_func = finalize_model_grads
    no_sync = [c.no_sync for c in chunks]
    config.no_sync_func = no_sync if len(no_sync) > 1 else no_sync[0]


def zero_grads(chunks: list[torch.nn.Module], optimizer=None) -> None:
    for c in chunks:
        c.zero_grad_buffer()
    if optimizer is not None:
        optimizer.zero_grad()


def main_param_writer(optimizer):
    """`write(param, value)` that sets the optimizer's fp32 master copy of a 16-bit `param`
    (this DP rank's shard of it under the DistributedOptimizer) from `value`, the parameter's
    whole tensor in full precision; None when no parameter has a master copy (fp32 training).
    Parameters without one (frozen, or fp32) are ignored.

    Why: megatron makes the masters from the 16-bit parameters, so a model loaded in bf16 starts
    with masters that sit exactly on bf16 values, and an update smaller than half a bf16 step
    (Adam at lr 1e-5 against a step of ~2e-4 at |w| = 0.05) changes no compute weight until
    several such updates add up. Masters read from the fp32 source instead keep the source's
    offsets from the bf16 grid, so each update moves the compute weights in expectation, as
    autocast over fp32 weights does."""
    # tensors compare by value: key by identity
    targets = {id(p): (main, start, end) for p, main, start, end in master_pairs(optimizer)}
    if not targets:
        return None

    @torch.no_grad()
    def write(param: torch.nn.Parameter, value: torch.Tensor) -> None:
        if id(param) not in targets:
            return
        main, start, end = targets[id(param)]
        if value.shape != param.shape:
            raise ValueError(f"master of a {tuple(param.shape)} parameter: got {value.shape}")
        flat = value.reshape(-1)[start:end].to(device=main.device, dtype=main.dtype)
        main.copy_(flat.view(main.shape))

    return write


def master_pairs(optimizer) -> list[tuple[torch.nn.Parameter, torch.Tensor, int, int]]:
    """(parameter, its fp32 master, start, end) for every parameter whose master is a tensor of
    its own: the 16-bit and FP8 parameters, under the DistributedOptimizer (the master holds the
    elements start:end of the flattened parameter, this DP rank's slice) or the Float16Optimizer
    (the whole parameter). fp32 parameters have none: the DistributedOptimizer's masters of them
    are views of the parameters, the FP32Optimizer steps the parameters themselves."""
    from megatron.core.optimizer import DistributedOptimizer, Float16OptimizerWithFloat16Params

    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer) and not opt.is_stub_optimizer:
            groups = zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups, strict=True)
            for model_group, main_group in groups:
                for p, main in zip(model_group, main_group, strict=True):
                    # megatron's own map of the slice of `p` this DP rank's master holds
                    r = opt._get_model_param_range_map(p)["param"]
                    out.append((p, main, r.start, r.end))
        elif isinstance(opt, Float16OptimizerWithFloat16Params):
            groups = zip(opt.float16_groups, opt.fp32_from_float16_groups, strict=True)
            for model_group, main_group in groups:
                for p, main in zip(model_group, main_group, strict=True):
                    out.append((p, main, 0, p.numel()))
    return out
