"""Run checkpoints: models, optimizer states, LR schedules, data position, RNG and step.

Layout: `RUN/checkpoints/step_000042/` holds a megatron `dist_checkpointing` checkpoint (the
trained models: actor, critic, or a reward model under `reward.`; their DistributedOptimizer
states in the fully-reshardable format, so a run can resume at another TP / PP / DP) plus
`trainer_state.json` (`files.STATE_FILE`, written by rank 0) and the run's tokenizer files
(from `RUN/tokenizer`). Other readers (`megarl convert mcore-to-hf`, `model.mcore_ckpt`) go
through `megarl.checkpoint.reader`. Every checkpoint is written to `step_N.tmp` and renamed by
rank 0 after all ranks finished (`_commit`), so a run killed while saving leaves the previous
checkpoint as the newest complete one. Pruning (`keep_last`) runs after the commit and never
removes the checkpoint just written. The keys inside are layout-free: chunk dicts are nested but
each ShardedTensor carries its global key. Which checkpoint a run resumes from, and what is
checked before it is read, is `vetting`'s.
"""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist

from megarl.checkpoint.files import (
    STATE_FILE,
    CheckpointError,
    copy_tokenizer_files,
    list_checkpoints,
    write_trainer_state,
)
from megarl.checkpoint.keys import has_value_head, strip_prefix
from megarl.checkpoint.vetting import check_dcp_metadata
from megarl.models.builder import unwrap
from megarl.models.lora import adapters_of

OPTIM_META = {"distrib_optim_sharding_type": "fully_reshardable"}


def _model_sd(chunks, prefix: str) -> dict:
    """The chunks' sharded state (of the GPTModel itself: DDP / Float16Module wrappers would
    add "module." to every key). A LoRA model's is what it trains: its adapters and a scalar
    head (a critic's, a reward model's); the frozen base is rebuilt from the run's model
    source, as a frozen reference is."""
    out = {}
    for i, c in enumerate(chunks):
        sd = unwrap(c).sharded_state_dict(prefix=prefix)
        if adapters_of([c]):
            keep = tuple(prefix + k for k in _lora_kept(c))
            sd = {k: v for k, v in sd.items() if k.startswith(keep)}
        out[f"chunk{i}"] = sd
    return out


def _lora_kept(chunk) -> tuple[str, ...]:
    """The key prefixes a LoRA chunk checkpoints: its adapters, and its scalar head."""
    return ("lora.", "output_layer.") if has_value_head(unwrap(chunk)) else ("lora.",)


def _sharded(models: dict, is_loading: bool) -> dict:
    """models: {name: (chunks, optimizer or None)} -> one sharded state dict."""
    sd = {}
    for name, (chunks, opt) in models.items():
        model_sd = _model_sd(chunks, f"{name}.")
        sd[name] = model_sd
        if opt is not None:
            # nested as is: the optimizer finds each parameter's sharded tensor by walking the
            # values; merging the chunks into one dict would drop parameters, since virtual
            # pipeline chunks share local names ("decoder.layers.0..." in every chunk)
            sd[f"{name}_optim"] = opt.sharded_state_dict(
                model_sd, is_loading=is_loading, metadata=OPTIM_META
            )
    return sd


def save(
    run_dir: str,
    step: int,
    models: dict,
    trainer_state: dict,
    *,
    keep_last: int,
    tokenizer_dir: str | None = None,
) -> str:
    """Collective. Write checkpoint `step` atomically; prune to the newest `keep_last`. The
    tokenizer files of `tokenizer_dir` (chat template, generation config) are copied in, so the
    checkpoint alone converts to a complete HF directory (`megarl convert mcore-to-hf`)."""
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
    if dist.get_rank() == 0:
        write_trainer_state(os.path.join(tmp, STATE_FILE), trainer_state)
        if tokenizer_dir is not None and os.path.isdir(tokenizer_dir):
            copy_tokenizer_files(tokenizer_dir, tmp)
        _commit(tmp, final)
        _prune(run_dir, final, keep_last)
    dist.barrier()
    return final


def _prune(run_dir: str, newest: str, keep_last: int) -> None:
    """Remove all but `keep_last` checkpoints; `newest` (just committed) always stays, whatever
    the steps of the others (a run started with trainer.resume=false beside older ones)."""
    if keep_last <= 0:
        return
    others = [path for _, path in list_checkpoints(run_dir) if path != newest]
    for path in others[: max(len(others) - (keep_last - 1), 0)]:
        shutil.rmtree(path, ignore_errors=True)


def _commit(tmp: str, final: str) -> None:
    """Rank 0, after every rank wrote its files: make `tmp` the checkpoint `final`. The one step
    after which a resume sees the checkpoint; a crash before it leaves the previous one newest."""
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)


def load_models(path: str, models: dict) -> None:
    """Collective. Load models and optimizers (any layout) from checkpoint `path`."""
    from megatron.core import dist_checkpointing

    check_dcp_metadata(path)
    for _, opt in models.values():
        if opt is not None:
            _materialize_optimizer_state(opt)
    sharded = _sharded(models, is_loading=True)
    _check_optimizer_split(path, sharded, set(dist_checkpointing.load_tensors_metadata(path)))
    try:
        loaded = dist_checkpointing.load(sharded, path)
    except Exception as e:
        raise RuntimeError(
            f"cannot load checkpoint {path} into this run's models ({e}); was it written for a "
            "different model architecture?"
        ) from e
    for name, (chunks, opt) in models.items():
        for i, c in enumerate(chunks):
            part = strip_prefix(loaded[name][f"chunk{i}"], f"{name}.")
            missing, unexpected = unwrap(c).load_state_dict(part, strict=False)
            unexpected = [k for k in unexpected if not k.endswith("_extra_state")]
            if adapters_of([c]):  # LoRA: the base came from the model source (`_model_sd`)
                missing = [k for k in missing if k.startswith(_lora_kept(c))]
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


def _check_optimizer_split(path: str, sharded: dict, file_keys: set[str]) -> None:
    """Refuse, naming the cause, a checkpoint whose optimizer state is split otherwise than this
    run's: an MoE model at expert_parallel > 1 keeps its dense and expert parameters in two
    optimizers (megatron's keys `chained_0.` / `chained_1.`), at EP 1 in one, and megatron-core
    0.16.1 cannot map one onto the other (it fails with a KeyError deep in its loader)."""

    def keys(tree) -> set[str]:
        if isinstance(tree, dict):
            return set().union(*(keys(v) for v in tree.values())) if tree else set()
        if isinstance(tree, list | tuple):
            return set().union(*(keys(v) for v in tree)) if tree else set()
        key = getattr(tree, "key", None)
        return {key} if isinstance(key, str) else set()

    want = {k for name, tree in sharded.items() if name.endswith("_optim") for k in keys(tree)}
    if not want:
        return
    chained_file = any(k.startswith("chained_") for k in file_keys)
    chained_run = any(k.startswith("chained_") for k in want)
    if chained_file != chained_run:
        written, here = ("two", "one") if chained_file else ("one", "two")
        raise CheckpointError(
            f"checkpoint {path}: its optimizer state is {written} optimizer(s) (an MoE model "
            f"keeps dense and expert parameters apart at parallel.expert_parallel > 1), this "
            f"run's is {here}; megatron-core cannot load one into the other. Accepted: resume "
            "with parallel.expert_parallel > 1 as the checkpoint was written (any TP / PP / DP "
            f"/ EP > 1), or start from its weights with a fresh optimizer: model.mcore_ckpt={path}"
        )


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
