"""The stages a run can be (`algorithm.name`, and `megarl eval`): what each reads, which models it
builds, and (offline) its loss at the one forward seam. `megarl.trainer.recipe.build_run` builds
every run from a stage; the loops (`megarl.trainer.loop` for RL, `megarl.trainer.offline`) drive it.

Every stage satisfies `Stage` (below): the recipe asks it for its model source, its checks, its
data and its models, and builds the rest (layout, tokenizer, resume, logging, the rollout engine
when `engine`) the same way for all. `RLStage` (grpo, ppo) and `EvalStage` (`megarl eval`) use the
rollout engine; the offline stages (sft, dpo, rm) satisfy `OfflineStage` too:
- `denominator(dataset, indices)`: its loss's global denominator over the rows `indices` of a
  whole step (every DP rank holds the dataset and the step's global indices, so no collective
  is needed): trained tokens (SFT) or pairs (DPO);
- `prepare(run, batch)`: forward passes the loss reads before the update (DPO: the reference's
  sequence logprobs, once per batch);
- `loss_fn(run, denominator)`: `loss_fn(micro_batch, logits) -> (share, metric shares)`, the
  contract of `megarl.models.forward`;
- `together_key`: the batch field whose equal values must share a micro-batch (pairs), or None;
- `finalize(metrics)`: metrics computed from the reduced ones (SFT: perplexity).
The policy stages (SFT, DPO) share `_PolicyStage`'s `role`, `sources` and `model_arch`.
Register a new stage with `register_stage` (a duplicate or unknown name raises).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Protocol

import torch
import torch.distributed as dist

from megarl.algorithms.preference import (
    bradley_terry_loss,
    preference_loss,
    sequence_logps,
)
from megarl.algorithms.sft import sft_loss
from megarl.config import ConfigError, RunConfig
from megarl.data.dataset import load_rows
from megarl.data.offline import read_preferences, read_sft, split_held_out
from megarl.data.split import prompt_sets
from megarl.data.toy import toy_preference_rows, toy_reward_model_rows, toy_sft_rows
from megarl.models import forward
from megarl.models.hf_config import ModelArch
from megarl.rewards.model import pick_scores, score_positions
from megarl.trainer.evaluate import check_eval
from megarl.trainer.experience import forward_logprobs
from megarl.trainer.models import (
    Models,
    ModelSources,
    build_frozen_policy,
    build_models,
    build_trained_reward,
    model_sources,
)

log = logging.getLogger("megarl")


_STAGES: dict[str, type] = {}


def register_stage(name: str):
    def wrap(cls):
        if name in _STAGES:
            raise ValueError(f"stage {name!r} is registered twice")
        _STAGES[name] = cls
        return cls

    return wrap


def get_stage(alg) -> Stage:
    """The stage object for `alg` (an AlgorithmConfig): RL (grpo, ppo) or an offline stage."""
    try:
        return _STAGES[alg.name](alg)
    except KeyError:
        raise ValueError(f"no stage {alg.name!r}; known: {sorted(_STAGES)}") from None


class Stage(Protocol):
    """What `megarl.trainer.recipe.build_run` asks of a stage (module docstring)."""

    role: str
    """The model role it trains or evaluates (a `Models` field): "actor" or "reward"."""
    trains: bool
    """Whether it updates that model (False: `megarl eval`): optimizer, resume, checkpoints."""
    engine: bool
    """Whether it generates with the rollout engine (RL, evaluation), scoring with the reward
    functions (and the reward model)."""
    sources: tuple[str, ...]
    """The roles of a megarl checkpoint (`model.mcore_ckpt`) it starts from, by preference."""

    def check(self, cfg: RunConfig, arch: ModelArch) -> None:
        """Config checks that need only the model's architecture (before any process group)."""

    def model_sources(self, cfg: RunConfig) -> ModelSources:
        """The reward model / critic start it reads besides `model.*` (small files only)."""

    def model_arch(self, arch: ModelArch, tokenizer) -> ModelArch:
        """The architecture of the model it builds from that of `model.*` (`arch`)."""

    def read_data(self, cfg: RunConfig, tokenizer, arch: ModelArch, dp_size: int):
        """(training rows, held-out rows or None), every row read and checked."""

    def resolve(self, cfg: RunConfig, dataset) -> RunConfig:
        """`cfg` with what its data decides filled in (offline: trainer.steps from epochs)."""

    def updates(self, cfg: RunConfig) -> int:
        """Optimizer steps the learning-rate schedules span."""

    def trained_roles(self, arch: ModelArch, sources: ModelSources) -> dict[str, ModelArch]:
        """{role: architecture} of the models it trains (what a resumed checkpoint must hold)."""

    def build_models(
        self,
        cfg: RunConfig,
        arch: ModelArch,
        source_arch: ModelArch,
        sources: ModelSources,
        *,
        gpu: bool,
    ) -> Models:
        """Its models, each with its starting weights."""


