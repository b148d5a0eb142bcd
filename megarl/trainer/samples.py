"""A few of each step's samples, for people to read: `RUN/samples.jsonl` (and a wandb table).

Which: `logging.samples_per_step` = m samples of the whole step (all DP ranks): the best and the
worst by total reward, then the m - 2 others of lowest priority, where a sample's priority is a
hash of (trainer seed, step, its global prompt id, its response tokens): a seeded pick that does
not depend on which rank holds the sample (nor on `algorithm.balance_dp_tokens`). Ties in reward
go to the lower priority.

How, cheaply: on every DP rank one rank of the last pipeline stage (it holds the advantages)
makes its own best, worst and m lowest-priority samples into rows (the global choice lies within
the union of these), and only those rows travel to global rank 0 (`gather_rows`, one object
gather of at most m + 2 small dicts per DP rank), which makes the final pick. The per-function
reward values, the total reward and the advantage are the ones the step computed and the update
used (no reward function is called again: it may be costly, random, or have side effects).

A row: step, pick (best / worst / random), prompt_id (row of the training prompts), prompt (the
prompt column's value), completion (decoded, special tokens skipped), rewards {function: value},
reward (weighted total), advantage (mean over the response tokens: GRPO's per-sample value, PPO's
mean GAE), length (response tokens) and finish_reason (stop / length; multi-turn also max_turns /
env_error). A multi-turn sample's completion is its last assistant turn, and its row also holds
the whole conversation, the turns' rewards and the environment's (`Samples.conversation`).
"""

from __future__ import annotations

import hashlib
import math

import torch.distributed as dist

from megarl.trainer.experience import Scored, StepBatch


def gather_rows(rows: list[dict] | None) -> list[dict]:
    """Concatenate every rank's `rows` (None: this rank sends nothing) on global rank 0, in
    rank order; [] on the other ranks. Collective over the world; the rows must be small."""
    if dist.get_world_size() == 1:
        return list(rows or [])
    parts: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(rows, parts, dst=0)
    return [r for p in parts or [] if p for r in p]


def priority(seed: int, step: int, prompt_id: int, response_ids: list[int]) -> int:
    """A 64-bit pseudo-random rank of a sample that depends only on what it is."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{seed}/{step}/{prompt_id}/".encode())
    h.update(",".join(map(str, response_ids)).encode())
    return int.from_bytes(h.digest(), "little")


def candidates(rewards: list[float], prios: list[int], m: int) -> list[int]:
    """Indices a rank offers for a pick of `m`: its best, its worst and its m lowest-priority
    samples (each once)."""
    if m == 0 or not rewards:
        return []
    idx = range(len(rewards))
    best = max(idx, key=lambda i: (rewards[i], -prios[i]))
    worst = min(idx, key=lambda i: (rewards[i], prios[i]))
    low = sorted(idx, key=lambda i: prios[i])[:m]
    return list(dict.fromkeys([best, worst, *low]))


def pick(rows: list[dict], m: int) -> list[dict]:
    """The final choice among the offered rows (each with `reward` and `_priority`): best,
    worst, then lowest priority, m in all; the chosen rows get their `pick` label."""
    if m == 0 or not rows:
        return []
    best = max(rows, key=lambda r: (r["reward"], -r["_priority"]))
    worst = min(rows, key=lambda r: (r["reward"], r["_priority"]))
    chosen = [(best, "best")]
    if m >= 2 and worst is not best:
        chosen.append((worst, "worst"))
    others = (r for r in rows if r is not best and r is not worst)
    rest = sorted(others, key=lambda r: r["_priority"])
    chosen += [(r, "random") for r in rest[: m - len(chosen)]]
    out = []
    for r, label in chosen:
        row = {"pick": label, **{k: v for k, v in r.items() if k != "_priority"}}
        out.append(row)
    return out


def step_samples(run, rollout, scored: Scored, batch: StepBatch) -> list:
    """This step's picked rows on global rank 0 ([] elsewhere, and when
    `logging.samples_per_step` is 0): the samples of `rollout`, their rewards and prompt ids
    from `scored`, their advantages from `batch`. Collective over the world."""
    m = run.cfg.logging.samples_per_step
    if m == 0:
        return []
    g = run.groups
    rows = None
    cp_rank = dist.get_rank(g.cp) if g.cp is not None else 0
    if g.is_last_stage and g.tp_rank == 0 and cp_rank == 0:
        # a group id is its dataset row, + k x rows for a row drawn again within the step
        # (`megarl.trainer.dynamic_sampling.round_group_ids`)
        ids = [int(i) % run.data.sampler.num_rows for i in scored.group_ids]
        prios = [
            priority(run.cfg.trainer.seed, run.step, p, r)
            for p, r in zip(ids, rollout.response_ids, strict=True)
        ]
        totals = scored.rewards.double().tolist()
        chosen = candidates(totals, prios, m)
        mask = batch.loss_mask[chosen].double()
        adv = (batch.advantages[chosen].double() * mask).sum(1) / mask.sum(1).clamp(min=1)
        prompts = run.data.dataset.batch([ids[i] for i in chosen])
        responses = [rollout.response_ids[i] for i in chosen]
        texts = rollout.take(chosen).completions(run.tokenizer)
        rows = []
        for j, i in enumerate(chosen):
            rows.append(
                {
                    "_priority": prios[i],
                    "prompt_id": ids[i],
                    "prompt": prompts.prompts[j],
                    "completion": texts[j],
                    "rewards": {k: _value(v[i]) for k, v in scored.per_function.items()},
                    "reward": totals[i],
                    "advantage": float(adv[j]),
                    "length": len(responses[j]),
                    "finish_reason": rollout.finish_reason[i],
                    **rollout.conversation(i),
                }
            )
    return pick(gather_rows(rows), m)


def _value(x) -> float | None:
    """A reward function's value of one sample; None where it does not apply (NaN)."""
    x = float(x)
    return None if math.isnan(x) else x
