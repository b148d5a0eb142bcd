"""LoRA adapters in and out as a PEFT adapter directory (`adapter_config.json` +
`adapter_model.safetensors`), the form `peft.PeftModel.from_pretrained(base, DIR)` and vLLM's
LoRA loader read.

Each adapter pair of `megarl.models.lora` is one PEFT module (`...layers.{i}.self_attn.q_proj`,
`...mlp.down_proj`); its tensors are whole in the file and sliced to this rank's shard on
load (column-parallel: `B`'s rows; row-parallel: `A`'s columns), so one directory loads at any
layout. Writing gathers the shards over TP and the layers over PP (object collectives:
adapters are small) and rank 0 writes atomically.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from megarl.convert.hf_write import AtomicDir
from megarl.errors import UserError
from megarl.models.lora import LoraConfig, adapters_of, peft_key

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


class PeftError(UserError, ValueError):
    """A PEFT adapter directory that does not fit the run; the message names file and key."""


def _shard(p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of `full` for adapter parameter `p` (its TP split, or all of it)."""
    if not getattr(p, "tensor_model_parallel", False):
        return full
    from megatron.core import parallel_state as ps

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    return full.chunk(tp, dim=p.partition_dim)[rank]


def read_adapter_config(directory: str, cfg: LoraConfig) -> dict:
    """The directory's adapter_config.json, checked against `cfg` (rank, alpha, targets)."""
    path = os.path.join(directory, CONFIG)
    if not os.path.isfile(path):
        raise PeftError(
            f"model.lora.init_from={directory!r}: no {CONFIG}; accepted: a PEFT adapter "
            "directory (adapter_config.json + adapter_model.safetensors)"
        )
    with open(path) as f:
        conf = json.load(f)
    targets = conf.get("target_modules") or []
    targets = sorted(targets) if isinstance(targets, list) else [targets]
    checks = {
        "peft_type": (conf.get("peft_type"), "LORA"),
        "r": (conf.get("r"), cfg.rank),
        "lora_alpha": (conf.get("lora_alpha"), cfg.alpha),
        "target_modules": (targets, sorted(cfg.modules())),
        "use_rslora": (bool(conf.get("use_rslora")), False),
        "use_dora": (bool(conf.get("use_dora")), False),
    }
    for key, (have, want) in checks.items():
        if have != want:
            raise PeftError(
                f"{path}: {key}={have!r}, the run has {want!r} (model.lora.rank / alpha / "
                "targets); accepted: an adapter trained with the run's LoRA settings"
            )
    return conf


@torch.no_grad()
def load_peft(chunks, cfg: LoraConfig, directory: str) -> None:
    """Copy a PEFT adapter directory's tensors into this rank's adapter shards."""
    from safetensors import safe_open

    read_adapter_config(directory, cfg)
    path = os.path.join(directory, WEIGHTS)
    if not os.path.isfile(path):
        raise PeftError(f"model.lora.init_from={directory!r}: no {WEIGHTS}")
    with safe_open(path, framework="pt") as f:
        names = set(f.keys())
        for adapters in adapters_of(chunks):
            for layer, name, pair in adapters.pairs():
                for part, p in (("A", pair.A), ("B", pair.B)):
                    key = peft_key(layer, name, part)
                    if key not in names:
                        raise PeftError(f"{path}: no tensor {key!r} (layer {layer} {name})")
                    t = _shard(p, f.get_tensor(key))
                    if tuple(t.shape) != tuple(p.shape):
                        raise PeftError(
                            f"{path}: {key!r} has shape {tuple(f.get_slice(key).get_shape())}, "
                            f"which does not fit the model ({name} of hidden size / heads)"
                        )
                    p.copy_(t)


def peft_tensors(chunks, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """`whole_adapters` on global rank 0 ({} elsewhere): what a PEFT file holds."""
    tensors = whole_adapters(chunks, grads=grads)
    return tensors if dist.get_rank() == 0 else {}


@torch.no_grad()
def whole_adapters(chunks, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """{PEFT key: whole fp32 tensor} of every adapter of the model (`grads`: their gradients,
    reduced over DP by a plain DDP), on every rank: each model-parallel group gathers its own
    copy, over TP, then the layers over PP. Collective over the world; the adapters' bytes
    cross ranks, not the base's."""
    from megatron.core import parallel_state as ps

    local = _tp_whole(chunks, grads=grads)
    pp = ps.get_pipeline_model_parallel_group()
    if dist.get_world_size(pp) == 1:
        return local
    parts = [None] * dist.get_world_size(pp)
    dist.all_gather_object(parts, local, group=pp)
    return {k: v for part in parts for k, v in part.items()}


def _tp_whole(chunks, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """This rank's adapters (or their grads) made whole over TP, by PEFT key. Collective over
    the TP group."""
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    tp = dist.get_world_size(tp_group)
    out = {}
    for adapters in adapters_of(chunks):
        for layer, name, pair in adapters.pairs():
            for part, p in (("A", pair.A), ("B", pair.B)):
                t = getattr(p, "main_grad", p.grad) if grads else p
                # a copy: the receiver (vLLM folds alpha / r into B in place) must not alias it
                t = t.detach().to(torch.float32, copy=True).contiguous()
                if getattr(p, "tensor_model_parallel", False) and tp > 1:
                    shards = [torch.empty_like(t) for _ in range(tp)]
                    dist.all_gather(shards, t, group=tp_group)  # on the device (NCCL on GPU)
                    t = torch.cat(shards, dim=p.partition_dim)
                out[peft_key(layer, name, part)] = t.cpu()
    return out


def adapter_config(cfg: LoraConfig, *, base_model: str | None) -> dict:
    """The adapter_config.json of `cfg`'s adapters (PEFT's keys; vLLM reads the same)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": sorted(cfg.modules()),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }


def save_peft(chunks, cfg: LoraConfig, directory: str, *, base_model: str | None) -> None:
    """Write the adapters of `chunks` as a PEFT directory (rank 0, atomically). Collective."""
    from safetensors.torch import save_file

    tensors = peft_tensors(chunks)
    if dist.get_rank() != 0:
        return
    conf = adapter_config(cfg, base_model=base_model)
    with AtomicDir(directory, overwrite=True) as out:
        with open(os.path.join(out.tmp, CONFIG), "w") as f:
            json.dump(conf, f, indent=1)
        save_file(tensors, os.path.join(out.tmp, WEIGHTS), metadata={"format": "pt"})
