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
