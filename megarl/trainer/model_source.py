"""Where a run's model comes from, resolved once at the start of
`megarl.trainer.recipe.build_run`, and the tokenizer the run keeps beside its checkpoints.

`resolve_model(cfg)` returns `cfg` with `model.*` naming directories every later reader takes as
they are (architecture, tokenizer, weight files, the rollout engine's model directory):
- `model.hf` naming a GGUF file: global rank 0 converts it once into the cache
  (`megarl.convert.gguf.cached_hf_dir`, keyed by the file's sha256; a later run with the same
  file reuses it) while every other rank waits (on a gloo group with a `CONVERT_TIMEOUT` of
  its own), then all use the cached HF directory. The cache root (`MEGARL_CACHE`, default
  `~/.cache/megarl`) must be visible to every node of a multi-node run; otherwise convert ahead
  (`megarl convert gguf-to-hf`) and set `model.hf` to the directory.
- `model.mcore_ckpt` naming a trainer checkpoint or a run directory (its newest complete
  checkpoint): the checkpoint's `actor` weights (a reward-model stage: its `reward` ones, else
  `actor`) start the run; its optimizer state, schedule and step do not (a fresh run, unlike
  `trainer.resume`). Its kept tokenizer is the default
  `model.tokenizer`.

`check_shape_source` checks that what a dry run and `megarl plan` read (the model's shape)
exists on this machine. `keep_tokenizer` (rank 0) copies the run's tokenizer files (chat
template and generation config included) into `RUN/tokenizer`, from where every checkpoint and
HF export takes them.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import shutil
import uuid

import torch.distributed as dist

from megarl.checkpoint.files import copy_tokenizer_files
from megarl.checkpoint.reader import TRAINER, open_checkpoint
from megarl.config import ConfigError, RunConfig
from megarl.convert.gguf import cache_root, cached_hf_dir, gguf_hf_config, is_gguf
from megarl.errors import UserError
from megarl.models.hf_config import ModelArch, arch_from_hf

log = logging.getLogger("megarl")
CONVERT_TIMEOUT = datetime.timedelta(hours=4)
"""How long the other ranks wait for rank 0's GGUF conversion."""


def resolve_model(cfg: RunConfig, roles: tuple[str, ...] = ("actor",)) -> RunConfig:
    """See the module docstring; `roles`: of a trainer checkpoint, the first of these it holds
    starts the run (a reward-model stage: `reward`, else `actor`). Collective when `model.hf` is
    a file (torch.distributed must be initialised); raises a `UserError` naming the key on every
    rank."""
    m = cfg.model
    if m.hf is not None and os.path.isfile(m.hf):
        m = dataclasses.replace(m, hf=gguf_on_rank0(m.hf))
    if m.mcore_ckpt is not None:
        try:
            source = open_checkpoint(m.mcore_ckpt, roles)
        except UserError as e:
            raise ConfigError(f"model.mcore_ckpt={m.mcore_ckpt!r}: {e}") from e
        if m.tokenizer is None and source.tokenizer_dir is None:
            raise ConfigError(
                f"model.mcore_ckpt={m.mcore_ckpt!r}: {source.path} keeps no tokenizer; set "
                "model.tokenizer to the model's tokenizer directory"
            )
        if source.kind == TRAINER and _rank() == 0:
            log.info(
                "model.mcore_ckpt: the %s weights of %s; its optimizer state, schedule and "
                "step are not used (a new run starts at step 0)",
                source.role,
                source.describe(),
            )
        m = dataclasses.replace(
            m, mcore_ckpt=source.path, tokenizer=m.tokenizer or source.tokenizer_dir
        )
    return dataclasses.replace(cfg, model=m)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def gguf_on_rank0(path: str, key: str = "model.hf") -> str:
    """The cached HF directory of GGUF file `path` (named by config key `key`), converted by
    global rank 0 only. Collective."""
    box: list = [None, None, False]  # (directory, error message, a user error?)
    failed = None
    if _rank() == 0:
        try:
            box[0] = cached_hf_dir(path)
        except Exception as e:  # noqa: BLE001 - every rank raises it below (none waits forever)
            failed, box[1], box[2] = e, f"{key}={path!r}: {e}", isinstance(e, UserError)
    if dist.is_initialized() and dist.get_world_size() > 1:
        # the others wait here while rank 0 converts: a big file takes longer than the default
        # group's timeout (NCCL: 10 minutes), so the wait is on a gloo group of its own
        group = dist.new_group(backend="gloo", timeout=CONVERT_TIMEOUT)
        dist.broadcast_object_list(box, src=0, group=group)
        dist.destroy_process_group(group)
    if failed is not None and not box[2]:
        raise failed
    if box[1] is not None:
        raise ConfigError(box[1]) if box[2] else RuntimeError(f"on rank 0: {box[1]}")
    if not os.path.isfile(os.path.join(box[0], "config.json")):
        raise ConfigError(
            f"{key}={path!r}: rank {_rank()} does not see the converted directory {box[0]}; "
            f"MEGARL_CACHE ({cache_root()}) must be shared by every node, or convert ahead with "
            f"`megarl convert gguf-to-hf` and set {key} to the directory"
        )
    return box[0]


