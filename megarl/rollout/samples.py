"""The samples a rollout returns: one record, one entry per sample, prompt-major (prompt i's n
samples are contiguous).

Every sample has its prompt, its response, the sampler's logprob of each response token and why
it ended. What only some rollouts have comes in groups, one per feature, None when the feature
is off and otherwise one entry per sample: `routed_experts` (MoE routing replay), `turns`
(multi-turn trajectories) and `versions` (the policy version of each token). Plain data:
nothing here imports torch or vLLM.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class Turns:
    """Multi-turn samples (`env.name` / `env.agent`)."""

    mask: list[list[int]]
    """Per sample, 1 on each response token the policy sampled and 0 on the tokens the
    environment appended (their logprob is 0)."""
    records: list
    """Per sample, its `megarl.rollout.multi_turn.trajectory.TrajectoryRecord` (conversation,
    turns, tool calls, environment rewards and errors)."""


@dataclass
class Versions:
    """Which policy generated each token (the engines' weight updates, counted)."""

    tokens: list[list[int]]
    """Per sample, the version that sampled each response token (an environment's token: the
    version of the turn before it)."""
    staleness: list[int] | None = None
    """Per sample, how many policy updates the weights of its oldest token are behind the policy
    that trains on it (`rollout.placement.max_staleness`); set by the placement that hands the
    samples to the trainer, None before."""


@dataclass
class Samples:
    """A rollout's samples (module docstring). After `megarl.trainer.balance.balance_over_dp`:
    the balanced order, and `prompt_index` the samples' global prompt ids."""

    prompt_index: list[int]
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    response_logprobs: list[list[float]]
    """The sampler's logprob of each response token, of the distribution it was sampled from
    (after temperature, top-k and top-p: `megarl.rollout.engine.engine`)."""
    finish_reason: list[str]
    """"stop" (a stop token was generated) or "length" (max_tokens reached); multi-turn: the
    trajectory's (`megarl.rollout.multi_turn.trajectory.FINISH_REASONS`)."""
    routed_experts: list | None = None
    """Routing replay: per sample, the experts vLLM routed each token to, an array
    [len(prompt) + len(response) - 1, layers, top_k] (the last token is never fed back)."""
    turns: Turns | None = None
    versions: Versions | None = None

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def num_tokens(self) -> int:
        return sum(len(r) for r in self.response_ids)

    @property
    def response_mask(self) -> list[list[int]] | None:
        """Per sample, which response tokens were sampled (None: all of them)."""
        return self.turns.mask if self.turns is not None else None

    def take(self, rows: list[int], prompt_index: list[int] | None = None) -> Samples:
        """The samples at `rows`, in that order (every per-sample field travels with them);
        `prompt_index` replaces theirs when given."""
        out = _take(self, rows)
        if prompt_index is not None:
            out.prompt_index = list(prompt_index)
        return out

    @staticmethod
    def concat(parts: list[Samples]) -> Samples:
        """The samples of `parts` one after the other. A feature's group is kept when every
        non-empty part carries it and dropped when none does."""
        return _concat([p for p in parts if len(p)], Samples)

    @staticmethod
    def empty() -> Samples:
        return Samples([], [], [], [], [])

    def completions(self, tokenizer) -> list[str]:
        """What reward functions score of each sample: a trajectory's last assistant turn, a
        single-turn sample's decoded response (special tokens dropped)."""
        if self.turns is not None:
            return [r.completion for r in self.turns.records]
        return tokenizer.batch_decode(self.response_ids, skip_special_tokens=True)

    def conversation(self, i: int) -> dict:
        """Sample `i`'s trajectory fields in `samples.jsonl` / `eval_samples.jsonl` rows ({}
        for a single-turn sample): the whole conversation with roles, tool calls and results,
        the turns' rewards and the environment's."""
        if self.turns is None:
            return {}
        record = self.turns.records[i]
        out = {
            "conversation": record.messages,
            "turns": record.turns,
            "turn_rewards": record.turn_rewards,
            "env_reward": record.env_reward,
        }
        if record.info:
            out["env_info"] = record.info
        if record.error is not None:
            out["env_error"] = record.error
        return out


def _take(record, rows: list[int]):
    """`record` (Samples or a feature group) with every per-sample list cut to `rows`."""
    out = {}
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        if value is None:
            out[f.name] = None
        elif dataclasses.is_dataclass(value):
            out[f.name] = _take(value, rows)
        else:
            out[f.name] = [value[i] for i in rows]
    return type(record)(**out)


def _concat(parts: list, kind):
    """`parts` (all of type `kind`) one after the other, field by field (module docstring)."""
    out = {}
    for f in dataclasses.fields(kind):
        values = [getattr(p, f.name) for p in parts]
        have = [v is not None for v in values]
        if any(have) and not all(have):
            raise RuntimeError(f"Samples.concat: only some parts carry {f.name}")
        if not any(have):
            out[f.name] = None if f.default is None else []
        elif dataclasses.is_dataclass(values[0]):
            out[f.name] = _concat(values, type(values[0]))
        else:
            out[f.name] = [x for v in values for x in v]
    return kind(**out)


def token_versions(switches: list[tuple[int, int]], length: int) -> list[int]:
    """Each of `length` tokens' version from the (token index, version) switches, oldest first:
    token j has the version of the last switch at or before j."""
    out, it = [], 0
    for j in range(length):
        while it + 1 < len(switches) and switches[it + 1][0] <= j:
            it += 1
        out.append(switches[it][1])
    return out
