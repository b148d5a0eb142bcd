"""Run checkpoints: models, optimizer states, LR schedules, data position, RNG and step.

Layout: `RUN/checkpoints/step_000042/` holds a megatron `dist_checkpointing` checkpoint (actor,
critic, their DistributedOptimizer states in the fully-reshardable format, so a run can resume at
another TP / PP / DP) plus `trainer_state.pt` (step, sampler, schedulers, RNG; written by rank 0).
Every checkpoint is written to `step_N.tmp` and renamed by rank 0 after all ranks finished, so a
run killed while saving leaves the previous checkpoint as the newest complete one. The keys inside
are layout-free: chunk dicts are nested but each ShardedTensor carries its global key.
"""

from __future__ import annotations

import logging
import os
import re
import shutil

import torch
import torch.distributed as dist

from megarl.models.builder import unwrap

log = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"^step_(\d+)$")
OPTIM_META = {"distrib_optim_sharding_type": "fully_reshardable"}


def _model_sd(chunks, prefix: str) -> dict:
    # the GPTModel itself: DDP / Float16Module wrappers would add "module." to every key
    return {f"chunk{i}": unwrap(c).sharded_state_dict(prefix=prefix) for i, c in enumerate(chunks)}


def _sharded(models: dict, is_loading: bool) -> dict:
    """models: {name: (chunks, optimizer or None)} -> one sharded state dict."""
    sd = {}
    for name, (chunks, opt) in models.items():
        model_sd = _model_sd(chunks, f"{name}.")
        sd[name] = model_sd
        if opt is not None:
            flat = {}
            for part in model_sd.values():
                flat.update(part)
            sd[f"{name}_optim"] = opt.sharded_state_dict(
                flat, is_loading=is_loading, metadata=OPTIM_META
            )
    return sd


def list_checkpoints(run_dir: str) -> list[tuple[int, str]]:
    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        if m and os.path.exists(os.path.join(root, name, "trainer_state.pt")):
            out.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(out)


def latest_checkpoint(run_dir: str) -> str | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1][1] if ckpts else None


def save(run_dir: str, step: int, models: dict, trainer_state: dict, *, keep_last: int) -> str:
    """Collective. Write checkpoint `step` atomically; prune to the newest `keep_last`."""
    from megatron.core import dist_checkpointing

    root = os.path.join(run_dir, "checkpoints")
    final = os.path.join(root, f"step_{step:06d}")
    tmp = final + ".tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    for _, opt in models.values():  # a run whose every update so far was skipped (NaN)
        if opt is not None:
            _materialize_optimizer_state(opt)
    dist_checkpointing.save(_sharded(models, is_loading=False), tmp)
    if os.environ.get("MEGARL_TEST_CRASH_IN_SAVE"):  # fault injection for the crash test
        raise RuntimeError("MEGARL_TEST_CRASH_IN_SAVE: crash between writing and committing")
    if dist.get_rank() == 0:
        state = {**trainer_state, "torch_rng": torch.get_rng_state()}
        torch.save(state, os.path.join(tmp, "trainer_state.pt.tmp"))
        os.replace(os.path.join(tmp, "trainer_state.pt.tmp"), os.path.join(tmp, "trainer_state.pt"))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)  # the commit point
        for _, old in list_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load(path: str, models: dict) -> dict:
    """Collective. Load models and optimizers (any layout) from `path`; return trainer state."""
    from megatron.core import dist_checkpointing

    state_file = os.path.join(path, "trainer_state.pt")
    if not os.path.exists(state_file):
        raise FileNotFoundError(f"{path} is not a complete megarl checkpoint (no trainer_state.pt)")
    for _, opt in models.values():
        if opt is not None:
            _materialize_optimizer_state(opt)
    try:
        loaded = dist_checkpointing.load(_sharded(models, is_loading=True), path)
    except Exception as e:
        raise RuntimeError(
            f"cannot load checkpoint {path} into this run's models ({e}); was it written for a "
            "different model architecture?"
        ) from e
    for name, (chunks, opt) in models.items():
        for i, c in enumerate(chunks):
            part = _strip(loaded[name][f"chunk{i}"], f"{name}.")
            missing, unexpected = unwrap(c).load_state_dict(part, strict=False)
            unexpected = [k for k in unexpected if not k.endswith("_extra_state")]
            if missing or unexpected:
                raise RuntimeError(
                    f"checkpoint {path}: {name} chunk {i} missing keys {missing}, "
                    f"unexpected keys {unexpected}"
                )
        if opt is not None:
            # the dummy state only served to describe the layout; megatron re-allocates it
            # (with the checkpoint's 'step') when the torch optimizer's state is empty
            for o in getattr(opt, "chained_optimizers", [opt]):
                o.optimizer.state.clear()
            opt.load_state_dict(loaded[f"{name}_optim"])
            _unshare_step_tensors(opt)
    state = torch.load(state_file, weights_only=False)
    torch.set_rng_state(state.pop("torch_rng"))
    return state


def _materialize_optimizer_state(opt) -> None:
    """A fresh torch Adam has no per-param state (no 'step'), and megatron's DistributedOptimizer
    then cannot describe its state for loading (megatron-core 0.16 without TE/Apex). Take one
    no-op step (zero grads, lr 0, no weight decay) so every state tensor exists."""
    for o in getattr(opt, "chained_optimizers", [opt]):
        inner = o.optimizer
        params = [p for g in inner.param_groups for p in g["params"] if p.numel()]
        if all(len(inner.state[p]) for p in params):
            continue
        saved = [(g["lr"], g.get("weight_decay", 0.0)) for g in inner.param_groups]
        for g in inner.param_groups:
            g["lr"], g["weight_decay"] = 0.0, 0.0
        for p in params:
            p.grad = torch.zeros_like(p)
        inner.step()
        inner.zero_grad()
        for g, (lr, wd) in zip(inner.param_groups, saved, strict=True):
            g["lr"], g["weight_decay"] = lr, wd


def _unshare_step_tensors(opt) -> None:
    """megatron-core 0.16 (no TE/Apex) restores torch Adam's per-parameter 'step' as ONE tensor
    shared by every parameter; torch increments it in place once per parameter, which breaks
    Adam's bias correction after a resume. Give each parameter its own copy."""
    for o in getattr(opt, "chained_optimizers", [opt]):
        for state in o.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def _strip(sd: dict, prefix: str) -> dict:
    return {(k[len(prefix) :] if k.startswith(prefix) else k): v for k, v in sd.items()}