class OfflineStage(Stage, Protocol):
    """A stage trained on a fixed dataset by `megarl.trainer.offline` (module docstring)."""

    together_key: str | None

    def denominator(self, dataset, indices: list[int]) -> float: ...

    def prepare(self, run, batch: dict) -> None: ...

    def loss_fn(self, run, denominator: float): ...

    def finalize(self, metrics: dict) -> dict: ...


def check_rollout_length(cfg: RunConfig, arch: ModelArch) -> None:
    """The longest sampled sequence (prompt + response) fits the model."""
    longest = cfg.data.max_prompt_length + cfg.rollout.sampling.max_tokens
    if longest > arch.max_position_embeddings:
        raise ConfigError(
            f"data.max_prompt_length ({cfg.data.max_prompt_length}) + rollout.sampling.max_tokens "
            f"({cfg.rollout.sampling.max_tokens}) = {longest} exceeds the model's "
            f"max_position_embeddings ({arch.max_position_embeddings})"
        )


def held_out_prompts(cfg: RunConfig, tokenizer):
    """(training prompts, held-out prompts cut to `eval.max_prompts`, or None)."""
    dataset, held_out = prompt_sets(cfg.data, cfg.eval, tokenizer)
    cap = cfg.eval.max_prompts
    if held_out is not None and cap is not None and cap < len(held_out):
        held_out = held_out.subset(list(range(cap)))
    return dataset, held_out


class RLStage:
    """grpo, ppo and distill: prompts generated by the rollout engine, scored, trained on
    (`megarl.trainer.loop`)."""

    role = "actor"
    trains = True
    engine = True
    sources = ("actor",)

    def __init__(self, alg):
        self.alg = alg

    def check(self, cfg: RunConfig, arch: ModelArch) -> None:
        check_rollout_length(cfg, arch)
        check_eval(cfg, arch)

    def model_sources(self, cfg: RunConfig) -> ModelSources:
        return model_sources(cfg)

    @staticmethod
    def model_arch(arch: ModelArch, tokenizer) -> ModelArch:
        return arch

    def read_data(self, cfg: RunConfig, tokenizer, arch: ModelArch, dp_size: int):
        return held_out_prompts(cfg, tokenizer)

    def resolve(self, cfg: RunConfig, dataset) -> RunConfig:
        return cfg

    def updates(self, cfg: RunConfig) -> int:
        return cfg.trainer.steps * self.alg.ppo_epochs * self.alg.mini_batches

    def trained_roles(self, arch: ModelArch, sources: ModelSources) -> dict[str, ModelArch]:
        roles = {"actor": arch}
        if self.alg.name == "ppo":
            roles["critic"] = sources.critic.arch if sources.critic is not None else arch
        return roles

    def build_models(self, cfg, arch, source_arch, sources, *, gpu: bool) -> Models:
        return build_models(
            cfg,
            arch,
            gpu=gpu,
            updates=self.updates(cfg),
            reference=self.alg.needs_reference,
            critic=self.alg.name == "ppo",
            reward=sources.reward,
            critic_source=sources.critic,
            teacher=sources.teacher,
        )


register_stage("grpo")(RLStage)
register_stage("ppo")(RLStage)
register_stage("distill")(RLStage)


class EvalStage(RLStage):
    """`megarl eval`: the policy frozen, its held-out prompts generated and scored once."""

    trains = False

    def check(self, cfg: RunConfig, arch: ModelArch) -> None:
        check_eval(cfg, arch)

    def model_sources(self, cfg: RunConfig) -> ModelSources:
        return ModelSources()  # evaluation scores with the reward functions alone

    def trained_roles(self, arch: ModelArch, sources: ModelSources) -> dict[str, ModelArch]:
        return {}

    def build_models(self, cfg, arch, source_arch, sources, *, gpu: bool) -> Models:
        return build_frozen_policy(cfg, arch, gpu=gpu)


