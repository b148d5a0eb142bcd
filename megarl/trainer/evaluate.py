"""Held-out evaluation through the colocated vLLM engine, so it measures the synced weights.

When (`Evaluator.due`): with `eval.every` = e > 0, at step 0 (the policy before any update: its
own metrics.jsonl record, `{"step": 0, "eval/...": ...}`), at every step divisible by e and after
the last step; those figures are merged into that step's record. An evaluation at step s sees
the weights after s updates (it runs after the step's weight sync) and its time is not part of
the step's `time_s`.

What: the held-out prompts (`megarl.data.split`; the first `eval.max_prompts`) are split over the
DP ranks in contiguous blocks and generated like a training step's (the run's rollout: each
prompt once, seeds from its position in the held-out list and a base seed fixed for the run, so
the samples do not depend on the DP size), `eval.n` samples each, greedy at
`eval.temperature` 0, at most `eval.max_tokens` tokens. They are scored by the run's reward
functions. Figures (all means over the held-out set, reduced over DP as one process holding
every prompt would compute them; `megarl.metrics.reduce`):
- `eval/<function>`: each reward function's mean value (samples it applies to);
  `eval/reward_mean` the weighted total, as `reward_mean` for training samples;
- `eval/pass@k`: a sample passes when `eval.pass_reward`'s value (default the first reward
  function) is >= `eval.pass_threshold` (default 1.0); for a prompt with c passes among n
  samples, pass@k is the unbiased estimator of Chen et al. (2021), 1 - C(n - c, k) / C(n, k),
  the chance that k samples drawn from the n hold a pass; averaged over prompts. With n = 1 and
  greedy decoding pass@1 is the accuracy of the greedy answer;
- `eval/response_len` (tokens), `eval/truncated` (fraction that hit max_tokens),
  `eval/prompts`, `eval/reward_errors` (failures scored 0 under `reward.on_error: zero`),
  `eval/time_s` (slowest DP rank).
The first `eval.samples_logged` prompts' samples go to `RUN/eval_samples.jsonl`, gathered to
global rank 0 from one rank per DP rank.

`megarl eval` (`megarl.trainer.eval_command`) runs one evaluation of a model without training.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megarl.config import ConfigError, RunConfig
from megarl.data.dataset import PromptDataset
from megarl.distributed.topology import Groups
from megarl.metrics.reduce import LocalMetrics
from megarl.metrics.sinks import EVAL_SAMPLES_FILE
from megarl.rewards.scorer import Scorer
from megarl.rollout import RolloutComponent, trajectory_metrics
from megarl.trainer.samples import gather_rows
from megarl.trainer.seeds import eval_seed

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


log = logging.getLogger("megarl")


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k): the chance that k of n samples, c of which pass, hold a pass
    (Chen et al. 2021, as a stable product)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k(n={n}, c={c}, k={k}); accepted: 0 <= c <= n, 1 <= k <= n")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def check_eval(cfg: RunConfig, arch) -> None:
    """The evaluation's longest sequence fits the model (before any model is built)."""
    ev = cfg.eval
    if not (ev.every or ev.path or ev.fraction):
        return
    tokens = ev.max_tokens or cfg.rollout.sampling.max_tokens
    longest = cfg.data.max_prompt_length + tokens
    limit = cfg.rollout.engine.max_model_len or arch.max_position_embeddings
    if longest > limit:
        what = (
            "rollout.engine.max_model_len"
            if cfg.rollout.engine.max_model_len
            else "the model's max_position_embeddings"
        )
        raise ConfigError(
            f"data.max_prompt_length ({cfg.data.max_prompt_length}) + eval.max_tokens ({tokens}) "
            f"= {longest} exceeds {what} ({limit}); lower eval.max_tokens"
        )


def evaluation_due(step: int, ev, last_step: int) -> bool:
    """The one rule of when a run evaluates (`eval.every` = e): with e > 0, at step 0 (before
    any update), at every step divisible by e and after the last step; e = 0: never. RL runs
    evaluate through the engine (`Evaluator`), offline stages by forward passes."""
    return ev.every > 0 and (step % ev.every == 0 or step == last_step)


