"""Benchmark suite `multi_turn`: what trajectories of several turns cost against one turn of the
same number of sampled tokens.

The workload is examples/grpo_smollm2_retry_cpu.yaml's rollout: SmolLM2-135M-Instruct (fetched
and cached like the peer suite's, its weights loaded into the engine once), the first `PROMPTS`
prompts of examples/data/smollm2_arith_train.jsonl x `N` samples at temperature 1, the `retry`
environment with at most `MAX_TURNS` turns of at most `MAX_TOKENS` tokens, through the real
multi-turn rollout (`ColocatedRollout` with trajectories, one rank, fp32).

The floor: the same trajectories' prompts generated once each by vLLM alone (`LLM.generate`,
one call) with each sample's `max_tokens` set to the tokens its trajectory sampled, stop tokens
off, so both sides sample the same number of tokens from the same prompts; the multi-turn side
also prefills every observation and waits for the waves. The prefix cache is emptied before every
call (the multi-turn side keeps its own turns cached within a call, which is its design). Calls
alternate; medians of `repeats`.

Figures: `multi_turn_sampled_tokens_per_s` (waves, `env.scheduler: waves`) with the one-turn
rate as its floor (overhead_pct = 100 x (multi-turn time / one-turn time - 1), the goal is under
20%), `multi_turn_turns_per_s`, and `multi_turn_stream_sampled_tokens_per_s`: the same
trajectories scheduled by continuous batching (`env.scheduler: stream`), against the same floor
(stream_overhead_pct compares rates, since its trajectories may sample other tokens than the
waves'; stream_same_trajectories counts those identical to the waves').
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time

import torch
from safetensors import safe_open

from megarl.benchmarks import peer_smollm2, record, register_suite
from megarl.convert.fetch import fetch_gguf
from megarl.convert.gguf import cached_hf_dir
from megarl.data.dataset import PromptBatch
from megarl.distributed.launch import spawn
from megarl.envs.config import EnvConfig
from megarl.models.hf_config import arch_from_hf
from megarl.rollout.config import EngineConfig, SamplingConfig
from megarl.rollout.engine.engine import RolloutEngine
from megarl.rollout.engine.stop_tokens import resolve_stop_tokens
from megarl.rollout.placement.colocated import ColocatedRollout
from megarl.rollout.placement.dispatch import RolloutDispatcher
from megarl.rollout.placement.worker import RolloutWorker, load_trajectories

PROMPTS, N, MAX_TURNS, MAX_TOKENS, SEED = 16, 4, 3, 48, 0
QUICK_PROMPTS = 4


def _hf_tensors(model_dir: str):
    """(name, tensor) of every safetensors file of an HF directory."""
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, name), "pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open has keys(), no __iter__
                    yield key, f.get_tensor(key)


def _worker(rank: int, world: int, model_dir: str, train: str, prompts: int, repeats: int):
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    tok = AutoTokenizer.from_pretrained(model_dir)
    with open(os.path.join(model_dir, "config.json")) as f:
        hf = json.load(f)
    arch = arch_from_hf(hf)
    stop = resolve_stop_tokens(None, tok, hf, [model_dir])
    cfg = SamplingConfig(n=N, max_tokens=MAX_TOKENS, stop_token_ids=stop, temperature=1.0)
    engine_cfg = EngineConfig(max_model_len=256, kv_cache_memory_bytes=768 * 2**20)
    engine = RolloutEngine(model_dir, arch, cfg, engine_cfg)
    engine.weights.load_hf(_hf_tensors(model_dir))  # the engine starts from dummy weights
    env = EnvConfig(name="retry", max_turns=MAX_TURNS, max_tokens=192)
    setup = load_trajectories(env, tok)
    dispatcher = RolloutDispatcher(1, 0)
    mt = ColocatedRollout(RolloutWorker(engine, setup, env), None, dispatcher)
    stream_env = dataclasses.replace(env, scheduler="stream")
    stream_worker = RolloutWorker(engine, load_trajectories(stream_env, tok), stream_env)
    streamed = ColocatedRollout(stream_worker, None, dispatcher)
    with open(train) as f:
        rows = [json.loads(line) for line in f if line.strip()][:prompts]
    texts = [r["prompt"] for r in rows]
    ids = [setup.fmt.prompt_ids([{"role": "user", "content": t}]) for t in texts]
    batch = PromptBatch(
        indices=list(range(prompts)), prompt_ids=ids, prompts=texts,
        columns={"answer": [r["answer"] for r in rows]},
    )  # fmt: skip

    def multi_turn():
        return mt.generate(batch, list(range(prompts)), SEED)

    def stream():
        return streamed.generate(batch, list(range(prompts)), SEED)

    ro = multi_turn()  # warm-up; the trajectories are the same at every call (seeded)
    sampled = [sum(m) for m in ro.response_mask]
    turns = sum(r.turns for r in ro.turns.records)
    one_turn_inputs = [{"prompt_token_ids": ro.prompt_ids[j]} for j in range(len(ro))]
    one_turn_params = [
        SamplingParams(
            max_tokens=k,
            temperature=1.0,
            seed=j,
            ignore_eos=True,
            logprobs=0,
            detokenize=False,
            flat_logprobs=True,
        )  # fmt: skip
        for j, k in enumerate(sampled)
    ]

    def one_turn():
        return engine.llm.generate(one_turn_inputs, one_turn_params, use_tqdm=False)

    one_turn()
    stream_ro = stream()
    times: dict[str, list[float]] = {"multi_turn": [], "stream": [], "one_turn": []}
    for _ in range(repeats):
        for name, fn in (("multi_turn", multi_turn), ("stream", stream), ("one_turn", one_turn)):
            engine.reset_prefix_cache()
            t0 = time.perf_counter()
            out = fn()
            times[name].append(time.perf_counter() - t0)
            if name == "multi_turn" and [sum(m) for m in out.response_mask] != sampled:
                raise RuntimeError("the multi-turn rollout is not reproducible at a fixed seed")
    engine.close()
    return {
        "times": times,
        "sampled_tokens": sum(sampled),
        "turns": turns,
        "trajectories": len(ro),
        "waves": list(mt.worker.runner.last_waves),
        "stream_sampled_tokens": sum(sum(m) for m in stream_ro.response_mask),
        "stream_same_ids": sum(
            a == b for a, b in zip(stream_ro.response_ids, ro.response_ids, strict=True)
        ),
        "observation_tokens": sum(len(m) - sum(m) for m in ro.response_mask),
        "threads": torch.get_num_threads(),
    }


@register_suite("multi_turn")
def suite(args) -> list[dict]:
    quick = bool(getattr(args, "quick", False))
    prompts, repeats = (QUICK_PROMPTS, 1) if quick else (PROMPTS, 3)
    if not os.path.isfile(peer_smollm2.TRAIN):
        raise peer_smollm2.WorkloadError(
            f"{peer_smollm2.TRAIN} is missing: the multi_turn suite reads the example's prompts "
            "from a checkout of the repository"
        )
    model_dir = cached_hf_dir(fetch_gguf(peer_smollm2.MODEL_NAME))
    res = spawn(_worker, 1, model_dir, peer_smollm2.TRAIN, prompts, repeats, timeout=3600)[0]
    mt = statistics.median(res["times"]["multi_turn"])
    one = statistics.median(res["times"]["one_turn"])
    st = statistics.median(res["times"]["stream"])
    tokens, st_tokens = res["sampled_tokens"], res["stream_sampled_tokens"]
    params = dict(
        model="SmolLM2-135M-Instruct fp32",
        prompts=prompts,
        n=N,
        max_turns=MAX_TURNS,
        max_tokens_per_turn=MAX_TOKENS,
        trajectories=res["trajectories"],
        turns=res["turns"],
        waves=res["waves"],
        sampled_tokens=tokens,
        observation_tokens=res["observation_tokens"],
        repeats=repeats,
        threads=res["threads"],
        multi_turn_s=mt,
        one_turn_s=one,
        overhead_pct=100 * (mt / one - 1),
        stream_s=st,
        stream_sampled_tokens=st_tokens,
        stream_same_trajectories=res["stream_same_ids"],
        stream_overhead_pct=100 * ((st / st_tokens) / (one / tokens) - 1),
        all_multi_turn_s=res["times"]["multi_turn"],
        all_stream_s=res["times"]["stream"],
        all_one_turn_s=res["times"]["one_turn"],
    )
    return [
        record("multi_turn_sampled_tokens_per_s", tokens / mt, "tokens/s", floor=tokens / one,
               **params),
        record("multi_turn_turns_per_s", res["turns"] / mt, "turns/s", **params),
        record("multi_turn_stream_sampled_tokens_per_s", st_tokens / st, "tokens/s",
               floor=tokens / one, **params),
    ]  # fmt: skip