def read_offline_sets(stage, cfg: RunConfig, tokenizer, max_positions: int, dp_size: int):
    """An offline stage's (training rows, held-out rows per the `eval` section or None), read,
    tokenized and checked in full by `stage.read`."""
    d, e = cfg.data, cfg.eval
    limit = d.max_length or max_positions
    if limit > max_positions:
        raise ConfigError(
            f"data.max_length={d.max_length} exceeds the model's max_position_embeddings "
            f"({max_positions}); accepted: at most {max_positions}, or null"
        )
    rows, source = (
        (stage.toy_rows(), "<toy copy task>") if d.path is None else (load_rows(d.path), d.path)
    )

    def read(rows: list[dict], source: str):
        ds = stage.read(rows, tokenizer, d, max_length=limit, source=source)
        if (ds.num_dropped or ds.num_truncated) and dist.get_rank() == 0:
            log.warning(
                "%s: %d rows over data.max_length=%d dropped, %d truncated on the left",
                source,
                ds.num_dropped,
                limit,
                ds.num_truncated,
            )
        return ds

    held_out = read(load_rows(e.path), e.path) if e.path is not None else None
    dataset = read(rows, source)
    if e.path is None and e.fraction > 0:
        train_idx, held_idx = split_held_out(list(range(len(dataset))), e.fraction, e.seed)
        dataset, held_out = dataset.subset(train_idx), dataset.subset(held_idx)
    if held_out is not None:
        if e.max_prompts is not None:
            held_out = held_out.subset(list(range(min(e.max_prompts, len(held_out)))))
        if len(held_out) < dp_size:
            raise ConfigError(
                f"the held-out set has {len(held_out)} rows, fewer than the {dp_size} "
                "data-parallel ranks that evaluate it; raise eval.fraction or eval.max_prompts"
            )
    return dataset, held_out


class _Offline:
    """What every offline stage shares: it trains `role` on a fixed dataset, no engine."""

    trains = True
    engine = False

    def __init__(self, alg):
        self.alg = alg

    def check(self, cfg: RunConfig, arch: ModelArch) -> None:
        pass

    def model_sources(self, cfg: RunConfig) -> ModelSources:
        return ModelSources()

    def read_data(self, cfg: RunConfig, tokenizer, arch: ModelArch, dp_size: int):
        return read_offline_sets(self, cfg, tokenizer, arch.max_position_embeddings, dp_size)

    def resolve(self, cfg: RunConfig, dataset) -> RunConfig:
        """trainer.steps from trainer.epochs (when set) over the training rows."""
        t = cfg.trainer
        if t.epochs is None:
            return cfg
        steps = max(1, math.ceil(t.epochs * len(dataset) / cfg.data.prompts_per_step))
        log.info("trainer.epochs=%g over %d rows: %d steps", t.epochs, len(dataset), steps)
        return dataclasses.replace(cfg, trainer=dataclasses.replace(t, steps=steps))

    def updates(self, cfg: RunConfig) -> int:
        return cfg.trainer.steps

    def trained_roles(self, arch: ModelArch, sources: ModelSources) -> dict[str, ModelArch]:
        return {self.role: arch}

    def build_models(self, cfg, arch, source_arch, sources, *, gpu: bool) -> Models:
        return build_models(
            cfg, arch, gpu=gpu, updates=self.updates(cfg), reference=self.alg.needs_reference
        )


def _logprobs(run, micro: dict, logits: torch.Tensor) -> torch.Tensor:
    return forward.token_logprobs(
        micro, logits, vocab_size=run.arch.vocab_size, tp_group=run.groups.tp
    )


class _PolicyStage(_Offline):
    """A stage that trains the policy (the actor) from a causal LM."""

    role = "actor"
    sources = ("actor",)

    @staticmethod
    def model_arch(arch, tokenizer):
        return arch


def _check_pairs(micro: dict) -> None:
    idx = micro["index"]
    if not (torch.all(idx[0::2] % 2 == 0) and torch.equal(idx[1::2], idx[0::2] + 1)):
        raise RuntimeError("a preference pair was split across micro-batches")


@register_stage("sft")
class SFT(_PolicyStage):
    """Token-mean NLL of the trained tokens (`megarl.algorithms.sft`)."""

    reference = False
    together_key = None
    read = staticmethod(read_sft)

    @staticmethod
    def toy_rows() -> list[dict]:
        return toy_sft_rows()

    @staticmethod
    def denominator(dataset, indices: list[int]) -> float:
        return float(sum(sum(dataset.sequences[i].trained[1:]) for i in indices))

    def prepare(self, run, batch: dict) -> None:
        pass

    def loss_fn(self, run, denominator: float):
        def loss_fn(micro, logits):
            lp = _logprobs(run, micro, logits)
            correct = forward.token_top1(
                micro, logits, vocab_size=run.arch.vocab_size, tp_group=run.groups.tp
            )
            loss, m = sft_loss(lp, micro["loss_mask"], global_tokens=denominator, correct=correct)
            return loss, {"loss": loss.detach(), "token_accuracy": m["token_accuracy"]}

        return loss_fn

    @staticmethod
    def finalize(metrics: dict) -> dict:
        if "loss" in metrics:
            metrics["ppl"] = math.exp(min(metrics["loss"], 700.0))  # exp overflows past ~709
        return metrics


