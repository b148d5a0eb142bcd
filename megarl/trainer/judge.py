"""The judge of `reward.judge` (a generative model whose answer is the reward).

- `judge_arch(cfg)`: its shape from its small files (`megarl plan`); `refuse_on_gpu`.
- `find_judge(cfg)`, before any model is built: the judge's files (an HF causal-LM directory
  with its tokenizer, or a GGUF file converted once by global rank 0: collective) and its
  tokenizer. A reward model, a megarl checkpoint or a directory without a tokenizer is refused
  naming `reward.judge.model`.
- `open_judge(cfg, found, out_dir, ...)`: starts its vLLM engine in this process
  (`megarl.rollout.JudgeEngine`) and returns the `megarl.rewards.judge.Judge` the scorer calls.
- `trace_judge(run, prompts, rollout, verdicts)`: the first `reward.judge.log_answers` judged
  samples of each step into `RUN/judge/dp_<rank>.jsonl` (the judge's prompt, its answer, the
  score and whether it parsed).
"""

from __future__ import annotations

import json
import os

import torch.distributed as dist

from megarl import rollout as rollout_api
from megarl.convert.model_files import open_model_files
from megarl.data.tokenizer import load_tokenizer
from megarl.errors import ConfigError
from megarl.models.hf_config import ModelArch
from megarl.rewards.judge import Judge, Verdicts
from megarl.trainer.model_source import arch_from_small_files, local_model_path

KEY = "reward.judge.model"
_ACCEPTED = (
    "a Hugging Face causal-LM directory (config.json + *.safetensors + tokenizer files) or a GGUF "
    "file"
)


def refuse_on_gpu(cfg) -> None:
    """The GPU layouts a judge is not built for, refused naming the keys: beside separate
    engines, or beside colocated engines of vLLM TP > 1."""
    if cfg.reward.judge.model is None:
        return
    tp = cfg.rollout.engine.tensor_parallel
    if cfg.rollout.placement.mode == "colocated" and tp > 1:
        # vLLM's groups are process-wide: a second engine must have the first one's TP
        # (ensure_model_parallel_initialized, vllm/distributed/parallel_state.py:2392), and a TP
        # instance's ranks submit the same requests, where each rank judges its own samples
        raise ConfigError(
            f"{KEY} with rollout.engine.tensor_parallel={tp} on GPU: not built (the judge's "
            "engine would share the policy engines' TP groups, whose ranks hold different "
            "samples); accepted: rollout.engine.tensor_parallel=1, or no judge"
        )
    if cfg.rollout.placement.mode == "separate":
        # vLLM's groups are process-wide and its first engine in a process builds them over
        # every rank of the job (vllm/distributed/parallel_state.py, init_distributed_environment)
        raise ConfigError(
            f"{KEY} with rollout.placement.mode=separate on GPU: not built (the judge's engine "
            "would be the trainer ranks' first vLLM engine, whose groups span the engine ranks "
            "too); accepted: rollout.placement.mode=colocated, or no judge"
        )


def judge_arch(cfg) -> ModelArch:
    """The judge's architecture from its small files alone: what `megarl plan` reads."""
    return arch_from_small_files(cfg.reward.judge.model, KEY, _ACCEPTED)


def find_judge(cfg, *, gpu: bool) -> tuple[str, object] | None:
    """(the judge's HF directory, its tokenizer); None without `reward.judge.model`. Collective
    when it names a GGUF file (every rank calls it)."""
    path = cfg.reward.judge.model
    if path is None:
        return None
    if gpu:
        refuse_on_gpu(cfg)
    path = local_model_path(path, KEY, _ACCEPTED)
    files = open_model_files(path, KEY, ("actor",), scalar_head=False, accepted=_ACCEPTED)
    if not files.hf:
        raise ConfigError(
            f"{KEY}={path!r} is a megarl checkpoint; the judge's engine reads HF weights. "
            f"Accepted: {_ACCEPTED} (`megarl convert mcore-to-hf --ckpt {path} --out DIR` "
            "writes one)"
        )
    if files.tokenizer_dir is None:
        raise ConfigError(
            f"{KEY}={path!r} has no tokenizer files (tokenizer.json or tokenizer_config.json); "
            f"the judge reads text. Accepted: {_ACCEPTED}"
        )
    return files.path, load_tokenizer(files.tokenizer_dir)


def open_judge(cfg, found, out_dir: str, *, dtype: str) -> Judge | None:
    """The judge of `found` (`find_judge`) with its engine started; None when `found` is.
    Collective (every rank calls it)."""
    if found is None:
        return None
    jc = cfg.reward.judge
    path, tokenizer = found
    engine = rollout_api.JudgeEngine(
        path, out_dir, tokenizer=tokenizer, max_tokens=jc.max_tokens,
        temperature=jc.temperature, max_model_len=jc.max_model_len,
        kv_cache_memory_bytes=jc.kv_cache_memory_bytes,
        gpu_memory_utilization=jc.gpu_memory_utilization, dtype=dtype,
    )  # fmt: skip
    return Judge(jc, tokenizer, engine.generate)


def trace_judge(run, prompts, rollout, verdicts: Verdicts) -> None:
    """Append this step's first `reward.judge.log_answers` verdicts of this DP rank to
    `RUN/judge/dp_<rank>.jsonl` (one rank per DP rank writes)."""
    n = run.cfg.reward.judge.log_answers
    g = run.groups
    cp_rank = dist.get_rank(g.cp) if g.cp is not None else 0
    if n == 0 or g.tp_rank != 0 or cp_rank != 0 or not g.is_last_stage:
        return
    os.makedirs(os.path.join(run.out_dir, "judge"), exist_ok=True)
    rows = []
    for j in range(min(n, len(verdicts.prompts))):
        rows.append(
            {
                "step": run.step + 1,  # the step being taken
                "prompt_id": int(prompts.indices[rollout.prompt_index[j]]),
                "judge_prompt": verdicts.prompts[j],
                "judge_answer": verdicts.answers[j],
                "score": float(verdicts.scores[j]),
                "parsed": bool(verdicts.parsed[j]),
                "timed_out": bool(verdicts.timed_out[j]),
            }
        )
    with open(os.path.join(run.out_dir, "judge", f"dp_{g.dp_rank}.jsonl"), "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
