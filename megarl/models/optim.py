"""megatron-core's optimizer (DistributedOptimizer when DP shards it) and LR schedule."""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    chunks: list[torch.nn.Module], cfg: OptimConfig, *, dtype: str, total_steps: int = 1
):
    """(optimizer, lr scheduler) for DDP-wrapped `chunks`. Also wires megatron's grad finalisation
    (DP reduce, TP reduce of sequence-parallel/qk-norm grads, tied-embedding sync) into the
    chunks' config, which the schedule calls after the last backward."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    oc = OptimizerConfig(
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
    )
    wire_grad_finalization(chunks)
    opt = get_megatron_optimizer(oc, chunks)
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
    from megatron.core.optimizer import DistributedOptimizer, Float16OptimizerWithFloat16Params

    targets: dict = {}  # id(param) -> (master, start, end): tensors compare by value
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer):
            groups = zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups, strict=True)
            for model_group, main_group in groups:
                for p, main in zip(model_group, main_group, strict=True):
                    # megatron's own map of the slice of `p` this DP rank's master holds
                    r = opt._get_model_param_range_map(p)["param"]
                    targets[id(p)] = (main, r.start, r.end)
        elif isinstance(opt, Float16OptimizerWithFloat16Params):
            groups = zip(opt.float16_groups, opt.fp32_from_float16_groups, strict=True)
            for model_group, main_group in groups:
                for p, main in zip(model_group, main_group, strict=True):
                    targets[id(p)] = (main, 0, p.numel())
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