@register_stage("dpo")
class DPO(_PolicyStage):
    """A pairwise preference loss (`algorithm.dpo_loss`, `megarl.algorithms.preference`) on the
    sequence logprobs of each pair's chosen and rejected response."""

    together_key = "pair"

    def __init__(self, alg):
        super().__init__(alg)
        self.opts = alg.preference_options
        self.reference = alg.needs_reference
        self.mean = self.opts.mean

    read = staticmethod(read_preferences)

    @staticmethod
    def toy_rows() -> list[dict]:
        return toy_preference_rows()

    @staticmethod
    def denominator(dataset, indices: list[int]) -> float:
        return float(len(indices))

    def prepare(self, run, batch: dict) -> None:
        """The reference's sequence logprobs `ref_logps` [2P] (zeros off the last PP stage,
        which computes no loss)."""
        if not self.reference:
            return
        with run.models.reference_policy() as reference:
            lp = forward_logprobs(
                reference,
                batch,
                micro=run.micro_batching,
                vocab_size=run.arch.vocab_size,
                groups=run.groups,
                temperature=1.0,
            )
        rows = batch["tokens"].shape[0]
        batch["ref_logps"] = (
            torch.zeros(rows)
            if lp is None
            else sequence_logps(lp, batch["loss_mask"], mean=self.mean)
        )

    def loss_fn(self, run, denominator: float):
        def loss_fn(micro, logits):
            n = len(micro["index"])  # rows beyond n pad the micro-batch (pipeline shapes)
            _check_pairs(micro)
            lp = _logprobs(run, micro, logits)[:n]
            seq = sequence_logps(lp, micro["loss_mask"][:n], mean=self.mean)
            ref = micro["ref_logps"][:n].to(seq.dtype) if self.reference else None
            loss, m = preference_loss(
                seq[0::2],
                seq[1::2],
                ref[0::2] if ref is not None else None,
                ref[1::2] if ref is not None else None,
                self.opts,
                global_pairs=denominator,
            )
            return loss, {"loss": loss.detach(), **m}

        return loss_fn

    @staticmethod
    def finalize(metrics: dict) -> dict:
        return metrics


@register_stage("rm")
class RewardModelStage(_Offline):
    """A reward model trained on preference pairs with the Bradley-Terry loss
    (`megarl.algorithms.preference.bradley_terry_loss`, with the pairs' `margin` when the data
    has one), each sequence scored where transformers' sequence classifiers read
    (`megarl.rewards.model.score_positions`)."""

    role = "reward"
    sources = ("reward", "actor")  # continue a reward model, or start from a policy's trunk
    reference = False
    together_key = "pair"
    read = staticmethod(read_preferences)

    @staticmethod
    def toy_rows() -> list[dict]:
        return toy_reward_model_rows()

    @staticmethod
    def model_arch(arch, tokenizer):
        """A reward model as it is; a causal LM's trunk as a one-label classifier whose
        `pad_token_id` (where its config has none) is the tokenizer's pad (else its EOS)."""
        if arch.score_head:
            return arch
        pad = tokenizer.pad_token_id
        return arch.as_classifier(pad if pad is not None else tokenizer.eos_token_id)

    def build_models(self, cfg, arch, source_arch, sources, *, gpu: bool) -> Models:
        return build_trained_reward(cfg, arch, source_arch, gpu=gpu, updates=self.updates(cfg))

    @staticmethod
    def denominator(dataset, indices: list[int]) -> float:
        return float(len(indices))

    def prepare(self, run, batch: dict) -> None:
        """`score_index` [2P]: where each sequence's score is read."""
        ids = [
            row[: int(n)].tolist() for row, n in zip(batch["tokens"], batch["seq_len"], strict=True)
        ]
        pad = run.arch.hf_config.get("pad_token_id")
        batch["score_index"] = torch.tensor(score_positions(ids, pad), dtype=torch.long)

    def loss_fn(self, run, denominator: float):
        def loss_fn(micro, values):
            _check_pairs(micro)
            scores = pick_scores(micro, values).float()
            margin = micro.get("margin")
            loss, m = bradley_terry_loss(
                scores[0::2],
                scores[1::2],
                global_pairs=denominator,
                margin=None if margin is None else margin[0::2],
            )
            return loss, {"loss": loss.detach(), **m}

        return loss_fn

    @staticmethod
    def finalize(metrics: dict) -> dict:
        return metrics
