"""A reward model's score for every sample of an RL step (`reward.model`), and where such a model
comes from.

Where the score is read: as transformers' `GenericForSequenceClassification` (5.x) reads it, the
score head's output at the rightmost token that is not the config's `pad_token_id`. With pad ==
eos a final EOS is therefore skipped and the last response token is read; a sequence of pad
tokens only is read at position 0; a config without `pad_token_id` reads the last token (what
transformers does for one unpadded sequence). `score_positions` computes that position on each
sequence's own ids, which equals transformers' result for a right- or left-padded batch.

What is scored: prompt + response. When the reward model's tokenizer is the policy's (the same
vocabulary and chat template) the sample's ids as generated; otherwise the prompt is rendered
with the reward model's tokenizer and chat template (the `data.*` settings, as for the policy)
and followed by the decoded response (special tokens skipped) tokenized on its own, and the
reward model's EOS when the response stopped (finish reason `stop`): the form a reward model
trained by megarl (`algorithm.name: rm`) sees its pairs in.

Sharding: the reward model is built at the run's layout (the same TP / PP / DP as the actor;
`megarl.trainer.models`). A DP rank scores its own samples with forward passes through
megatron's schedule (forward only); the scores exist on the last pipeline stage and are
broadcast over the pipeline group, so every rank holds its samples' scores.

Normalisation (`reward.model_normalize: running`): every rank keeps the count, mean and sum of
squared deviations of every score of the run so far (all DP ranks, Chan's parallel update, in
float64); a step's scores update them first and are then mapped to (score - mean) / sqrt(var +
1e-8). The statistics are saved in the trainer state of every checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megarl.convert.model_files import ModelFiles, open_model_files
from megarl.data.batch import MicroBatching, collate_sequences, split_micro_batches
from megarl.data.dataset import prompt_text
from megarl.data.tokenizer import load_tokenizer
from megarl.errors import ConfigError
from megarl.models import forward
from megarl.models.hf_config import ModelArch

log = logging.getLogger("megarl")

_ACCEPTED = (
    "a Hugging Face <Family>ForSequenceClassification directory with num_labels 1 "
    "(config.json + *.safetensors + tokenizer files), a megarl reward-model run RUN or "
    "checkpoint RUN/checkpoints/step_N, or a `megarl convert hf-to-mcore` directory of one"
)


def score_positions(ids: list[list[int]], pad_token_id: int | None) -> list[int]:
    """Per sequence, the position whose output is its score (module docstring):
    the last index t with `ids[t] != pad_token_id` (0 when there is none), or the last index
    when `pad_token_id` is None."""
    out = []
    for seq in ids:
        if pad_token_id is None:
            out.append(len(seq) - 1)
            continue
        out.append(next((t for t in range(len(seq) - 1, -1, -1) if seq[t] != pad_token_id), 0))
    return out


# ---------------------------------------------------------------------- where it comes from
def open_scalar_model(path: str, key: str, roles: tuple[str, ...] = ("reward",)):
    """`ModelFiles` of the directory `path` named by config key `key`; a megarl trainer
    checkpoint is read as the first of `roles` it holds. Raises a `UserError` naming the key
    when `path` is not a reward model megarl can build (a causal LM, num_labels != 1, an
    architecture megarl does not build, HF tensors that do not fit the config)."""

    if not os.path.isdir(path):
        what = "is not a directory" if os.path.exists(path) else "does not exist"
        raise ConfigError(f"{key}={path!r} {what}; accepted: {_ACCEPTED}")
    files = open_model_files(path, key, roles, scalar_head=True, accepted=_ACCEPTED)
    if not files.arch.score_head:  # a critic's trunk (a causal LM's config)
        arch = files.arch.as_classifier(files.arch.hf_config.get("pad_token_id"))
        files = dataclasses.replace(files, arch=arch)
    return files


def reward_tokenizer(source: ModelFiles, policy_tokenizer):
    """(the reward model's tokenizer, whether the policy's token ids can be scored as they are:
    the same vocabulary, special tokens and chat template)."""
    if source.tokenizer_dir is None:
        raise ConfigError(
            f"{source.describe()} keeps no tokenizer (tokenizer.json / tokenizer_config.json); "
            "accepted: a reward model directory with its tokenizer files"
        )
    tok = load_tokenizer(source.tokenizer_dir)
    return tok, same_tokenizer(tok, policy_tokenizer)


def same_vocabulary(a, b) -> bool:
    """Whether two tokenizers map every token to the same id."""
    return a.get_vocab() == b.get_vocab()


def same_tokenizer(a, b) -> bool:
    """`same_vocabulary`, the same EOS and the same chat template: a text becomes the same ids."""
    return (
        same_vocabulary(a, b)
        and a.eos_token_id == b.eos_token_id
        and getattr(a, "chat_template", None) == getattr(b, "chat_template", None)
    )


# ---------------------------------------------------------------------- running statistics
@dataclass
class RunningStats:
    """Count, mean and sum of squared deviations of every score seen (module docstring)."""

    count: float = 0.0
    mean: float = 0.0
    m2: float = 0.0

    def update(self, values: torch.Tensor, group) -> None:
        """Add this DP rank's `values` [b]; collective over `group` (the DP group)."""
        x = values.double()
        t = torch.tensor([float(x.numel()), float(x.sum())], dtype=torch.float64)
        dist.all_reduce(t, group=group)
        n, total = float(t[0]), float(t[1])
        if n == 0:
            return
        mean = total / n
        dev = torch.tensor([float((x - mean).square().sum())], dtype=torch.float64)
        dist.all_reduce(dev, group=group)
        delta = mean - self.mean
        both = self.count + n
        self.m2 += float(dev[0]) + delta * delta * self.count * n / both
        self.mean += delta * n / both
        self.count = both

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count else 0.0

    def normalize(self, values: torch.Tensor) -> torch.Tensor:
        var = self.m2 / self.count if self.count else 1.0
        return ((values.double() - self.mean) / math.sqrt(var + 1e-8)).to(values.dtype)

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.mean, self.m2 = (float(state[k]) for k in ("count", "mean", "m2"))


