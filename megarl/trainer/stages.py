"""The offline stages (`algorithm.name: sft | dpo | rm`): what each reads, which models it needs,
and its loss at the one forward seam. The loop that drives them is `megarl.trainer.offline`.

A stage is a small object with
- `trains`: the role (`megarl.trainer.models.Models` field) it trains and exports: "actor", or
  "reward" (a reward model, `rm`);
- `sources`: the roles of a megarl checkpoint (`model.mcore_ckpt`) it starts from, in order of
  preference;
- `model_arch(arch, tokenizer)`: the architecture of the trained model, from that of `model.*`
  (a reward model: the trunk as a one-label sequence classifier);
- `reference`: whether the run builds the frozen reference model;
- `read(rows, tokenizer, data_cfg, max_length=, source=)`: its dataset (`megarl.data.offline`);
- `toy_rows()`: the rows of the embedded copy task, used when `data.path` is null;
- `denominator(dataset, indices)`: its loss's global denominator over the rows `indices` of a
  whole step (every DP rank holds the dataset and the step's global indices, so no collective
  is needed): trained tokens (SFT) or pairs (DPO);
- `prepare(run, batch)`: forward passes the loss reads before the update (DPO: the reference's
  sequence logprobs, once per batch);
- `loss_fn(run, denominator)`: `loss_fn(micro_batch, logits) -> (share, metric shares)`, the
  contract of `megarl.models.forward`;
- `together_key`: the batch field whose equal values must share a micro-batch (pairs), or None;
- `finalize(metrics)`: metrics computed from the reduced ones (SFT: perplexity).
The policy stages (SFT, DPO) share `_PolicyStage`'s `trains`, `sources` and `model_arch`.
Register a new stage with `register_stage` (a duplicate or unknown name raises).
"""

from __future__ import annotations

import math

import torch

from megarl.algorithms.preference import (
    bradley_terry_loss,
    preference_loss,
    sequence_logps,
)
from megarl.algorithms.sft import sft_loss
from megarl.data.offline import read_preferences, read_sft
from megarl.models import forward

_STAGES: dict[str, type] = {}


def register_stage(name: str):
    def wrap(cls):
        if name in _STAGES:
            raise ValueError(f"offline stage {name!r} is registered twice")
        _STAGES[name] = cls
        return cls

    return wrap


def get_stage(alg):
    """The stage object for `alg` (an AlgorithmConfig with an offline `name`)."""
    try:
        return _STAGES[alg.name](alg)
    except KeyError:
        raise ValueError(f"no offline stage {alg.name!r}; known: {sorted(_STAGES)}") from None


def _logprobs(run, micro: dict, logits: torch.Tensor) -> torch.Tensor:
    return forward.vocab_parallel_logprobs(
        logits, micro["targets"], vocab_size=run.arch.vocab_size, tp_group=run.groups.tp
    )


class _PolicyStage:
    """A stage that trains the policy (the actor) from a causal LM."""

    trains = "actor"
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

    def __init__(self, alg):
        self.alg = alg

    read = staticmethod(read_sft)

    @staticmethod
    def toy_rows() -> list[dict]:
        from megarl.data.toy import toy_sft_rows

        return toy_sft_rows()

    @staticmethod
    def denominator(dataset, indices: list[int]) -> float:
        return float(sum(sum(dataset.sequences[i].trained[1:]) for i in indices))

    def prepare(self, run, batch: dict) -> None:
        pass

    def loss_fn(self, run, denominator: float):
        def loss_fn(micro, logits):
            lp = _logprobs(run, micro, logits)
            correct = forward.vocab_parallel_top1(
                logits, micro["targets"], vocab_size=run.arch.vocab_size, tp_group=run.groups.tp
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
        self.alg = alg
        self.opts = alg.preference_options
        self.reference = alg.needs_reference
        self.mean = self.opts.mean

    read = staticmethod(read_preferences)

    @staticmethod
    def toy_rows() -> list[dict]:
        from megarl.data.toy import toy_preference_rows

        return toy_preference_rows()

    @staticmethod
    def denominator(dataset, indices: list[int]) -> float:
        return float(len(indices))

    def prepare(self, run, batch: dict) -> None:
        """The reference's sequence logprobs `ref_logps` [2P] (zeros off the last PP stage,
        which computes no loss)."""
        if not self.reference:
            return
        from megarl.trainer.experience import forward_logprobs

        lp = forward_logprobs(
            run.models.reference,
            batch,
            micro_batch_size=self.alg.micro_batch_size,
            vocab_size=run.arch.vocab_size,
            groups=run.groups,
            temperature=1.0,
            pad_to=run.pad_to,
            max_tokens=self.alg.max_tokens_per_micro_batch,
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
class RewardModelStage:
    """A reward model trained on preference pairs with the Bradley-Terry loss
    (`megarl.algorithms.preference.bradley_terry_loss`, with the pairs' `margin` when the data
    has one), each sequence scored where transformers' sequence classifiers read
    (`megarl.rewards.model.score_positions`)."""

    trains = "reward"
    sources = ("reward", "actor")  # continue a reward model, or start from a policy's trunk
    reference = False
    together_key = "pair"

    def __init__(self, alg):
        self.alg = alg

    read = staticmethod(read_preferences)

    @staticmethod
    def toy_rows() -> list[dict]:
        from megarl.data.toy import toy_reward_model_rows

        return toy_reward_model_rows()

    @staticmethod
    def model_arch(arch, tokenizer):
        """A reward model as it is; a causal LM's trunk as a one-label classifier whose
        `pad_token_id` (where its config has none) is the tokenizer's pad (else its EOS)."""
        if arch.score_head:
            return arch
        pad = tokenizer.pad_token_id
        return arch.as_classifier(pad if pad is not None else tokenizer.eos_token_id)

    @staticmethod
    def denominator(dataset, indices: list[int]) -> float:
        return float(len(indices))

    def prepare(self, run, batch: dict) -> None:
        """`score_index` [2P]: where each sequence's score is read."""
        from megarl.rewards.model import score_positions

        ids = [
            row[: int(n)].tolist() for row, n in zip(batch["tokens"], batch["seq_len"], strict=True)
        ]
        pad = run.arch.hf_config.get("pad_token_id")
        batch["score_index"] = torch.tensor(score_positions(ids, pad), dtype=torch.long)

    def loss_fn(self, run, denominator: float):
        from megarl.rewards.model import pick_scores

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
