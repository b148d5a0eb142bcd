"""The parts of one run, built once by `megarl.trainer.recipe.build_run`: topology and process
groups, models by role (`Models`), the rollout (a `megarl.rollout.RolloutComponent`: the engines
and their weight sync), data (`Data`), the scorer, the evaluator, logging; and the run's own
state (step, checkpoints, resume). The loops read these parts; only their own methods change
them. Whoever builds a run owns it: `with build_run(...) as run:` closes its rollout and its
logs however the block ends.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from megarl.checkpoint import training
from megarl.config import RunConfig
from megarl.data.batch import MicroBatching
from megarl.distributed import Topology
from megarl.distributed.topology import Groups
from megarl.errors import ConfigError
from megarl.models import lora
from megarl.models.forward import sequence_multiple
from megarl.models.hf_config import ModelArch
from megarl.rollout import RolloutComponent
from megarl.trainer.models import Models

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from megarl.data.dataset import PromptDataset
    from megarl.data.offline import PreferenceDataset, SFTDataset
    from megarl.data.sampler import PromptSampler
    from megarl.metrics.sinks import MetricsLogger
    from megarl.rewards.scorer import Scorer
    from megarl.trainer.evaluate import Evaluator

log = logging.getLogger("megarl")


@dataclass
class Data:
    """The training rows and the resumable order this DP rank reads them in."""

    dataset: PromptDataset | SFTDataset | PreferenceDataset
    sampler: PromptSampler | None
    """The training order; None for a run that trains nothing (`megarl eval`)."""
    held_out: PromptDataset | SFTDataset | PreferenceDataset | None = None
    """The held-out rows of `eval` (removed from `dataset`; RL: prompts evaluated through the
    engine, offline stages: rows evaluated by forward passes); None without eval.path /
    eval.fraction (`megarl.data.split`)."""


@dataclass
class Run:
    cfg: RunConfig
    out_dir: str
    topo: Topology
    groups: Groups
    arch: ModelArch
    tokenizer: PreTrainedTokenizerBase
    models: Models
    data: Data
    logger: MetricsLogger
    rollout: RolloutComponent | None = None
    """The generation side; None for a run that builds no engine."""
    scorer: Scorer | None = None
    """Scores samples with the reward functions and the reward model (`reward.*`); None for a
    run that builds no engine."""
    evaluator: Evaluator | None = None
    """Held-out evaluation through the rollout engine; None without held-out prompts or
    without an engine (offline stages evaluate by forward passes)."""
    resume: tuple[str, dict] | None = None
    """(checkpoint directory, its trainer state) to resume from, read and checked in create."""
    step: int = 0
    bad_steps: int = 0

    # ------------------------------------------------------------------ checkpoints
    def trainer_state(self) -> dict:
        m = self.models
        state = {
            "step": self.step,
            "sampler": self.data.sampler.state_dict(),
            "arch": self.arch.hf_config,
        }
        for role, model in m.trained().items():
            state[f"{role}_sched"] = model.sched.state_dict()
        archs = {
            r: a.hf_config
            for r, a in m.archs.items()
            if r in m.trained() and a.hf_config != self.arch.hf_config
        }
        if archs:  # roles built from another model (a critic from a reward model)
            state["archs"] = archs
        rm = self.scorer.reward_model if self.scorer is not None else None
        if rm is not None and rm.state_dict() is not None:
            state["reward_model_stats"] = rm.state_dict()
        for role, model in m.trained().items():  # a LoRA model's checkpoint holds no base
            if lora.adapters_of(model.chunks):
                state[fingerprint_key(role)] = lora.base_fingerprint(model.chunks)
        return state

    def save(self) -> str:
        path = training.save(
            self.out_dir,
            self.step,
            self.models.checkpointed(),
            self.trainer_state(),
            keep_last=self.cfg.trainer.keep_last,
            tokenizer_dir=os.path.join(self.out_dir, "tokenizer"),
        )
        log.info("saved checkpoint %s", path)
        return path

    def maybe_resume(self) -> None:
        if self.resume is None:  # a fresh start: what an earlier attempt logged here goes
            self.logger.truncate_after(-1)
            return
        path, state = self.resume
        m = self.models
        for role, model in m.trained().items():
            if fingerprint_key(role) in state:
                check_lora_base(path, role, state[fingerprint_key(role)], model.chunks, self.cfg)
        training.load_models(path, m.checkpointed())
        torch.set_rng_state(state["torch_rng"])
        self.step = state["step"]
        self.data.sampler.load_state_dict(state["sampler"])
        for role, model in m.trained().items():
            model.sched.load_state_dict(state[f"{role}_sched"])
        if self.scorer is not None and self.scorer.reward_model is not None:
            self.scorer.reward_model.load_state_dict(state.get("reward_model_stats"))
        self.logger.truncate_after(self.step)
        log.info("resumed from %s at step %d", path, self.step)

    @property
    def pad_id(self) -> int:
        """The token that pads sequences: the tokenizer's pad, else its EOS, else 0."""
        tok = self.tokenizer
        return tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)

    @property
    def pad_to(self) -> int:
        """Sequences are padded to a multiple of this (sequence parallelism, FP8 recipes)."""
        prec = self.cfg.precision
        return sequence_multiple(
            self.groups.tp_size, self.cfg.parallel.sequence_parallel, prec.fp8 and prec.fp8_recipe
        )

    @property
    def micro_batching(self) -> MicroBatching:
        """How every pass of the run cuts a batch into micro-batches (`algorithm.*`)."""
        return MicroBatching.of(self.cfg.algorithm, pad_to=self.pad_to)

    def close(self) -> None:
        """Shut the rollout's engines down and close the logs (a second call does nothing)."""
        rollout, self.rollout = self.rollout, None
        if rollout is not None:
            rollout.close()
        self.logger.close()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def fingerprint_key(role: str) -> str:
    """The trainer-state key of the base fingerprint of `role`'s LoRA adapters (the actor's
    keeps the name it had when it was the only LoRA role, so its checkpoints still resume)."""
    return "lora_base_fingerprint" if role == "actor" else f"{role}_lora_base_fingerprint"


def check_lora_base(path: str, role: str, want: float, chunks, cfg: RunConfig) -> None:
    """Refuse to resume `role`'s LoRA adapters on another base than the one they were trained
    on (the run's model source changed since the checkpoint). Collective."""
    have = lora.base_fingerprint(chunks)
    if abs(have - want) > 1e-9 * max(abs(want), 1e-30):
        m = cfg.model
        source = next(
            (f"model.{k}={getattr(m, k)!r}" for k in ("hf", "mcore_ckpt") if getattr(m, k)),
            f"the seeded init of model.config (model.init_seed={m.init_seed})",
        )
        if role == "critic" and m.critic_init != "actor":
            source = f"model.critic_init={m.critic_init!r}"
        raise ConfigError(
            f"{path}: the {role}'s LoRA adapters were trained on another base model than "
            f"{source} builds now (sum of squares of the layers' weights {want:.12g} there, "
            f"{have:.12g} here); accepted: the model source the run started from"
        )