# ---------------------------------------------------------------------- scoring
class RewardModel:
    """Scores an RL step's samples with the frozen reward model `chunks` (module docstring)."""

    def __init__(
        self, chunks, arch: ModelArch, tokenizer, *, reuse_ids: bool, cfg, groups, pad_to: int
    ):
        self.chunks, self.arch, self.tokenizer, self.reuse_ids = chunks, arch, tokenizer, reuse_ids
        self.cfg, self.groups, self.pad_to = cfg, groups, pad_to
        self.pad_token_id = arch.hf_config.get("pad_token_id")
        self.stats = RunningStats() if cfg.reward.model_normalize == "running" else None

    def sequences(self, prompts, rollout, policy_tokenizer) -> list[list[int]]:
        """The ids the reward model reads for each sample (module docstring)."""
        if self.reuse_ids:
            return [
                list(p) + list(r)
                for p, r in zip(rollout.prompt_ids, rollout.response_ids, strict=True)
            ]
        tok, out = self.tokenizer, []
        texts = policy_tokenizer.batch_decode(rollout.response_ids, skip_special_tokens=True)
        for i, (text, reason) in enumerate(zip(texts, rollout.finish_reason, strict=True)):
            prompt = prompts.prompts[rollout.prompt_index[i]]
            head, special = prompt_text(prompt, tok, self.cfg.data, f"sample {i}")
            ids = list(tok(head, add_special_tokens=special)["input_ids"])
            ids += list(tok(text, add_special_tokens=False)["input_ids"]) if text else []
            if reason == "stop" and tok.eos_token_id is not None:
                ids.append(tok.eos_token_id)
            out.append(ids)
        return out

    def score(self, ids: list[list[int]]) -> torch.Tensor:
        """Scores [B] (float32) of the sequences `ids` on every rank of this rank's model-parallel
        group (collective over it)."""
        longest = max(len(x) for x in ids)
        if longest > self.arch.max_position_embeddings:
            raise RuntimeError(
                f"reward.model: a sample of {longest} tokens exceeds the reward model's "
                f"max_position_embeddings ({self.arch.max_position_embeddings}); lower "
                "rollout.sampling.max_tokens or data.max_prompt_length"
            )
        g, alg = self.groups, self.cfg.algorithm
        batch = collate_sequences(
            ids,
            [[False] * len(x) for x in ids],
            self.pad_token_id or 0,
            pad_to_multiple=self.pad_to,
        )
        batch["score_index"] = torch.tensor(score_positions(ids, self.pad_token_id))
        mbs = split_micro_batches(batch, MicroBatching.of(alg, pad_to=self.pad_to))

        def loss_fn(mb, values):
            return torch.zeros(()), {"index": mb["index"], "scores": pick_scores(mb, values)}

        with torch.no_grad():
            out = forward.forward_backward(
                self.chunks, mbs, loss_fn, forward_only=True, dp_size=g.dp_size
            )
        scores = torch.zeros(len(ids), dtype=torch.float32)
        for m in out:
            scores[m["index"]] = m["scores"].float().cpu()
        last_stage_scores = [scores.tolist()]  # the last stage's scores to every stage
        last = dist.get_global_rank(g.pp, g.pp_size - 1)
        dist.broadcast_object_list(last_stage_scores, src=last, group=g.pp)
        return torch.tensor(last_stage_scores[0], dtype=torch.float32)

    def reward(self, raw: torch.Tensor) -> torch.Tensor:
        """What enters the total reward: `raw`, or normalised by the running statistics (which
        it updates; collective over DP)."""
        if self.stats is None:
            return raw
        self.stats.update(raw, self.groups.dp)
        return self.stats.normalize(raw)

    def state_dict(self) -> dict | None:
        return None if self.stats is None else self.stats.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        if self.stats is not None and state is not None:
            self.stats.load_state_dict(state)


def pick_scores(mb: dict, values: torch.Tensor) -> torch.Tensor:
    """The score of each of the micro-batch's rows: the model's `values` (`[b', s, 1]`, b' >= b
    with pipeline padding rows; packed: the row `[1, T, 1]`) read at `mb["score_index"]` [b]
    -> [b]."""
    n = len(mb["index"])
    values = forward.per_token(mb, values[..., 0])
    return values[:n].gather(1, mb["score_index"][:n, None].to(values.device)).squeeze(1)
