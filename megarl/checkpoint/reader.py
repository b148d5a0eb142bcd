"""The one reader of megarl checkpoints: trainer checkpoints (any role) and converter checkpoints.

    source = open_checkpoint(path, role="actor")   # cheap: JSON and tensor metadata only
    chunks = build_model(source.arch, ..., role=...)  # at any TP / PP / VPP / EP layout
    load_into(chunks, source)                       # collective

`path` may be:
- a trainer checkpoint `RUN/checkpoints/step_N/` (`megarl.checkpoint.training`): one
  `dist_checkpointing` directory holding every trained role (`actor.`, `critic.` key prefixes)
  and their optimizer states, plus `trainer_state.json`, whose `arch` is the HF config;
- a run directory `RUN/`: its newest complete checkpoint;
- a converter checkpoint (`megarl convert hf-to-mcore`, `megarl_model.json`): one model, no
  prefix (a sequence classifier converted with its score head is role `reward`, or `critic`).

A trainer checkpoint's `trainer_state.json` holds the run's HF config as `arch` and, for a role
built from another model (a critic started from a reward model, `model.critic_init`), that
role's own under `archs`.

The roles of a trainer checkpoint are read from its tensor names (the prefix of each
`<role>.decoder.final_layernorm.weight`), so a role added later (a reward model) needs no change
here. A role with a scalar head (`output_layer.weight` of shape [1, hidden]: a critic, a reward
model) loads only into a model that has one; a policy role loads into a policy or, trunk only,
into a scalar-head model (whose head the builder initialised). Only weights are read: optimizer
states, schedules and the step stay in the file. Tensor names are global (layers stacked, TP
shards by offset), so the layout the checkpoint was written at does not matter; MoE pre-MLP
norms are matched under either of their two megatron names (local spec, Transformer-Engine
spec; `keys`). `.metadata` is vetted (`vetting.check_dcp_metadata`) before megatron reads
anything.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from megarl.checkpoint.files import (
    META,
    CheckpointError,
    is_trainer_checkpoint,
    latest_checkpoint,
    read_checkpoint_meta,
    read_trainer_state,
)
from megarl.checkpoint.keys import check_arch, has_value_head, match_norm_keys, strip_prefix
from megarl.checkpoint.vetting import check_dcp_metadata
from megarl.models.builder import unwrap
from megarl.models.hf_config import ModelArch, arch_from_hf

TRAINER, CONVERTER = "trainer", "converter"
_ROLE_KEY = "decoder.final_layernorm.weight"  # every model has exactly one
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass(frozen=True)
class CheckpointSource:
    """One model (role) of a checkpoint, described from its small files."""

    path: str
    """The `dist_checkpointing` directory."""
    kind: str
    """`trainer` (RUN/checkpoints/step_N) or `converter` (megarl_model.json)."""
    role: str
    """The role read: `actor`, `critic`, `reward` (a converter checkpoint: `actor`, or with a
    scalar head `reward` / `critic`, as asked)."""
    roles: tuple[str, ...]
    """Every role the checkpoint holds."""
    prefix: str
    """Key prefix of the role's tensors inside (`actor.`; empty for a converter checkpoint)."""
    arch: ModelArch
    dtype: str
    """dtype of the role's weights in the files (fp32, bf16, fp16)."""
    value_head: bool
    """The role's output layer is a scalar head (a critic, a reward model), not an LM head."""
    tokenizer_dir: str | None
    """Where the tokenizer files kept with the checkpoint are; None when there are none."""
    step: int | None = None
    """The trainer step it was written at (trainer checkpoints)."""

    def describe(self) -> str:
        if self.kind == TRAINER:
            return f"trainer checkpoint {self.path} (step {self.step}), role {self.role}"
        return f"converter checkpoint {self.path}"


