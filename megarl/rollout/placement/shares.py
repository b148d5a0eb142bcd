"""The one split and merge of a step's prompts over engines, for both placements: prompts are
cut into contiguous chunks, one per engine (`contiguous`), each engine's samples go back to the
DP rank that owns their prompt (`route`), and each DP rank's samples are put in prompt order
(`in_prompt_order`). Seeds do not depend on the split: each prompt's position in the step's
global batch fixes its seed (`megarl.rollout.seeds`).
"""

from __future__ import annotations

from megarl.rollout.samples import Samples


def contiguous(count: int, parts: int, k: int) -> range:
    """Part `k` of `count` items cut into `parts` contiguous chunks (sizes differ by at most
    one)."""
    return range(k * count // parts, (k + 1) * count // parts)


def route(samples: Samples, owners: list[tuple[int, int]]) -> dict[int, Samples]:
    """An engine's `samples` by the DP rank that owns their prompts: `owners[i]` is (DP rank,
    index among its prompts) of the engine's prompt i; each DP rank's samples keep their order,
    `prompt_index` then indexing that DP rank's prompts."""
    rows: dict[int, list[int]] = {}
    for k, i in enumerate(samples.prompt_index):
        rows.setdefault(owners[i][0], []).append(k)
    return {
        dp: samples.take(ks, [owners[samples.prompt_index[k]][1] for k in ks])
        for dp, ks in rows.items()
    }


def in_prompt_order(parts: list[Samples], num_prompts: int) -> Samples:
    """One DP rank's samples from every engine's `route`d part, in prompt order (prompt-major,
    each prompt's n samples in order); every one of its `num_prompts` prompts must be there."""
    whole = Samples.concat(parts)
    order = sorted(range(len(whole)), key=lambda k: whole.prompt_index[k])  # stable: n in order
    merged = whole.take(order)
    if sorted(set(merged.prompt_index)) != list(range(num_prompts)):
        missing = sorted(set(range(num_prompts)) - set(merged.prompt_index))
        raise RuntimeError(f"the rollout lost prompts {missing[:8]} of this DP rank")
    return merged
