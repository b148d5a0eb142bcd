"""Run checkpoints: models, optimizer states, LR schedules, data position, RNG and step.

Layout: `RUN/checkpoints/step_000042/` holds a megatron `dist_checkpointing` checkpoint (the
trained models: actor, critic, or a reward model under `reward.`; their DistributedOptimizer
states in the fully-reshardable format, so a run can resume at another TP / PP / DP) plus
`trainer_state.json` (step, sampler, schedulers, model config, torch's RNG state as base64;
written by rank 0) and the run's tokenizer files (from `RUN/tokenizer`).
Other readers (`megarl convert mcore-to-hf`, `model.mcore_ckpt`) go through
`megarl.convert.source`. Every checkpoint is written to `step_N.tmp` and renamed
by rank 0 after all ranks finished (`_commit`), so a run killed while saving leaves the previous
checkpoint as the newest complete one. Pruning (`keep_last`) runs after the commit and never
removes the checkpoint just written. The keys inside are layout-free: chunk dicts are nested but
each ShardedTensor carries its global key.

Damaged checkpoints: `resumable` walks the checkpoints newest first and skips one whose trainer
state cannot be read or whose tensor files are missing or shorter than its `.metadata` records
(`check_dcp_complete`: file sizes only, no tensor is read), with a warning naming it and the one
resumed from. A skipped checkpoint is never deleted: rank 0 renames it `step_N.unreadable`, out
of the way of pruning and of the run's next save of step N.

Untrusted files: a checkpoint directory may come from elsewhere, and reading it must not run
code. The trainer state is JSON (no pickle); the tensor files are read by torch with
`weights_only=True`; the pickled `.metadata` of torch.distributed.checkpoint is vetted first
(`megarl.convert.checkpoint.check_dcp_metadata`). Checkpoints written before the JSON state hold
`trainer_state.pt`, which is read with `torch.load(weights_only=True)` (plain containers, numbers,
strings and tensors only) and refused, naming the file, if it holds anything else.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import pickle
import re
import shutil

import torch
import torch.distributed as dist

from megarl.convert.checkpoint import (
    CheckpointError,
    IncompleteCheckpoint,
    check_dcp_complete,
    check_dcp_metadata,
)
from megarl.models.builder import unwrap

log = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"^step_(\d+)$")
OPTIM_META = {"distrib_optim_sharding_type": "fully_reshardable"}
STATE_FILE = "trainer_state.json"
LEGACY_STATE_FILE = "trainer_state.pt"  # a pickle, written by megarl before the JSON state
STATE_FORMAT = "megarl-trainer-state/1"
STATE_KEYS = ("step", "sampler", "arch", "torch_rng")
"""Keys every trainer state holds; besides them `<role>_sched` per trained role (`actor_sched`,
`critic_sched`, `reward_sched`), `archs` for a role built from another model, and
`reward_model_stats` (running reward-model statistics)."""


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
            # nested as is: the optimizer finds each parameter's sharded tensor by walking the
            # values; merging the chunks into one dict would drop parameters, since virtual
            # pipeline chunks share local names ("decoder.layers.0..." in every chunk)
            sd[f"{name}_optim"] = opt.sharded_state_dict(
                model_sd, is_loading=is_loading, metadata=OPTIM_META
            )
    return sd


def list_checkpoints(run_dir: str) -> list[tuple[int, str]]:
    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        if m and any(
            os.path.exists(os.path.join(root, name, f)) for f in (STATE_FILE, LEGACY_STATE_FILE)
        ):
            out.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(out)


def latest_checkpoint(run_dir: str) -> str | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1][1] if ckpts else None


def resumable(run_dir: str, check=None) -> tuple[str, dict] | None:
    """Collective (every rank, before the models exist). The newest checkpoint of `run_dir`
    that is complete, as (directory, trainer state), or None when there is none.

    A checkpoint that raises `IncompleteCheckpoint` (unreadable trainer state, a tensor file
    missing or cut) is skipped with a warning and renamed aside, never deleted (module doc).
    `check(path, state)` adds the caller's checks; what it raises (a checkpoint of another
    model, say) stops the run as before: such a checkpoint is whole, just not this run's."""
    skipped, found = [], None
    for _, path in reversed(list_checkpoints(run_dir)):
        try:
            state = read_trainer_state(path)
            check_dcp_complete(path)
        except IncompleteCheckpoint as e:
            skipped.append((path, str(e)))
            continue
        if check is not None:
            check(path, state)
        found = (path, state)
        break
    if not skipped:
        return found
    dist.barrier()  # every rank has read what it needs from the skipped directories
    newest = f"resuming from {found[0]}" if found else "no complete checkpoint left: step 0"
    for path, why in skipped:
        aside = _aside(path)
        if dist.get_rank() == 0:
            os.replace(path, aside)
            log.warning("skipped checkpoint %s (%s); kept as %s; %s", path, why, aside, newest)
    dist.barrier()
    return found


def _aside(path: str) -> str:
    """`step_N.unreadable` (`.unreadable.2`, ... when taken): where a skipped checkpoint goes."""
    aside, k = f"{path}.unreadable", 1
    while os.path.exists(aside):
        k += 1
        aside = f"{path}.unreadable.{k}"
    return aside


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
        _write_trainer_state(os.path.join(tmp, STATE_FILE), trainer_state)
        if tokenizer_dir is not None and os.path.isdir(tokenizer_dir):
            from megarl.convert.hf_io import copy_tokenizer_files

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


def _write_trainer_state(path: str, trainer_state: dict) -> None:
    """JSON: plain values only, so reading it back can run no code. A value that is not plain
    fails here, at the first save, not at the resume."""
    rng = torch.get_rng_state().numpy().tobytes()
    state = {
        "format": STATE_FORMAT,
        **trainer_state,
        "torch_rng": base64.b64encode(rng).decode("ascii"),
    }
    with open(path + ".tmp", "w") as f:
        json.dump(state, f, indent=1)
    os.replace(path + ".tmp", path)


def read_trainer_state(path: str) -> dict:
    """The trainer state of checkpoint directory `path` (`torch_rng` as a uint8 tensor); raises
    `CheckpointError` naming the file when it is missing, malformed or unsafe to read."""
    state_file = os.path.join(path, STATE_FILE)
    if os.path.exists(state_file):
        try:
            with open(state_file) as f:
                state = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise IncompleteCheckpoint(
                f"{state_file}: not a readable megarl trainer state ({e})"
            ) from e
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            got = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise CheckpointError(f"{state_file}: format {got!r}; expected {STATE_FORMAT!r}")
        try:
            rng = base64.b64decode(state["torch_rng"], validate=True)
        except (KeyError, TypeError, ValueError) as e:
            raise IncompleteCheckpoint(f"{state_file}: torch_rng is not base64 bytes ({e})") from e
        state["torch_rng"] = torch.frombuffer(bytearray(rng), dtype=torch.uint8)
    elif os.path.exists(os.path.join(path, LEGACY_STATE_FILE)):
        state_file = os.path.join(path, LEGACY_STATE_FILE)
        state = _read_legacy_state(state_file, path)
    else:
        raise IncompleteCheckpoint(f"{path} is not a complete megarl checkpoint (no {STATE_FILE})")
    missing = [k for k in STATE_KEYS if k not in state]
    if missing:
        raise IncompleteCheckpoint(f"{state_file}: keys {missing} are missing")
    return state


def _read_legacy_state(state_file: str, path: str) -> dict:
    """A pickled `trainer_state.pt` of an older megarl, read without running code."""
    try:
        state = torch.load(state_file, weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's message is a page long; its "Unsupported global: GLOBAL x" names the culprit
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        why = f"it refers to {found.group(1)}" if found else str(e).splitlines()[0]
        raise CheckpointError(
            f"{state_file}: refusing to load this old-format (pickled) trainer state: it holds "
            f"more than the tensors, numbers, strings, lists and dicts megarl writes ({why}), "
            "so it may have been tampered with and loading it could run code. Delete the "
            f"checkpoint {path} to resume from the one before it, or start a new run directory "
            "(--out) or set trainer.resume=false"
        ) from None
    except (OSError, RuntimeError, EOFError) as e:
        raise IncompleteCheckpoint(f"{state_file}: not a readable trainer state ({e})") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"{state_file}: expected a dict, got {type(state).__name__}")
    log.warning(
        "%s: old-format trainer state, read safely (weights_only); the next save writes %s",
        state_file,
        STATE_FILE,
    )
    return state


def load_models(path: str, models: dict) -> None:
    """Collective. Load models and optimizers (any layout) from checkpoint `path`."""
    from megatron.core import dist_checkpointing

    check_dcp_metadata(path)
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
