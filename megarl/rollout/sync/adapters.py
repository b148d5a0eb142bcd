"""Adapter-only weight sync (`model.lora.merge: false`): after each step the engine receives
the LoRA adapters, not the model; and the check of what an engine holds, shared by both
placements (`trainer_sums`, `compare`).

The base is frozen, so it crosses into vLLM once (the ordinary full sync, adapters not
merged) and again only when the engine lost it (GPU: a level-2 sleep discards its weights).
Every sync then gathers the adapters whole (over TP, then the layers over PP: each
model-parallel group its own copy, adapter bytes only) and hands them to the engine in memory
(`EngineWeights.load_adapter`), which serves them from its LoRA layers; generation requests
name that adapter.

Each sync is checked: per adapted HF linear, the sums of squares of A and of B (alpha / rank
folded in, as vLLM folds it), plain and weighted by column / row index
(`vllm_lora.adapter_sums`), in the engine's LoRA buffers - read back after the load - equal
those of the trainer's current adapters, rounded to the engine's dtype as vLLM rounds them.
The trainer's side is computed from its own shards (TP-summed), not from what was sent, so an
adapter that never arrived, arrived stale, or went to the wrong module or rows is a `SyncError`
naming it, never a silent stale policy.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megarl.convert.peft import adapter_config, whole_adapters
from megarl.distributed.device import device as dev
from megarl.models.hf_config import ModelArch
from megarl.models.lora import LoraConfig, adapters_of, peft_key
from megarl.rollout.engine.engine import RolloutEngine
from megarl.rollout.engine.vllm_lora import adapter_sums
from megarl.rollout.engine.weights import SYNCED
from megarl.rollout.sync.colocated import ColocatedWeights
from megarl.rollout.sync.stats import SyncError, SyncStats

SUMS = ("sum of A^2", "sum of B^2", "sum of A^2 by column", "sum of B^2 by row")
"""What each of a module's sums is (`vllm_lora.adapter_sums`), for the error message."""
RTOL = 1e-6
"""Both sides sum the same rounded values in float64 (in another order): a missing or stale
adapter differs by far more."""


def _module(key: str) -> str:
    """PEFT key -> the HF module vLLM names ("model.layers.0.self_attn.q_proj")."""
    return key.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]


@torch.no_grad()
def trainer_sums(chunks, cfg: LoraConfig, dtype: torch.dtype) -> dict[str, tuple[float, ...]]:
    """{HF module: `vllm_lora.adapter_sums` of (A, scale B)} of the model's current adapters,
    each rounded to `dtype` as the engine stores it; on every rank. Collective over the world
    (TP sum, PP gather)."""
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    pp_group = ps.get_pipeline_model_parallel_group()
    tp, tp_rank = dist.get_world_size(tp_group), ps.get_tensor_model_parallel_rank()
    names, values = [], []
    for adapters in adapters_of(chunks):
        for layer, name, pair in adapters.pairs():
            b = pair.B.detach().to(dtype, copy=True)  # scaled in place below
            b *= cfg.scale  # in `dtype`, as vLLM folds the scale into B
            a = pair.A.detach().to(dtype)
            # a split factor is this rank's slice of the whole (A: columns, B: rows); a whole
            # one is on every TP rank and counts 1 / tp here
            a_split = getattr(pair.A, "tensor_model_parallel", False)
            b_split = getattr(pair.B, "tensor_model_parallel", False)
            sums = adapter_sums(
                a, b,
                a_start=tp_rank * a.shape[1] if a_split else 0,
                b_start=tp_rank * b.shape[0] if b_split else 0,
                a_copies=1 if a_split else tp,
                b_copies=1 if b_split else tp,
            )  # fmt: skip
            names.append(_module(peft_key(layer, name, "A")))
            values.append(torch.tensor(sums, dtype=torch.float64, device=dev()))
    t = torch.stack(values) if values else torch.zeros(0, 4, dtype=torch.float64, device=dev())
    if tp > 1:
        dist.all_reduce(t, group=tp_group)
    local = {n: tuple(v) for n, v in zip(names, t.tolist(), strict=True)}
    if dist.get_world_size(pp_group) == 1:
        return local
    parts = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(parts, local, group=pp_group)
    return {k: v for part in parts for k, v in part.items()}


def compare(want: dict, have: dict | None) -> list[str]:
    """The adapted modules whose engine sums differ from the trainer's (all of them when the
    engine holds no adapter), each as 'module: which factor, trainer vs engine'."""
    if have is None:
        return [f"{m}: no adapter in the engine" for m in sorted(want)]
    bad = []
    for m in sorted(set(want) | set(have)):
        if m not in want and not any(have[m]):  # a LoRA layer this adapter leaves empty
            continue
        if m not in have or m not in want:
            side = "engine" if m not in have else "trainer"
            bad.append(f"{m}: missing on the {side} side")
            continue
        for part, w, h in zip(SUMS, want[m], have[m], strict=True):
            if abs(w - h) > RTOL * max(abs(w), abs(h), 1e-30):
                bad.append(f"{m}: {part} trainer {w:.9g} vs engine {h:.9g}")
    return bad


class ColocatedAdapters:
    """`sync()` = adapters into the engine (the base when it lacks it), then `verify()`."""

    def __init__(
        self, chunks, arch: ModelArch, engine: RolloutEngine, groups, cfg: LoraConfig, *,
        base_model: str | None = None,
    ):  # fmt: skip
        self.chunks, self.engine, self.cfg = chunks, engine, cfg
        self.base = ColocatedWeights(chunks, arch, engine, groups)
        self.config = adapter_config(cfg, base_model=base_model)
        self.base_syncs = 0

    def sync(self) -> SyncStats:
        """Collective over all trainer ranks. The adapters' figures, with the base's
        (`SyncStats.base`) when it was written too."""
        base = None
        if self.engine.weights.state != SYNCED:  # the first sync, or the engine lost them
            base = self.base.sync(merge_adapters=False)
            self.base_syncs += 1
        t0 = time.perf_counter()
        tensors = whole_adapters(self.chunks)
        t1 = time.perf_counter()
        self.engine.weights.load_adapter(tensors, self.config)
        t2 = time.perf_counter()
        elem = torch.empty((), dtype=self.engine.torch_dtype).element_size()
        verify_s = self.verify()
        return SyncStats(
            mode="adapters",
            bytes=sum(t.numel() for t in tensors.values()) * elem,
            seconds=t2 - t0,
            transfer_s=t1 - t0,
            load_s=t2 - t1,
            checksum_s=verify_s,
            base=base,
        )

    def verify(self) -> float:
        """Raise `SyncError` unless the engine serves the trainer's current adapters (module
        docstring); returns its seconds. Collective over all trainer ranks."""
        t0 = time.perf_counter()
        want = trainer_sums(self.chunks, self.cfg, self.engine.torch_dtype)
        bad = compare(want, self.engine.weights.adapter_sums())
        anywhere = torch.tensor([len(bad)], device=dev())  # NCCL on GPU: a device tensor
        dist.all_reduce(anywhere, op=dist.ReduceOp.MAX)  # every rank raises, none waits
        if anywhere.item() and not bad:
            raise SyncError("another trainer rank's engine does not hold the LoRA adapters", None)
        if bad:
            raise SyncError(
                f"the rollout engine does not hold the trainer's LoRA adapters ({len(bad)} of "
                f"{len(want)} modules differ): {'; '.join(bad[:3])}"
                f"{' ...' if len(bad) > 3 else ''}",
                bad[0].split(":", 1)[0],
            )
        return time.perf_counter() - t0