def local_model_path(path: str, key: str, accepted: str) -> str:
    """`path` (named by config key `key`) as a directory: a GGUF file converted once by global
    rank 0 (`gguf_on_rank0`: collective), a directory as it is; another file or a missing path
    is refused with `accepted`."""
    if os.path.isfile(path):
        if not is_gguf(path):
            raise ConfigError(f"{key}={path!r} is a file but not GGUF; accepted: {accepted}")
        return gguf_on_rank0(path, key)
    if not os.path.isdir(path):
        raise ConfigError(f"{key}={path!r} does not exist; accepted: {accepted}")
    return path


def arch_from_small_files(
    path: str, key: str, accepted: str, roles: tuple[str, ...] = ("actor",)
) -> ModelArch:
    """The architecture of the model at `path` (named by config key `key`) from its small files
    alone: a GGUF file's metadata (not converted), config.json, or a megarl checkpoint's own
    records (the first of `roles`): what a dry run and `megarl plan` read."""
    if os.path.isfile(path) and is_gguf(path):
        return arch_from_hf(gguf_hf_config(path), where=f"{key}={path}")
    if not os.path.isdir(path):
        raise ConfigError(
            f"{key}={path!r} does not exist on this machine; the dry run and the plan read its "
            f"shape from it (config.json, trainer_state.json or megarl_model.json, or a GGUF "
            f"file's metadata). Accepted: {accepted}"
        )
    if os.path.isfile(os.path.join(path, "config.json")):
        return arch_from_hf(path, where=f"{key}={path}")
    try:
        return open_checkpoint(path, roles).arch
    except UserError as e:
        raise ConfigError(f"{key}={path!r}: {e}; accepted: {accepted}") from e


def load_arch(cfg: RunConfig, roles: tuple[str, ...] = ("actor",)) -> ModelArch:
    """The model's architecture from its small files: `model.config`, `model.hf`'s config.json
    (a GGUF file not converted yet, as in a dry run: its metadata), or the checkpoint of
    `model.mcore_ckpt` (its first role of `roles`; `megarl.checkpoint.reader`)."""
    m = cfg.model
    if m.config is not None:
        return arch_from_hf(m.config, where="model.config")
    if m.hf is not None:
        if os.path.isfile(m.hf):
            return arch_from_hf(gguf_hf_config(m.hf), where=f"model.hf={m.hf}")
        return arch_from_hf(m.hf)
    return open_checkpoint(m.mcore_ckpt, roles).arch


def check_shape_source(cfg: RunConfig) -> None:
    """The one input a dry run (`megarl.trainer.dry_run`) and `megarl plan` read, the model's
    shape: raise `ConfigError` naming the key when its file or directory is not on this
    machine."""
    m = cfg.model
    if m.hf is not None and not os.path.isdir(m.hf) and not os.path.isfile(m.hf):
        raise ConfigError(
            f"model.hf={m.hf!r} does not exist on this machine; the dry run reads the model's "
            "shape from it. Accepted: a directory holding the model's config.json (nothing else "
            "in it is read), or a GGUF file (its metadata is read)"
        )
    if m.mcore_ckpt is not None and not os.path.isdir(m.mcore_ckpt):
        raise ConfigError(
            f"model.mcore_ckpt={m.mcore_ckpt!r} does not exist on this machine; --dry-run and "
            "`megarl plan` read the model's shape from its small files (trainer_state.json or "
            "megarl_model.json). Accepted: that directory, or --set model.mcore_ckpt=null --set "
            "model.hf=DIR with DIR holding the model's config.json"
        )


def keep_tokenizer(tokenizer, source_dir: str | None, out_dir: str) -> str:
    """Rank 0: make `out_dir/tokenizer` hold the run's tokenizer files (copied from
    `source_dir`, or saved from `tokenizer` when the directory has none; `source_dir` None: the
    toy tokenizer, already saved there). Written under a temporary name and renamed."""
    dst = os.path.join(out_dir, "tokenizer")
    if source_dir is None or os.path.abspath(source_dir) == os.path.abspath(dst):
        return dst
    tmp = f"{dst}.tmp-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    try:
        if not copy_tokenizer_files(source_dir, tmp):
            tokenizer.save_pretrained(tmp)
        old = None
        if os.path.exists(dst):
            old = f"{tmp}.old"
            os.rename(dst, old)
        os.rename(tmp, dst)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst
