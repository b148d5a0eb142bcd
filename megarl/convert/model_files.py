"""A model a run builds besides the policy (a reward model, a critic's start, a distillation
teacher), described from its small files: `open_model_files` reads an HF directory or a megarl
checkpoint named by a config key, checks its head and tensor names, and returns `ModelFiles`,
which loads this rank's shards into built chunks."""

from __future__ import annotations

import os
from dataclasses import dataclass

from megarl.checkpoint.reader import CheckpointSource, has_tokenizer, load_into, open_checkpoint
from megarl.convert.hf_io import LazyHFTensors
from megarl.convert.mapping import check_hf_names
from megarl.convert.sharded import load_hf_sharded
from megarl.errors import ConfigError, UserError
from megarl.models.hf_config import ModelArch, arch_from_hf


@dataclass(frozen=True)
class ModelFiles:
    """A model a run builds besides the policy (a reward model, a critic's start, a
    distillation teacher), described from its small files: an HF directory or a megarl
    checkpoint."""

    key: str
    """The config key that names it (for messages)."""
    path: str
    arch: ModelArch
    hf: bool
    """An HF directory (else a megarl checkpoint, `checkpoint`)."""
    checkpoint: CheckpointSource | None
    tokenizer_dir: str | None

    def describe(self) -> str:
        return f"{self.key}={self.path}"

    def load_into(self, chunks: list) -> None:
        """Fill this rank's `chunks` (built from `arch`), reading only this rank's shards
        (collective for a megarl checkpoint)."""
        if self.hf:
            load_hf_sharded(chunks, self.arch, self.path)
        else:
            load_into(chunks, self.checkpoint)


def open_model_files(
    path: str, key: str, roles: tuple[str, ...], *, scalar_head: bool, accepted: str
) -> ModelFiles:
    """`ModelFiles` of the directory `path`, named by config key `key`: an HF directory (its
    tensors' names and shapes checked against its config.json) or a megarl checkpoint (the
    first of `roles` it holds), with a scalar head (`scalar_head`: a reward model, a critic)
    or an LM head. Raises `ConfigError` naming the key, with `accepted` (what the key takes)."""
    want = "a scalar score head" if scalar_head else "an LM head"
    if os.path.isfile(os.path.join(path, "config.json")):
        arch = arch_from_hf(path, where=f"{key}={path}")
        if arch.score_head != scalar_head:
            archs = arch.hf_config.get("architectures") or [arch.family]
            raise ConfigError(
                f"{key}={path!r} is a {archs[0]}, without {want}; accepted: {accepted}"
            )
        try:
            lazy = LazyHFTensors(path)
            check_hf_names(arch, lazy.names, shape_of=lazy.shape)
        except UserError as e:
            raise ConfigError(f"{key}={path!r}: {e}") from e
        return ModelFiles(key, path, arch, True, None, path if has_tokenizer(path) else None)
    try:
        source = open_checkpoint(path, roles)
    except UserError as e:
        raise ConfigError(f"{key}={path!r}: {e}; accepted: {accepted}") from e
    if source.value_head != scalar_head:
        raise ConfigError(
            f"{key}={path!r}: {source.describe()} (roles in it: {list(source.roles)}) is "
            f"without {want}; accepted: {accepted}"
        )
    return ModelFiles(key, source.path, source.arch, False, source, source.tokenizer_dir)
