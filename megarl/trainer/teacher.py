"""The teacher of on-policy distillation (`teacher.model`, read when `algorithm.name: distill`
or `algorithm.distill_coef` > 0): a frozen causal LM that scores every token the student
sampled.

- `open_teacher(cfg)`: the `ModelFiles` from the teacher's small files (a GGUF file is
  converted once, by global rank 0, into the cache: collective); a reward model, a missing path
  or files that do not fit their config are refused naming `teacher.model`.
- `check_teacher(cfg, source, tokenizer)`: the teacher reads the policy's token ids (the same
  vocabulary; both tokenizers named when not) and holds the longest sampled sequence.
- `teacher_metrics`: `distill/reverse_kl` (the k1 estimate of KL(student || teacher) per sampled
  token) and `distill/agreement` (the share of sampled tokens that are the teacher's argmax).

It is built frozen at the run's layout and precision (`megarl.trainer.models.build_teacher`);
its logprobs come from `megarl.trainer.experience.forward_teacher`, the advantage from
`megarl.algorithms.distill`.
"""

from __future__ import annotations

import torch

from megarl.convert.model_files import ModelFiles, open_model_files
from megarl.data.tokenizer import load_tokenizer
from megarl.errors import ConfigError
from megarl.metrics.reduce import LocalMetrics
from megarl.models.hf_config import ModelArch
from megarl.rewards.model import same_vocabulary
from megarl.trainer.model_source import arch_from_small_files, local_model_path

KEY = "teacher.model"
_ACCEPTED = (
    "a Hugging Face causal-LM directory (config.json + *.safetensors + tokenizer files), a GGUF "
    "file, a megarl run RUN or checkpoint RUN/checkpoints/step_N (its actor), or a `megarl "
    "convert hf-to-mcore` directory"
)


def open_teacher(cfg) -> ModelFiles | None:
    """The `ModelFiles` of `teacher.model`, None without one. Collective when it names a GGUF
    file (every rank calls it)."""
    path = cfg.teacher.model
    if path is None:
        return None
    path = local_model_path(path, KEY, _ACCEPTED)
    files = open_model_files(path, KEY, ("actor",), scalar_head=False, accepted=_ACCEPTED)
    return files


def teacher_arch(cfg) -> ModelArch | None:
    """The teacher's architecture from its small files alone (a GGUF file's metadata, not
    converted): what a dry run and `megarl plan` read. None when the run has no teacher."""
    path = cfg.teacher.model
    if path is None or not cfg.algorithm.uses_teacher:
        return None
    return arch_from_small_files(path, KEY, _ACCEPTED)


def check_teacher(cfg, source: ModelFiles, tokenizer) -> None:
    """Refuse (`ConfigError` naming `teacher.model`) a teacher that cannot score the policy's
    samples: another vocabulary (both tokenizers named), no tokenizer files to check it by, or
    fewer positions than the longest sampled sequence."""
    policy_dir = cfg.model.tokenizer or cfg.model.hf or cfg.model.mcore_ckpt
    if source.tokenizer_dir is None:
        raise ConfigError(
            f"{source.describe()} keeps no tokenizer files (tokenizer.json / "
            "tokenizer_config.json), so it cannot be checked to read the policy's token ids; "
            f"accepted: a teacher directory holding the tokenizer it was trained with ({_ACCEPTED})"
        )
    theirs = load_tokenizer(source.tokenizer_dir)
    if not same_vocabulary(theirs, tokenizer):
        raise ConfigError(
            f"{source.describe()}: its tokenizer ({source.tokenizer_dir}, {len(theirs)} tokens) "
            f"is not the policy's ({policy_dir}, {len(tokenizer)} tokens, or other ids); the "
            "teacher scores the student's token ids, so both must map every token to the same "
            "id. Accepted: a teacher trained with the policy's tokenizer"
        )
    if source.arch.vocab_size < len(tokenizer):
        raise ConfigError(
            f"{source.describe()}: vocab_size {source.arch.vocab_size} is smaller than the "
            f"policy's tokenizer ({len(tokenizer)} tokens)"
        )
    longest = cfg.data.max_prompt_length + cfg.rollout.sampling.max_tokens
    if longest > source.arch.max_position_embeddings:
        raise ConfigError(
            f"data.max_prompt_length + rollout.sampling.max_tokens = {longest} exceeds the "
            f"max_position_embeddings of {source.describe()} "
            f"({source.arch.max_position_embeddings})"
        )


def teacher_metrics(
    teacher_logprobs: torch.Tensor,
    student_logprobs: torch.Tensor,
    teacher_top1: torch.Tensor,
    loss_mask: torch.Tensor,
) -> LocalMetrics:
    """`distill/reverse_kl`: mean over sampled tokens of student - teacher logprob (the k1
    estimate of KL(student || teacher)); `distill/agreement`: the share of sampled tokens that
    are the teacher's argmax. All [B, S]; `teacher_top1` 1.0 where the sampled token is the
    teacher's argmax."""
    valid = loss_mask.bool()
    out = LocalMetrics()
    gap = (student_logprobs.double() - teacher_logprobs.double())[valid]
    out.add_ratio("distill/reverse_kl", gap.sum(), valid.sum())
    out.add_ratio("distill/agreement", teacher_top1.double()[valid].sum(), valid.sum())
    return out
