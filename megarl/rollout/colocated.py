"""The rollout component as the trainer sees it: prompts in, a `Rollout` of samples out, and the
policy's new weights pushed in after every update. The loop and the evaluator call only these
methods, so a rollout of another kind is another class with the same methods, not a change to
the loop: multi-turn environments (`megarl.rollout.multi_turn.MultiTurnRollout`), engines on
ranks of their own (`megarl.rollout.separate.SeparateRollout`).

`ColocatedRollout` is today's placement: a vLLM engine in every trainer rank (`RolloutEngine`),
the dispatcher that has each prompt generated once by the engines of its model-parallel group
(`RolloutDispatcher`), and the in-place weight sync from the actor's Megatron shards
(`WeightSync`). On GPU the engine sleeps while the trainer works (its weights and KV cache
freed) and wakes for the sync; on CPU sleeping is a no-op.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Protocol

import torch
import torch.distributed as dist

from megarl.distributed.topology import Groups
from megarl.models.hf_config import ModelArch
from megarl.models.lora import LoraConfig
from megarl.rollout.adapter_sync import AdapterSync
from megarl.rollout.config import RolloutConfig
from megarl.rollout.dispatch import RolloutDispatcher
from megarl.rollout.engine import Rollout, RolloutEngine
from megarl.rollout.weight_sync import WeightSync


def write_engine_dir(model_dir: str, arch: ModelArch) -> None:
    """The directory vLLM builds its model from: `arch`'s config.json (weights come from the
    sync; the file is written atomically, so writers on several nodes may share it)."""
    os.makedirs(model_dir, exist_ok=True)
    tmp = os.path.join(model_dir, f".config.json.{socket.gethostname()}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(dict(arch.hf_config), f, indent=1)
    os.replace(tmp, os.path.join(model_dir, "config.json"))


class RolloutComponent(Protocol):
    """What the trainer asks of a rollout, whatever its kind or placement. Every method is
    collective over the trainer's ranks."""

    def generate(
        self, prompts, positions: list[int], seed: int, *, upcoming=(), **sampling
    ) -> Rollout:
        """The samples of this DP rank's `prompts` (a `megarl.data.dataset.PromptBatch`: token
        ids, raw prompts, columns); `positions`: each prompt's place in the step's global batch
        (its sampling seed depends on that, not on the split); `upcoming`: the requests (prompt
        ids, positions, seed) of the next steps, which a rollout that runs ahead
        (`algorithm.max_staleness` > 0) starts generating now; `sampling`: overrides of n,
        greedy, temperature, max_tokens (a multi-turn rollout: per turn)."""

    def release(self) -> None:
        """Give the trainer the memory generation held, until the next `sync_weights`."""

    def sync_weights(self) -> dict:
        """Make the policy's current weights the ones generation uses; returns the sync's
        figures."""

    def samples_generated(self) -> int:
        """Samples this rank's engines generated in the last `generate` (each counted once in
        the world)."""

    def close(self) -> None:
        """Shut the engines down."""


class ColocatedRollout:
    """A vLLM engine in every trainer rank (module docstring)."""

    def __init__(
        self, engine: RolloutEngine, sync: WeightSync | AdapterSync, dispatcher: RolloutDispatcher
    ):
        self.engine = engine
        self.sync = sync
        self.dispatcher = dispatcher

    @staticmethod
    def build(
        cfg: RolloutConfig,
        arch: ModelArch,
        policy: list,
        groups: Groups,
        out_dir: str,
        dtype: str,
        lora: LoraConfig | None = None,
    ) -> ColocatedRollout:
        """An engine on every rank: SPMD (external_launcher, its own TP) on GPU; on CPU a TP=1
        engine per rank that receives the full model; `policy`: this rank's chunks of the model
        it generates with; `lora`: the policy's adapters, which the engine serves with its LoRA
        layers unless `lora.merge` (then it receives merged weights). Collective."""
        # vLLM reads the model's config.json from a directory on every node: the first rank of
        # each node writes it (the same bytes; atomic per writer, so a shared directory is fine)
        model_dir = os.path.join(out_dir, "rollout_model")
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:
            write_engine_dir(model_dir, arch)
        dist.barrier()
        adapters = lora is not None and lora.enabled and not lora.merge
        engine = RolloutEngine(
            model_dir, arch, cfg, dtype=dtype, lora_rank=lora.rank if adapters else 0
        )
        if adapters:
            sync = AdapterSync(policy, arch, engine, groups, lora)
        else:
            sync = WeightSync(policy, arch, engine, groups)
        return ColocatedRollout(engine, sync, RolloutDispatcher(engine, groups.dp_rank))

    def generate(
        self, prompts, positions: list[int], seed: int, *, upcoming=(), **sampling
    ) -> Rollout:
        if upcoming:  # the config refuses max_staleness > 0 with colocated engines
            raise ValueError("colocated engines generate one step at a time (upcoming=())")
        return self.dispatcher.generate(prompts.prompt_ids, positions, seed, **sampling)

    def release(self) -> None:
        self.engine.sleep()

    def sync_weights(self) -> dict:
        """The engine slept after generating (GPU: its weights and KV cache were freed while the
        trainer used the memory): release the trainer's cached blocks, write the weights (the
        sync wakes them first and drops vLLM's prefix cache, computed with the old weights),
        then wake the KV cache."""
        torch.cuda.empty_cache()  # a no-op on CPU
        stats = self.sync.sync()
        self.engine.wake_up(["kv_cache"])
        return stats

    def samples_generated(self) -> int:
        return self.dispatcher.samples_generated

    def close(self) -> None:
        self.engine.close()
