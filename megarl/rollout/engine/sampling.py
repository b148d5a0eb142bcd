"""A generate call's requests and results: each prompt's vLLM `SamplingParams` (seeds from
`megarl.rollout.seeds`), the checks of the prompts against the engine, and the samples read
back from vLLM's outputs.

Logprobs are vLLM's `processed_logprobs`: the log-probabilities of the distribution each token
was sampled from (after temperature and top-k / top-p truncation, renormalised over the kept
tokens). The trainer scores the same temperature over the whole vocabulary, so the two agree up
to numerics at top_p = 1 and top_k = -1; with truncation the sampler's value is larger by
-log(kept mass). A sample stops at `max_tokens` or at a token of `stop_token_ids` (kept).
"""

from __future__ import annotations

from megarl.rollout.config import SamplingConfig
from megarl.rollout.seeds import sample_seed


def sampling_params(cfg: SamplingConfig, n: int, seed: int, max_tokens: int, greedy: bool,
                    temperature: float):  # fmt: skip
    """One request's vLLM `SamplingParams`: n samples, sample k seeded `seed + k`."""
    from vllm import SamplingParams

    return SamplingParams(
        n=n,
        temperature=0.0 if greedy else temperature,
        top_p=1.0 if greedy else cfg.top_p,
        top_k=0 if greedy or cfg.top_k == -1 else cfg.top_k,
        max_tokens=max_tokens,
        stop_token_ids=list(cfg.stop_token_ids or ()),
        ignore_eos=True,  # stop exactly at `stop_token_ids` (EOS included by default)
        seed=seed % 2**32,
        logprobs=0,
        flat_logprobs=True,
        detokenize=False,
    )


def request_params(
    cfg: SamplingConfig,
    prompts,
    base: int,
    *,
    max_model_len: int,
    vocab: int,
    n=None,
    greedy=False,
    positions=None,
    max_tokens=None,
    temperature=None,
    seeds=None,
) -> list:
    """Each prompt's `SamplingParams` for a generate call with base seed `base` and these
    overrides of `cfg` (validated; `RolloutEngine.generate` says what each means)."""
    n = cfg.n if n is None else n
    if n < 1:
        raise ValueError(f"generate(n={n}); accepted: n >= 1")
    max_tokens = cfg.max_tokens if max_tokens is None else max_tokens
    limits = list(max_tokens) if isinstance(max_tokens, list | tuple) else None
    if limits is not None and len(limits) != len(prompts):
        raise ValueError(f"generate: {len(limits)} max_tokens for {len(prompts)} prompts")
    limits = limits or [max_tokens] * len(prompts)
    max_tokens = min(limits, default=1)
    temperature = cfg.temperature if temperature is None else temperature
    if max_tokens < 1 or not 0 < temperature <= 2:
        raise ValueError(
            f"generate(max_tokens={max_tokens}, temperature={temperature}); accepted: "
            "max_tokens >= 1, 0 < temperature <= 2 (greedy=True for argmax)"
        )
    check_prompts(prompts, limits, max_model_len=max_model_len, vocab=vocab)
    if base < 0:
        raise ValueError(f"generate(seed={base}); accepted: seed >= 0")
    positions = list(range(len(prompts))) if positions is None else list(positions)
    if len(positions) != len(prompts):
        raise ValueError(f"generate: {len(positions)} positions for {len(prompts)} prompts")
    if seeds is None:
        seeds = [sample_seed(base, pos * n) for pos in positions]
    elif len(seeds) != len(prompts):
        raise ValueError(f"generate: {len(seeds)} seeds for {len(prompts)} prompts")
    return [
        sampling_params(cfg, n, request_seed, limit, greedy, temperature)
        for request_seed, limit in zip(seeds, limits, strict=True)
    ]


def check_prompts(prompts, max_tokens: list[int], *, max_model_len: int, vocab: int) -> None:
    """Token-id prompts the engine can take, each with room for its `max_tokens`."""
    if not isinstance(prompts, list | tuple) or not prompts:
        raise ValueError("generate(prompts): expected a non-empty list of token-id lists")
    for i, p in enumerate(prompts):
        limit = max_model_len - max_tokens[i]
        if not len(p):
            raise ValueError(f"prompt {i} is empty")
        if min(p) < 0 or max(p) >= vocab:
            bad = max(p) if max(p) >= vocab else min(p)
            raise ValueError(f"prompt {i} holds token id {bad} outside [0, vocab_size={vocab})")
        if len(p) > limit:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens; with max_tokens={max_tokens[i]} the "
                f"engine's max_model_len={max_model_len} allows at most {limit}"
            )


def completions(out, which, vocab: int) -> list[tuple[list[int], list[float], str]]:
    """(ids, logprobs, finish reason) of each sample of one vLLM `RequestOutput`."""
    res = []
    for c in sorted(out.outputs, key=lambda c: c.index):
        ids = list(c.token_ids)
        lps = c.logprobs
        if lps is None or len(lps.logprobs) != len(ids) or lps.token_ids != ids:
            raise RuntimeError(f"vLLM returned no per-token logprob for prompt {which}")
        if ids and max(ids) >= vocab:  # vLLM cuts logits to the real vocabulary
            raise RuntimeError(f"vLLM sampled id {max(ids)} >= vocab_size {vocab}")
        res.append((ids, list(lps.logprobs), c.finish_reason))
    return res
