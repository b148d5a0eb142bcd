"""The one scorer of a run's samples, for training steps and held-out evaluation alike.

`Scorer` holds the loaded `reward.functions` (with their `reward.kwargs`), their weights, the
reward model of `reward.model` and the judge of `reward.judge` when the run scores with them,
and `reward.truncated_penalty`.
`Scorer.score(prompts, rollout, completions)` returns `Scores`: the weighted total per sample,
each function's value per sample (NaN where it does not apply; the reward model's raw score as
"rm", the judge's as "judge", a multi-turn environment's reward as "env") and the per-function
means as `LocalMetrics` under a prefix (`reward/...` in training, `eval/...` in evaluation).
Evaluation scores with the functions (and a multi-turn environment) alone (`model=False,
penalty=False`: no reward model, no judge): its figures are their view of the policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megarl.metrics.reduce import LocalMetrics
from megarl.rewards.config import RewardConfig
from megarl.rewards.judge import Judge, Verdicts
from megarl.rewards.scoring import (
    RewardFunctionError,
    function_name,
    load_reward_function,
    score,
)


def load_functions(cfg: RewardConfig) -> list:
    """The functions of `reward.functions`, in order, each with its `reward.kwargs`; an error
    names the entry (`reward.functions[i]`)."""
    fns = []
    for i, spec in enumerate(cfg.functions):
        try:
            fns.append(load_reward_function(spec, **cfg.kwargs.get(spec, {})))
        except RewardFunctionError as e:
            raise RewardFunctionError(f"reward.functions[{i}]: {e}") from e
    return fns


@dataclass
class Scores:
    """What scoring one batch of samples gives (B samples)."""

    total: torch.Tensor
    """[B] the reward each sample trains on (or is evaluated by)."""
    per_function: dict[str, torch.Tensor]
    """{function name: [B]} each function's value, NaN where it does not apply; "rm": the
    reward model's raw score."""
    metrics: LocalMetrics
    """`<prefix>/<function>` means over the samples each applies to, `<prefix>/rm`,
    `<prefix>/rm_normalized`, `<prefix>/judge`, `<prefix>/truncated`, and the counts of failed
    calls, of judge answers without a score and of judge answers cut by the time limit."""
    verdicts: Verdicts | None = None
    """The judge's prompts, answers and scores (with a judge)."""


class Scorer:
    """Scores samples with the run's reward functions (and reward model); see the module."""

    def __init__(
        self,
        functions: list,
        cfg: RewardConfig,
        reward_model=None,
        tokenizer=None,
        judge: Judge | None = None,
    ):
        """functions: loaded (`load_functions`); reward_model: a `megarl.rewards.model.
        RewardModel` (collective over the model-parallel group and DP) or None; tokenizer: the
        policy's (decodes completions for a reward model that reads text); judge: the judge of
        `reward.judge` (this rank's engine) or None."""
        self.functions = functions
        self.cfg = cfg
        self.reward_model = reward_model
        self.tokenizer = tokenizer
        self.judge = judge

    def names(self) -> list[str]:
        """The functions' metric names, in order (a repeated name gets `_<index>`, as `score`)."""
        names: list[str] = []
        for i, fn in enumerate(self.functions):
            name = function_name(fn)
            names.append(name if name not in names else f"{name}_{i}")
        return names

    def score(
        self,
        prompts,
        rollout,
        completions: list[str],
        *,
        prefix: str = "reward",
        errors_key: str = "reward_errors",
        model: bool = True,
        penalty: bool = True,
    ) -> Scores:
        """Scores of `rollout`'s samples (B), whose prompts are the rows `rollout.prompt_index`
        of `prompts` (a `PromptBatch`); `completions`: the decoded responses. `model` /
        `penalty`: add the reward model's and the judge's weighted scores / subtract the
        truncation penalty."""
        rc, idx = self.cfg, rollout.prompt_index
        columns = {k: [v[i] for i in idx] for k, v in prompts.columns.items()}
        # multi-turn: reward functions also get the conversation
        records = rollout.turns.records if rollout.turns is not None else None
        if records is not None:
            columns["conversation"] = [r.messages for r in records]
        total, per_fn, errors = score(
            self.functions,
            rc.weights,
            [prompts.prompts[i] for i in idx],
            completions,
            rollout.response_ids,
            columns,
            on_error=rc.on_error,
        )
        metrics = LocalMetrics()
        for k, v in per_fn.items():
            ok = ~torch.isnan(v)
            metrics.add_ratio(f"{prefix}/{k}", v[ok].double().sum(), ok.sum())
        metrics.add_sum(errors_key, errors)
        if model and self.reward_model is not None:  # collective over model-parallel and DP
            rm = self.reward_model
            raw = rm.score(rm.sequences(prompts, rollout, self.tokenizer))
            used = rm.reward(raw)
            metrics.add_ratio(f"{prefix}/rm", raw.double().sum(), len(raw))
            per_fn["rm"] = raw
            if used is not raw:
                metrics.add_ratio(f"{prefix}/rm_normalized", used.double().sum(), len(used))
            total = total + rc.model_weight * used
        verdicts = None
        if model and self.judge is not None:
            plain = {k: v for k, v in columns.items() if k != "conversation"}
            verdicts = self.judge.judge(
                [prompts.prompts[i] for i in idx], completions, plain, columns.get("conversation")
            )
            per_fn["judge"] = verdicts.scores
            metrics.add_ratio(f"{prefix}/judge", verdicts.scores.double().sum(), len(idx))
            metrics.add_sum(f"{prefix}/judge_parse_failures", (~verdicts.parsed).sum())
            metrics.add_sum(f"{prefix}/judge_timeouts", verdicts.timed_out.sum())
            total = total + rc.judge.weight * verdicts.scores.to(total.dtype)
        if records is not None:
            env = torch.tensor(
                [math.nan if r.env_reward is None else r.env_reward for r in records],
                dtype=total.dtype,
            )
            ok = ~torch.isnan(env)
            metrics.add_ratio(f"{prefix}/env", env[ok].double().sum(), ok.sum())
            per_fn["env"] = env
            total = total + rc.env_weight * torch.nan_to_num(env)
        if penalty and rc.truncated_penalty:
            cut = torch.tensor([r == "length" for r in rollout.finish_reason], dtype=total.dtype)
            total = total - rc.truncated_penalty * cut
            metrics.add_ratio(f"{prefix}/truncated", cut.double().sum(), len(cut))
        if records is not None:  # an environment that failed: the trajectory scores 0
            failed = torch.tensor([r.finish_reason == "env_error" for r in records])
            total = torch.where(failed, torch.zeros_like(total), total)
        return Scores(total, per_fn, metrics, verdicts)
