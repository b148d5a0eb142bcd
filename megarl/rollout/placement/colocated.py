"""`rollout.placement.mode: colocated`: a vLLM engine in every trainer rank, in its process.

Each rank's engine is driven by a `RolloutWorker`; the dispatcher has each prompt generated
once by the engines of its model-parallel group (`megarl.rollout.placement.dispatch`); the
weights go in place from the actor's Megatron shards (`ColocatedWeights`, or the adapters alone
with `ColocatedAdapters`). On GPU the engine sleeps while the trainer works (its weights and KV
cache freed) and wakes for the sync; on CPU sleeping is a no-op.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megarl.distributed.topology import Groups
from megarl.envs.config import EnvConfig
from megarl.metrics.reduce import LocalMetrics
from megarl.models.hf_config import ModelArch
from megarl.models.lora import LoraConfig
from megarl.rollout.config import RolloutConfig
from megarl.rollout.engine.engine import RolloutEngine, write_model_dir
from megarl.rollout.metrics import sample_metrics
from megarl.rollout.multi_turn.runner import Trajectories
from megarl.rollout.multi_turn.sources import trajectory_items
from megarl.rollout.placement.dispatch import RolloutDispatcher
from megarl.rollout.placement.worker import RolloutWorker
from megarl.rollout.samples import Samples
from megarl.rollout.sync import SyncStats, WeightSender
from megarl.rollout.sync.adapters import ColocatedAdapters
from megarl.rollout.sync.colocated import ColocatedWeights


class ColocatedRollout:
    """A vLLM engine in every trainer rank (module docstring)."""

    def __init__(
        self,
        worker: RolloutWorker,
        sender: WeightSender | None,
        dispatcher: RolloutDispatcher,
        system_prompt: str | None = None,
    ):
        self.worker, self.sender, self.dispatcher = worker, sender, dispatcher
        self.system_prompt = system_prompt
        """With trajectories: the system prompt their chat messages start with."""

    @property
    def engine(self) -> RolloutEngine:
        return self.worker.engine

    @staticmethod
    def build(
        cfg: RolloutConfig,
        arch: ModelArch,
        policy: list,
        groups: Groups,
        out_dir: str,
        dtype: str,
        *,
        lora: LoraConfig | None = None,
        trajectories: Trajectories | None = None,
        env: EnvConfig | None = None,
        system_prompt: str | None = None,
    ) -> ColocatedRollout:
        """An engine on every rank: SPMD (external_launcher, its own TP) on GPU; on CPU a TP=1
        engine per rank that receives the full model; `policy`: this rank's chunks of the model
        it generates with; `lora`: the policy's adapters, which the engine serves with its LoRA
        layers unless `lora.merge` (then it receives merged weights); `trajectories` (with
        `env`): every sample a trajectory driven by them. Collective."""
        # vLLM reads the model's config.json from a directory on every node: the first rank of
        # each node writes it (the same bytes; atomic per writer, so a shared directory is fine)
        model_dir = os.path.join(out_dir, "rollout_model")
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:
            write_model_dir(model_dir, arch)
        dist.barrier()
        adapters = lora is not None and lora.enabled and not lora.merge
        engine = RolloutEngine(
            model_dir, arch, cfg.sampling, cfg.engine, dtype=dtype,
            lora_rank=lora.rank if adapters else 0,
        )  # fmt: skip
        if adapters:
            sender = ColocatedAdapters(policy, arch, engine, groups, lora)
        else:
            sender = ColocatedWeights(policy, arch, engine, groups)
        worker = RolloutWorker(engine, trajectories, env)
        dispatcher = RolloutDispatcher(cfg.engine.tensor_parallel, groups.dp_rank)
        return ColocatedRollout(worker, sender, dispatcher, system_prompt)

    # ------------------------------------------------------------------ RolloutComponent
    def generate(
        self, prompts, positions: list[int], seed: int, *, upcoming=(), **sampling
    ) -> Samples:
        if upcoming:  # the config refuses max_staleness > 0 with colocated engines
            raise ValueError("colocated engines generate one step at a time (upcoming=())")
        worker, dispatcher = self.worker, self.dispatcher
        if worker.runner is None:
            items = prompts.prompt_ids
        else:
            items = trajectory_items(prompts, self.system_prompt)

        def produce(share, pos):
            return worker.generate(share, pos, seed, instance=dispatcher.instance, **sampling)

        return dispatcher.dispatch(items, positions, produce)

    def release(self) -> None:
        self.worker.engine.sleep()

    def sync_weights(self) -> SyncStats:
        """The engine slept after generating (GPU: its weights and KV cache were freed while the
        trainer used the memory): release the trainer's cached blocks, write the weights (the
        sync wakes them first; the engine then drops its prefix cache), then wake the KV
        cache."""
        torch.cuda.empty_cache()  # a no-op on CPU
        stats = self.worker.update(self.sender.sync, self.worker.version + 1)
        self.worker.engine.wake_up(["kv_cache"])
        return stats

    def metrics(self, samples: Samples) -> LocalMetrics:
        return sample_metrics(samples, max_staleness=0)

    def samples_generated(self) -> int:
        return self.dispatcher.samples_generated

    def close(self) -> None:
        self.worker.close()