@dataclasses.dataclass
class Evaluator:
    """One run's held-out evaluation (module docstring); `evaluate(step)` is collective."""

    cfg: RunConfig
    prompts: PromptDataset
    """The held-out prompts, already cut to `eval.max_prompts`."""
    rollout: RolloutComponent
    tokenizer: PreTrainedTokenizerBase
    scorer: Scorer
    groups: Groups

    def due(self, step: int) -> bool:
        return evaluation_due(step, self.cfg.eval, self.cfg.trainer.steps)

    def evaluate(self, step: int) -> tuple[dict, list[dict]]:
        """(global eval/... figures, eval_samples rows on global rank 0, [] elsewhere)."""
        t0 = time.perf_counter()
        ev, g = self.cfg.eval, self.groups
        total = len(self.prompts)
        mine = range(g.dp_rank * total // g.dp_size, (g.dp_rank + 1) * total // g.dp_size)
        greedy = ev.temperature == 0
        rollout = self.rollout.generate(
            self.prompts.batch(list(mine)),
            list(mine),
            eval_seed(self.cfg.trainer.seed),
            n=ev.n,
            greedy=greedy,
            temperature=None if greedy else ev.temperature,
            max_tokens=ev.max_tokens or self.cfg.rollout.sampling.max_tokens,
        )
        index = [mine.start + i for i in rollout.prompt_index]  # held-out prompt of each sample
        local = LocalMetrics()
        rows = []
        if len(rollout):
            texts = rollout.completions(self.tokenizer)
            prompts = self.prompts.batch(list(mine))
            scores = self.scorer.score(
                prompts,
                rollout,
                texts,
                prefix="eval",
                errors_key="eval/reward_errors",
                model=False,
                penalty=False,
            )
            local.update(scores.metrics)
            local.update(trajectory_metrics(rollout, prefix="eval"))
            passed = self._passes(scores.per_function)
            self._figures(local, index, scores.total, passed, rollout)
            rows = self._rows(index, prompts, texts, scores, passed, rollout)
        else:  # a DP rank without held-out prompts: zeros, the same keys
            local.add_sum("eval/reward_errors", 0)
            for name in self.scorer.names():
                local.add_ratio(f"eval/{name}", 0.0, 0)
            self._figures(local, [], torch.zeros(0), torch.zeros(0), rollout)
        local.add_max("eval/time_s", time.perf_counter() - t0)
        out = local.reduce(g.dp)
        cp_rank = dist.get_rank(g.cp) if g.cp is not None else 0
        first = g.tp_rank == 0 and g.pp_rank == 0 and cp_rank == 0
        rows = gather_rows(rows if first else None)
        return out, rows

    # ------------------------------------------------------------------ helpers
    def _passes(self, per_fn: dict) -> torch.Tensor:
        fns = self.cfg.reward.functions
        which = 0 if self.cfg.eval.pass_reward is None else fns.index(self.cfg.eval.pass_reward)
        values = list(per_fn.values())[which]
        return (values >= self.cfg.eval.pass_threshold).double()  # NaN (not applicable): fails

    def _figures(self, local, index, totals, passed, rollout) -> None:
        ev = self.cfg.eval
        local.add_ratio("eval/reward_mean", totals.double().sum(), len(totals))
        lengths = [len(r) for r in rollout.response_ids]
        local.add_ratio("eval/response_len", sum(lengths), len(lengths))
        cut = sum(f == "length" for f in rollout.finish_reason)
        local.add_ratio("eval/truncated", cut, len(lengths))
        passes: dict[int, int] = {}
        for p, ok in zip(index, passed.tolist(), strict=True):
            passes[p] = passes.get(p, 0) + int(ok)
        for k in ev.ks:
            est = sum(pass_at_k(ev.n, c, k) for c in passes.values())
            local.add_ratio(f"eval/pass@{k}", est, len(passes))
        local.add_sum("eval/prompts", len(passes))

    def _rows(self, index, prompts, texts, scores, passed, rollout) -> list[dict]:
        keep = self.cfg.eval.samples_logged
        seen: dict[int, int] = {}
        rows = []
        for j, p in enumerate(index):
            k = seen[p] = seen.get(p, -1) + 1
            if keep is not None and p >= keep:
                continue
            rows.append(
                {
                    "index": p,
                    "sample": k,
                    "prompt": prompts.prompts[rollout.prompt_index[j]],
                    "completion": texts[j],
                    "rewards": {name: float(v[j]) for name, v in scores.per_function.items()},
                    "reward": float(scores.total[j]),
                    "passed": bool(passed[j]),
                    "length": len(rollout.response_ids[j]),
                    "finish_reason": rollout.finish_reason[j],
                    **rollout.conversation(j),
                }
            )
        return rows


def _display_order(key: str) -> tuple[int, str]:
    """pass@k, then reward_mean, the functions, then length and truncation."""
    if key.startswith("eval/pass@"):
        return 0, key
    if key == "eval/reward_mean":
        return 1, key
    return (3 if key in ("eval/response_len", "eval/truncated") else 2), key


def summary(head: str, metrics: dict, ev) -> str:
    """`<head>: 24 prompts x 1 (greedy): pass@1 0.417 | reward_mean 0.702 | ... | 1.3 s`."""
    how = "greedy" if ev.temperature == 0 else f"T={ev.temperature:g}"
    skip = ("eval/prompts", "eval/time_s", "eval/reward_errors")
    keys = sorted(
        (k for k in metrics if k.startswith("eval/") and k not in skip), key=_display_order
    )
    figures = " | ".join(f"{k.removeprefix('eval/')} {metrics[k]:.3f}" for k in keys)
    return (
        f"{head}: {int(metrics.get('eval/prompts', 0))} prompts x {ev.n} ({how}): {figures} | "
        f"{metrics.get('eval/time_s', 0.0):.1f} s"
    )


def evaluate(run) -> dict:
    """The eval/... figures when an evaluation is due at `run.step` ({} otherwise); writes its
    samples to eval_samples.jsonl. Collective."""
    ev = run.evaluator
    if ev is None or not ev.due(run.step):
        return {}
    metrics, rows = ev.evaluate(run.step)
    run.logger.log_samples(run.step, rows, file=EVAL_SAMPLES_FILE)
    if dist.get_rank() == 0:
        log.info(summary(f"eval at step {run.step}", metrics, run.cfg.eval))
    return metrics
