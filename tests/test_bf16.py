"""bf16 on CPU as a first-class precision: bf16 parameters and compute, fp32 master
weights and Adam state (megatron's DistributedOptimizer keeps an fp32 shard of every bf16
parameter), fp32 logits / log-softmax for logprobs and losses, and an update that moves the bf16
parameters by what the fp32 master weights moved (rounded to bf16).

The defects that would make bf16 learn slower than its rounding explains, each checked so that a
broken version fails: fp32 masters made from the bf16 weights instead of the fp32 source (they
must equal the source bit for bit, off the bf16 grid), bf16 weights not refreshed from the fp32
masters after a step (they must equal the masters rounded to bf16, bit for bit, after every
step), a weight sync that sends stale or re-rounded values (vLLM must hold the trainer's current
bf16 weights, bit for bit), a bf16 log-softmax (logprobs of bf16 logits must equal fp32
log_softmax of the upcast logits), and a reference model that differs from the initial actor
(same bf16 weights, identical logprobs)."""

from __future__ import annotations

import pytest
import torch

from megarl.distributed.launch import spawn
from tests.test_metrics_global import LENGTHS, PROMPTS, _state
from tests.tiny import TINY_LLAMA


def job(rank: int, world: int, dtype: str = "bf16", adv_scale: float = 1.0) -> dict:
    from megarl.config import RunConfig, build
    from megarl.convert.layout import load_full_state
    from megarl.data.batch import MicroBatching
    from megarl.distributed import Topology
    from megarl.models.builder import build_model, unwrap
    from megarl.models.hf_config import arch_from_hf
    from megarl.models.optim import build_optimizer
    from megarl.trainer import experience as xp
    from megarl.trainer import update

    cfg = build(RunConfig, {
        "model": {"config": TINY_LLAMA},
        "precision": {"dtype": dtype},
        "optim": {"lr": 1e-2},
        "rollout": {"sampling": {"n": 4, "max_tokens": 12}},
        "algorithm": {"micro_batch_size": 4},
    })
    arch = arch_from_hf(TINY_LLAMA)
    groups = Topology.for_model(cfg.parallel, world, arch).initialize(seed=0)
    actor = build_model(arch, cfg.parallel, cfg.precision, role="actor")
    load_full_state(actor, _state(arch))
    opt, sched = build_optimizer(actor, cfg.optim, dtype=dtype, total_steps=2)
    g = torch.Generator().manual_seed(7)
    responses = [torch.randint(3, 200, (n,), generator=g).tolist() for n in LENGTHS]
    batch = xp.build_batch([PROMPTS[i // 4] for i in range(len(LENGTHS))], responses,
                           [[-1.0] * n for n in LENGTHS], pad_id=0, pad_to=1)
    batch.advantages = adv_scale * torch.linspace(-1, 1, len(LENGTHS))[:, None] * batch.loss_mask
    lp = xp.forward_logprobs(actor, batch.fields(), micro=MicroBatching(size=4, pack=True),
                             vocab_size=arch.vocab_size,
                             groups=groups, temperature=1.0)
    batch.old_logprobs = lp
    model = unwrap(actor[0])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    inner = getattr(opt, "chained_optimizers", [opt])  # megatron chains dense / expert ones
    masters = [p for o in inner for grp in o.shard_fp32_from_float16_groups for p in grp]
    metrics = update.train_policy(actor, opt, sched, batch, alg=cfg.algorithm,
                                  sampling=cfg.rollout.sampling, vocab_size=arch.vocab_size,
                                  groups=groups, seed=1).reduce(groups.dp)
    refreshed = dtype == "fp32" or _bf16_copies_equal_masters(inner)
    state_dtypes = {v.dtype for o in inner for s in o.optimizer.state.values()
                    for v in s.values() if torch.is_tensor(v) and v.dim() > 0}
    return {
        "param_dtypes": {str(p.dtype) for p in model.parameters()},
        "master_dtypes": {str(p.dtype) for p in masters},
        "master_count": sum(p.numel() for p in masters),
        "param_count": sum(p.numel() for p in model.parameters()),
        "state_dtypes": {str(d) for d in state_dtypes},
        "logprob_dtype": str(lp.dtype),
        "loss": metrics["loss"],
        "changed": sum(not torch.equal(before[n], p) for n, p in model.named_parameters()),
        # Adam's first step moves every weight with a gradient by ~lr (its sign): the median
        # move of an MLP weight, over the lr
        "move_over_lr": _median_move(before, model) / cfg.optim.lr,
        "overflow_steps": metrics.get("overflow_steps", 0.0),
        "skipped_steps": metrics["skipped_steps"],
        "grad_norm": metrics["grad_norm"],
        "params": len(before),
        "refreshed": refreshed,
    }


def _bf16_copies_equal_masters(inner) -> bool:
    """Every 16-bit model parameter equals its fp32 master (at DP=1 the master shard is the
    whole tensor) rounded to that dtype, bit for bit (megatron's
    `_copy_main_params_to_model_params`)."""
    pairs = [
        (model.detach().view(-1), master)
        for o in inner
        for mg, fg in zip(o.model_float16_groups, o.shard_fp32_from_float16_groups, strict=True)
        for model, master in zip(mg, fg, strict=True)
    ]
    assert pairs and all(m.numel() == f.numel() for m, f in pairs)
    return all(torch.equal(m, f.to(m.dtype)) for m, f in pairs)


def _median_move(before: dict, model) -> float:
    # a linear layer's weight (the embedding's unused rows get no gradient)
    linears = [(n, p) for n, p in model.named_parameters() if "linear_fc1.weight" in n]
    name, p = linears[0]
    return float((p.detach().float() - before[name].float()).abs().median())


def test_bf16_compute_with_fp32_master_weights_and_optimizer_state():
    r = spawn(job, 1, timeout=600)[0]
    assert r["param_dtypes"] == {"torch.bfloat16"}
    assert r["master_dtypes"] == {"torch.float32"}
    assert r["master_count"] == r["param_count"]  # every bf16 parameter has an fp32 master
    assert r["state_dtypes"] == {"torch.float32"}  # Adam moments in fp32
    assert r["logprob_dtype"] == "torch.float32"
    assert torch.isfinite(torch.tensor(r["loss"]))
    assert r["changed"] == r["params"]
    assert 0.9 < r["move_over_lr"] < 1.1
    assert r["refreshed"]  # the bf16 copies are the stepped masters, rounded


def masters_job(rank: int, world: int, hf: str | None = None) -> dict:
    from megarl.config import RunConfig, build
    from megarl.convert.sharded import load_hf_sharded, seeded_init
    from megarl.distributed import Topology
    from megarl.models.builder import build_model, unwrap
    from megarl.models.hf_config import PrecisionConfig, arch_from_hf
    from megarl.models.optim import build_optimizer
    from megarl.trainer.models import full_precision_masters

    model = {"hf": hf} if hf else {"config": TINY_LLAMA}
    cfg = build(RunConfig, {"model": model, "precision": {"dtype": "bf16"}})
    arch = arch_from_hf(TINY_LLAMA)
    Topology.for_model(cfg.parallel, world, arch).initialize(seed=0)

    def load(chunks):  # random init drawn in fp32, or the files; rounded into bf16 chunks
        if hf:
            load_hf_sharded(chunks, arch, hf)
        else:
            seeded_init(chunks, arch, cfg.model.init_seed)

    actor = build_model(arch, cfg.parallel, cfg.precision, role="actor")
    load(actor)
    opt, _ = build_optimizer(actor, cfg.optim, dtype="bf16")
    full_precision_masters(cfg, arch, actor, opt)
    source = build_model(arch, cfg.parallel, PrecisionConfig(dtype="fp32"), role="reference")
    load(source)  # the same values, kept in fp32
    want = {id(p): dict(unwrap(source[0]).named_parameters())[n].detach().view(-1)
            for n, p in unwrap(actor[0]).named_parameters()}
    exact = rounded = True
    elements = off_grid = 0
    for o in getattr(opt, "chained_optimizers", [opt]):
        for mg, fg in zip(o.model_float16_groups, o.shard_fp32_from_float16_groups, strict=True):
            for p, master in zip(mg, fg, strict=True):
                r = o._get_model_param_range_map(p)["param"]  # this DP rank's slice
                src, bf16 = want[id(p)][r.start:r.end], p.detach().view(-1)[r.start:r.end]
                exact &= torch.equal(master, src)
                rounded &= torch.equal(bf16, master.to(torch.bfloat16))
                elements += master.numel()
                off_grid += int((master != bf16.float()).sum())
    return {"exact": exact, "rounded": rounded, "elements": elements, "off_grid": off_grid}


def test_bf16_masters_start_from_the_fp32_source_at_dp2():
    """The fp32 masters hold the source's fp32 values (here the fp32 random init), not the bf16
    parameters widened back: masters sitting on the bf16 grid would hide every update smaller
    than half a bf16 step from the compute weights (`megarl.models.optim.main_param_writer`).
    DP2: each rank's DistributedOptimizer shard is checked against its slice of the source."""
    for r in spawn(masters_job, 2, timeout=600):
        assert r["exact"] and r["rounded"], r
        assert r["elements"] > 0 and r["off_grid"] > 0.9 * r["elements"], r


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_bf16_masters_from_hf_files(tmp_path, dtype):
    """From `model.hf`: fp32 files give masters off the bf16 grid, equal to the files; bf16
    files (the parameters already hold their values) give masters equal to them too."""
    from tests.test_convert_common import make_hf_dir

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    hf = make_hf_dir(TINY_LLAMA, str(tmp_path / "hf"), dtype=torch_dtype)
    r = spawn(masters_job, 1, hf, timeout=600)[0]
    assert r["exact"] and r["rounded"], r
    if dtype == "fp32":
        assert r["off_grid"] > 0.9 * r["elements"], r
    else:
        assert r["off_grid"] == 0, r


def test_fp16_scales_the_loss_so_the_first_step_moves_the_weights():
    """fp16: megatron's optimizer divides the grads by its dynamic loss scale, so the schedule
    must multiply the loss by it (`config.grad_scale_func`); unwired, the grads reach Adam
    2**16 x too small (its epsilon then eats part of the step). The scale starts at 2**16 (not
    megatron's 2**32) so the first RL steps are not spent backing off from overflows."""
    r = spawn(job, 1, "fp16", timeout=600)[0]
    ref = spawn(job, 1, "fp32", timeout=600)[0]
    # the unscaled gradient is the true one: its norm as in fp32 (not 2**-16 of it)
    assert abs(r["grad_norm"] / ref["grad_norm"] - 1) < 0.05, (r["grad_norm"], ref["grad_norm"])
    assert r["param_dtypes"] == {"torch.float16"} and r["master_dtypes"] == {"torch.float32"}
    assert r["overflow_steps"] == 0
    assert torch.isfinite(torch.tensor(r["loss"]))
    assert 0.9 < r["move_over_lr"] < 1.1
    assert r["refreshed"]


def test_an_fp16_loss_scale_overflow_is_a_back_off_not_a_dropped_step():
    """Gradients past fp16's range under the loss scale: megatron's optimizer finds the infs and
    skips its step (the scale backs off); megarl counts an overflow, not a step dropped for a
    non-finite loss (which the divergence watch would count against the run)."""
    r = spawn(job, 1, "fp16", 1e8, timeout=600)[0]
    assert (r["overflow_steps"], r["skipped_steps"], r["changed"]) == (1, 0, 0)
    assert torch.isfinite(torch.tensor(r["loss"]))


def test_half_precision_note_names_the_missing_instructions(monkeypatch):
    """bf16 / fp16 on a CPU that can only emulate them gets a warning that says why and what to
    use instead; a CPU with the instructions (or fp32) gets none."""
    from megarl.distributed import device

    for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        monkeypatch.setattr(torch.cpu, name, lambda: False)
    note = device.cpu_half_precision_note("bf16")
    assert "precision.dtype=bf16" in note and "AVX512-BF16 or AMX" in note
    assert "precision.dtype=fp32" in note
    assert "AMX-FP16" in device.cpu_half_precision_note("fp16")
    assert device.cpu_half_precision_note("fp32") is None
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert device.cpu_half_precision_note("bf16") is None
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert device.cpu_half_precision_note("bf16") is None


def sync_job(rank: int, world: int, dtype: str = "bf16") -> dict:
    """A `dtype` (bf16 / fp16) actor and reference, one vLLM engine of that dtype: the sync
    after an optimizer step, the reference at step 0, and the logprob reduction (one process)."""
    from megarl.config import RunConfig, build
    from megarl.convert.layout import load_full_state
    from megarl.convert.sharded import copy_weights
    from megarl.data.batch import MicroBatching
    from megarl.distributed import Topology
    from megarl.models.builder import build_model
    from megarl.models.hf_config import arch_from_hf
    from megarl.models.optim import build_optimizer
    from megarl.models.vocab import token_logprobs
    from megarl.rollout.config import EngineConfig, SamplingConfig
    from megarl.rollout.engine.engine import RolloutEngine
    from megarl.rollout.sync.colocated import ColocatedWeights, naive_sync
    from megarl.trainer import experience as xp
    from megarl.trainer import update
    from tests.sync_workers import LLAMA, canonical_state, model_dir
    from tests.vllm_targets import compare_bitwise, dense_state, digest, install_capture

    torch.set_num_threads(1)
    cfg = build(RunConfig, {
        "model": {"config": LLAMA},
        "precision": {"dtype": dtype},
        "optim": {"lr": 1e-3},
        "rollout": {"sampling": {"n": 4, "max_tokens": 12}},
        "algorithm": {"micro_batch_size": 4},
    })
    arch = arch_from_hf(LLAMA)
    groups = Topology.for_model(cfg.parallel, world, arch).initialize(seed=0)
    actor = build_model(arch, cfg.parallel, cfg.precision, role="actor")
    load_full_state(actor, canonical_state(arch, seed=1))
    reference = build_model(arch, cfg.parallel, cfg.precision, role="reference")
    copy_weights(actor, reference)
    opt, sched = build_optimizer(actor, cfg.optim, dtype=dtype, total_steps=2)
    engine = RolloutEngine(
        model_dir(LLAMA), arch, SamplingConfig(n=4, max_tokens=12, seed=7),
        EngineConfig(kv_cache_memory_bytes=64 * 2**20), dtype=dtype,
    )  # fmt: skip
    engine.call(install_capture)
    ws = ColocatedWeights(actor, arch, engine, groups)
    ws.sync()
    before = engine.call(dense_state)
    rollout = engine.generate([PROMPTS[0], PROMPTS[1]], seed=3)
    batch = xp.build_batch([PROMPTS[i] for i in rollout.prompt_index], rollout.response_ids,
                           rollout.response_logprobs, pad_id=0, pad_to=1)
    kw = dict(micro=MicroBatching(size=4, pack=True), vocab_size=arch.vocab_size, groups=groups,
              temperature=1.0)
    actor_lp = xp.forward_logprobs(actor, batch.fields(), **kw)
    ref_lp = xp.forward_logprobs(reference, batch.fields(), **kw)
    mask = batch.loss_mask.bool()
    gap_before = (actor_lp - batch.sampler_logprobs).abs()[mask]
    batch.advantages = torch.linspace(-1, 1, len(rollout.response_ids))[:, None] * batch.loss_mask
    stats = update.train_policy(
        actor, opt, sched, batch, alg=cfg.algorithm, sampling=cfg.rollout.sampling,
        vocab_size=arch.vocab_size, groups=groups, seed=1,
    )  # fmt: skip
    ws.sync()
    ours = engine.call(dense_state)
    naive_sync(actor, arch, engine)  # full gather of the trainer's current weights -> loader
    ref = engine.call(dense_state)
    # logprobs of bf16 logits: megatron's vocab-parallel path against fp32 log_softmax
    g = torch.Generator().manual_seed(0)
    logits = (8 * torch.randn(2, 5, 256, generator=g)).to(torch.bfloat16)
    targets = torch.randint(0, 250, (2, 5), generator=g)
    got = token_logprobs(logits, targets, vocab_size=250, tp_group=groups.tp)
    want = torch.log_softmax(logits.float()[..., :250], -1).gather(-1, targets[..., None])[..., 0]
    in_bf16 = torch.log_softmax(logits[..., :250], -1).gather(-1, targets[..., None])[..., 0]
    engine.close()
    return {
        "dtypes": {str(t.dtype) for t in ours.values()},
        "bitwise": compare_bitwise(ours, ref),
        "moved": digest(ours) != digest(before),
        "ref_equals_actor": torch.equal(actor_lp[mask], ref_lp[mask]),
        "gap_before": (float(gap_before.mean()), float(gap_before.max())),
        "logprob_dtype": str(got.dtype),
        "logprob_err": float((got - want).abs().max()),
        "bf16_logprob_err": float((in_bf16.float() - want).abs().max()),
        "stats": stats.reduce(),
    }


@pytest.mark.slow
def test_bf16_sync_reference_and_logprob_reduction():
    """vLLM holds the trainer's current bf16 weights after a step (bitwise equal to a full
    gather of them through vLLM's own loader, and different from before the step); the
    reference's logprobs equal the initial actor's; logprobs of bf16 logits are fp32 log_softmax
    of the upcast logits (a bf16 log_softmax is off by ~1e-2 here)."""
    r = spawn(sync_job, 1, timeout=600)[0]
    print("bf16 megatron vs vLLM bf16 before the step (mean, max):", r["gap_before"])
    assert r["dtypes"] == {"torch.bfloat16"}
    assert r["moved"]
    assert r["bitwise"]["different"] == [] and r["bitwise"]["sentinel_left"] == []
    assert r["ref_equals_actor"]
    assert r["logprob_dtype"] == "torch.float32"
    assert r["logprob_err"] < 1e-5 < 1e-3 < r["bf16_logprob_err"]
    assert r["gap_before"][0] < 0.05


@pytest.mark.slow
def test_fp16_sync_hands_vllm_the_trainers_fp16_weights():
    """fp16 trainer and fp16 engine: after a loss-scaled step vLLM holds the trainer's fp16
    weights bit for bit (equal to a full gather through vLLM's own loader), moved by the step."""
    r = spawn(sync_job, 1, "fp16", timeout=600)[0]
    print("fp16 megatron vs vLLM fp16 before the step (mean, max):", r["gap_before"], r["stats"])
    assert r["dtypes"] == {"torch.float16"}
    assert r["moved"]
    assert r["bitwise"]["different"] == [] and r["bitwise"]["sentinel_left"] == []
    assert r["ref_equals_actor"]
    assert r["gap_before"][0] < 0.01