def checkpoint_dir(path: str | os.PathLike) -> str:
    """The checkpoint directory `path` names: itself, or a run directory's newest checkpoint."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        what = "is not a directory" if os.path.exists(path) else "does not exist"
        raise CheckpointError(f"{path} {what}; accepted: {_ACCEPTED}")
    if is_trainer_checkpoint(path) or os.path.exists(os.path.join(path, META)):
        return path
    newest = latest_checkpoint(path)
    if newest is not None:
        return newest
    if os.path.isdir(os.path.join(path, "checkpoints")):
        raise CheckpointError(
            f"{path}: run directory without a complete checkpoint in checkpoints/"
        )
    raise CheckpointError(f"{path}: no megarl checkpoint; accepted: {_ACCEPTED}")


_ACCEPTED = (
    "a trainer checkpoint RUN/checkpoints/step_N, a run directory RUN (its newest complete "
    "checkpoint), or a directory written by `megarl convert hf-to-mcore`"
)


def open_checkpoint(
    path: str | os.PathLike, role: str | tuple[str, ...] | None = None
) -> CheckpointSource:
    """Describe role `role` (None: `actor`, or a converter checkpoint's one model; a tuple: the
    first of those roles the checkpoint holds) of the checkpoint `path` names. Reads JSON and
    tensor metadata only; raises `CheckpointError` naming the directory (an absent role lists
    the roles present)."""
    path = checkpoint_dir(path)
    check_dcp_metadata(path)
    if is_trainer_checkpoint(path):
        if isinstance(role, tuple):
            present = _trainer_roles(path)
            role = next((r for r in role if r in present), role[0])
        return _open_trainer(path, role)
    meta = read_checkpoint_meta(path)
    arch = arch_from_hf(meta["hf_config"], where=os.path.join(path, META))
    # one model; a scalar head serves as a reward model or as a critic's start
    if meta.get("value_head"):
        have = ("reward", "critic") if arch.score_head else ("critic", "reward")
    else:
        have = ("actor",)
    if isinstance(role, tuple):
        role = next((r for r in role if r in have), role[0])
    if role not in (None, *have):
        raise CheckpointError(
            f"{path}: a converter checkpoint holds one model ({have[0]}); role {role!r} is not "
            f"in it. Accepted: role {' or '.join(map(repr, have))} (or none)"
        )
    return CheckpointSource(
        path=path,
        kind=CONVERTER,
        role=role or have[0],
        roles=have,
        prefix="",
        arch=arch,
        dtype=meta["dtype"],
        value_head=bool(meta.get("value_head")),
        tokenizer_dir=path if has_tokenizer(path) else None,
    )


def _open_trainer(path: str, role: str | None) -> CheckpointSource:
    from megatron.core import dist_checkpointing

    state = read_trainer_state(path)
    tensors = dist_checkpointing.load_tensors_metadata(path)
    roles = _trainer_roles(path, tensors)
    role = role or "actor"
    if role not in roles and any(k.startswith(f"{role}.lora.") for k in tensors):
        run = os.path.dirname(os.path.dirname(os.path.abspath(path)))
        merged = os.path.join(run, "hf")
        accepted = (
            f"the merged model {merged} (trainer.export_hf) as model.hf, or the base as "
            f"model.hf with model.lora.init_from={os.path.join(run, 'adapter')}"
            if role == "actor"
            else f"the merged model {merged} (a LoRA reward-model run writes it at its end)"
        )
        raise CheckpointError(
            f"{path} holds the LoRA adapters of a LoRA run's {role}, not its base (a resume "
            f"rebuilds that from the run's model source); accepted: {accepted}"
        )
    if role not in roles:
        raise CheckpointError(
            f"{path} holds no role {role!r}; roles in this checkpoint: {list(roles)}"
        )
    # a role built from another model than the run's (a critic from a reward model) has its own
    archs = state.get("archs") or {}
    where = "archs." + role if role in archs else "arch"
    arch = arch_from_hf(
        archs.get(role, state["arch"]), where=os.path.join(path, f"trainer_state.json:{where}")
    )
    prefix = f"{role}."
    head = tensors.get(prefix + "output_layer.weight")
    value_head = head is not None and tuple(head.global_shape)[0] == 1
    dtype = _DTYPE_NAMES.get(tensors[prefix + _ROLE_KEY].dtype, "fp32")
    run_tok = os.path.join(os.path.dirname(os.path.dirname(path)), "tokenizer")
    tok = path if has_tokenizer(path) else (run_tok if has_tokenizer(run_tok) else None)
    return CheckpointSource(
        path=path,
        kind=TRAINER,
        role=role,
        roles=roles,
        prefix=prefix,
        arch=arch,
        dtype=dtype,
        value_head=value_head,
        tokenizer_dir=tok,
        step=int(state["step"]),
    )


def _trainer_roles(path: str, tensors: dict | None = None) -> tuple[str, ...]:
    """The roles of a trainer checkpoint, from its tensor names:
    "<role>.decoder.final_layernorm.weight" (optimizer states are "optimizer.state.x.<role>...")."""
    from megatron.core import dist_checkpointing

    tensors = tensors if tensors is not None else dist_checkpointing.load_tensors_metadata(path)
    found = (k[: -len(_ROLE_KEY) - 1] for k in tensors if k.endswith("." + _ROLE_KEY))
    return tuple(sorted(r for r in found if r and "." not in r))


def has_tokenizer(directory: str) -> bool:
    """Whether `directory` holds tokenizer files."""
    return any(os.path.isfile(os.path.join(directory, f)) for f in _TOKENIZER_MARKERS)


def load_into(chunks: list[torch.nn.Module], source: CheckpointSource) -> None:
    """Load `source`'s weights into this rank's `chunks` (built at any layout; collective).

    Raises `CheckpointError` when the chunks are another model (naming each differing field),
    when a value head would load into a policy, or when a tensor is absent on either side."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    where = source.describe()
    check_arch(chunks, source.arch, where)
    into_critic = any(has_value_head(unwrap(c)) for c in chunks)
    if source.value_head and not into_critic:
        raise CheckpointError(
            f"{where} holds a scalar head (a critic or reward model), not an LM head: it loads "
            f"into a critic or a reward model only. Roles in it: {list(source.roles)}"
        )
    file_keys = set(dist_checkpointing.load_tensors_metadata(source.path))
    sd = {}
    for k, chunk in enumerate(chunks):
        model_sd = unwrap(chunk).sharded_state_dict(prefix=source.prefix)
        if into_critic and not source.value_head:  # the trunk only; the head stays as built
            model_sd = {n: v for n, v in model_sd.items() if not _is_head(n, source.prefix)}
        # LoRA adapters keep their init when the checkpoint has none (a base model's)
        lora_keys = source.prefix + "lora."
        model_sd = {
            n: v for n, v in model_sd.items() if not n.startswith(lora_keys) or n in file_keys
        }
        match_norm_keys(model_sd, file_keys, source.prefix)
        sd[f"chunk{k}"] = model_sd
    loaded, missing, unexpected = dist_checkpointing.load(
        sd, source.path, strict=StrictHandling.RETURN_ALL
    )
    # "unexpected": asked for by the model, absent from the files; "missing": the reverse
    absent = sorted(k for k in unexpected if not k.endswith("_extra_state"))
    if absent:
        raise CheckpointError(f"{where}: no tensor(s) {absent[:8]} in the checkpoint")
    unused = sorted(  # other roles and the optimizer states have other prefixes
        k
        for k in missing
        if k.startswith(source.prefix)
        and not k.endswith("_extra_state")
        and not (into_critic and not source.value_head and _is_head(k, source.prefix))
    )
    if unused:
        raise CheckpointError(
            f"{where}: tensor(s) {unused[:8]} are in the checkpoint, not the model"
        )
    for k, chunk in enumerate(chunks):
        part = strip_prefix(loaded[f"chunk{k}"], source.prefix)
        res = unwrap(chunk).load_state_dict(part, strict=False)
        skip = ("_extra_state", "output_layer.") if into_critic else ("_extra_state",)
        left = [
            n
            for n in res.missing_keys
            if not any(s in n for s in skip) and not n.startswith("lora.")
        ]
        if left or res.unexpected_keys:
            raise CheckpointError(
                f"{where}: model keys not loaded {left[:8]}, unexpected {res.unexpected_keys[:8]}"
            )


def _is_head(key: str, prefix: str) -> bool:
    return key.startswith(prefix + "output_layer.")


def load_model_checkpoint(
    chunks: list[torch.nn.Module], ckpt_dir: str | os.PathLike, role: str | None = None
) -> None:
    """Load a checkpoint (converter or trainer) into chunks built at any TP / PP / VPP / EP
    layout (collective): `open_checkpoint`, then `load_into`.

    Raises `CheckpointError` if the checkpoint was written for a different model, or if a model
    tensor is absent from it. A critic's value head is loaded only from a critic. (A
    DistributedOptimizer keeps its own fp32 copies: reload them from the model params after
    this.)"""
    load_into(chunks, open_checkpoint(ckpt_dir, role))


def read_checkpoint_arch(ckpt_dir: str | os.PathLike) -> ModelArch:
    """The `ModelArch` a checkpoint (converter or trainer) was written for."""
    return open_checkpoint(ckpt_dir).arch
