"""What a run checks and sets up before its first step, on megatron-core's real optimizers and
gloo collectives:

- the fp32 masters come from the weights as loaded, also when Transformer-Engine preserved a
  random init on the parameters (planted here as TE 2.9 attaches it, on parameters megatron's
  DistributedOptimizer takes for FP8 ones: its real FP8 branch then reads the planted copy);
- the start-up invariants (`megarl.trainer.invariants`): masters equal to the weights, frozen
  models without training-only copies; each planted defect is named by role and tensor, on
  every rank;
- Adam's state is allocated when the optimizer is built (before vLLM's free-memory check),
  zero, with the step count unchanged, and the first real step equals that of an optimizer
  that allocated its state itself, bit for bit;
- the free-memory verdict is the same on every rank;
- the FP8 settings megatron is given: the optimizer's recipe, FP8 parameter gathering, and the
  refusal of a recipe the GPU cannot run.
"""

from __future__ import annotations

import types

import pytest
import torch

from megarl.distributed.launch import spawn
from tests.tiny import TINY_LLAMA

GIB = 2**30


def _cfg(dtype: str, distributed: bool = True):
    from megarl.config import RunConfig, build

    return build(
        RunConfig,
        {
            "model": {"config": TINY_LLAMA},
            "precision": {"dtype": dtype},
            "optim": {"lr": 1e-2, "distributed": distributed},
        },
    )


def _setup(world: int, dtype: str, distributed: bool = True):
    from megarl.distributed import Topology
    from megarl.models.hf_config import arch_from_hf

    torch.set_num_threads(1)
    cfg = _cfg(dtype, distributed)
    arch = arch_from_hf(TINY_LLAMA)
    Topology.for_model(cfg.parallel, world, arch).initialize(seed=0)
    return cfg, arch


def _actor(cfg, arch, seed: int = 0):
    from megarl.convert.sharded import seeded_init
    from megarl.models.builder import build_model

    chunks = build_model(arch, cfg.parallel, cfg.precision, role="actor")
    seeded_init(chunks, arch, seed)
    return chunks


def _plant_preserved_init(chunks, seed: int) -> int:
    """On every linear weight, what TE 2.9 attaches to an FP8 parameter built under
    `preserve_high_precision_init_val` (`pytorch/module/base.py:1280-1325`): a host copy of
    its random initial value and the two methods megatron calls."""

    def get(self):
        return getattr(self, "_high_precision_init_val", None)

    def clear(self):
        if hasattr(self, "_high_precision_init_val"):
            del self._high_precision_init_val

    g = torch.Generator().manual_seed(seed)
    n = 0
    for c in chunks:
        for name, p in c.named_parameters():
            if name.endswith("fc1.weight") or name.endswith("linear_proj.weight"):
                p._high_precision_init_val = torch.randn(p.shape, generator=g) * 0.02
                p.get_high_precision_init_val = types.MethodType(get, p)
                p.clear_high_precision_init_val = types.MethodType(clear, p)
                n += 1
    return n


def preserved_init_job(rank: int, world: int) -> dict:
    """DP2, bf16. Megatron's DistributedOptimizer treats a parameter as FP8 by
    `is_float8tensor`; here it answers yes for a parameter that carries a preserved init (a
    CPU tensor cannot be TE's Float8Tensor), so its FP8 branch runs: masters from the preserved
    copy, then `clear_high_precision_init_val` (`optimizer/distrib_optimizer.py:384-393`)."""
    from megatron.core.optimizer import distrib_optimizer, get_megatron_optimizer

    from megarl.models.optim import (
        build_optimizer,
        master_pairs,
        megatron_config,
        wire_grad_finalization,
    )
    from megarl.trainer.invariants import copy_problems, master_problems

    distrib_optimizer.is_float8tensor = lambda t: hasattr(t, "_high_precision_init_val")
    cfg, arch = _setup(world, "bf16")
    out = {}
    # megatron's optimizer as is: built after the load, it still takes the preserved init
    raw = _actor(cfg, arch)
    out["planted"] = _plant_preserved_init(raw, seed=5)
    planted = {id(p) for p in raw[0].parameters() if hasattr(p, "_high_precision_init_val")}
    wire_grad_finalization(raw)
    opt = get_megatron_optimizer(
        megatron_config(cfg.optim, dtype="bf16", fp8_recipe="delayed"), raw
    )
    out["raw"] = master_problems("actor", raw, opt)
    out["here"] = sum(id(p) in planted for p, *_ in master_pairs(opt))  # this DP rank's share
    # megarl's: the masters are the loaded weights, the preserved copies are gone
    actor = _actor(cfg, arch)
    _plant_preserved_init(actor, seed=5)
    opt, _ = build_optimizer(actor, cfg.optim, dtype="bf16", fp8_recipe="delayed")
    out["fixed"] = master_problems("actor", actor, opt) + copy_problems("actor", actor)
    out["left"] = sum(hasattr(p, "_high_precision_init_val") for p in actor[0].parameters())
    return out


def test_masters_of_fp8_parameters_come_from_the_loaded_weights_not_the_preserved_init():
    ranks = spawn(preserved_init_job, 2, timeout=600)
    # the defect, reproduced through megatron's own FP8 branch: on each DP rank, the master of
    # every planted tensor it holds a slice of is the random init, named by role and tensor
    assert sum(r["here"] for r in ranks) >= ranks[0]["planted"] == 8
    for r in ranks:
        assert r["here"] > 0 and len(r["raw"]) == r["here"], r["raw"]
        assert r["raw"][0].startswith("the actor's fp32 master of decoder.layers."), r["raw"]
        assert "is not the loaded weight" in r["raw"][0]
        assert r["fixed"] == [] and r["left"] == 0, r


def frozen_copies_job(rank: int, world: int) -> dict:
    """Transformer-Engine attaches the preserved init while a layer is built: planted at the
    same point (the chunk builder's return), for a frozen and a trained model."""
    from megarl.models import builder
    from megarl.models.optim import build_optimizer
    from megarl.trainer.invariants import copy_problems

    cfg, arch = _setup(world, "bf16")
    build_chunk = builder.build_gpt_chunk

    def planting(*args, **kwargs):
        chunk = build_chunk(*args, **kwargs)
        _plant_preserved_init([chunk], seed=3)
        return chunk

    builder.build_gpt_chunk = planting
    reference = builder.build_model(arch, cfg.parallel, cfg.precision, role="reference")
    teacher = builder.build_model(arch, cfg.parallel, cfg.precision, role="teacher", frozen=True)
    actor = builder.build_model(arch, cfg.parallel, cfg.precision, role="actor")
    actor_kept = copy_problems("actor", actor)  # before its optimizer is built
    build_optimizer(actor, cfg.optim, dtype="bf16")
    from megarl.trainer.invariants import model_problems
    from megarl.trainer.models import Models

    clean = model_problems(Models(teacher=teacher))
    next(teacher[0].parameters()).main_grad = torch.zeros(1)  # a frozen teacher with a buffer
    return {
        "reference": copy_problems("reference", reference),
        "teacher": clean,
        "teacher_with_grad": model_problems(Models(teacher=teacher)),
        "actor_before_optimizer": len(actor_kept),
        "actor": copy_problems("actor", actor),
    }


def test_no_model_keeps_the_preserved_init_once_built():
    r = spawn(frozen_copies_job, 1, timeout=600)[0]
    assert r["actor_before_optimizer"] == 2 * TINY_LLAMA["num_hidden_layers"]  # it was planted
    assert r["reference"] == [] and r["actor"] == [] and r["teacher"] == [], r
    assert len(r["teacher_with_grad"]) == 1 and "teacher" in r["teacher_with_grad"][0], r


def invariants_job(rank: int, world: int) -> dict:
    """DP2, bf16: an actor and a frozen reference, checked clean, then with one defect planted
    at a time on one rank; every rank must raise."""
    from megarl.convert.sharded import seeded_init
    from megarl.models.builder import build_model, unwrap
    from megarl.models.optim import build_optimizer, master_pairs
    from megarl.trainer.invariants import InvariantError, check_models
    from megarl.trainer.models import Models, Trained

    cfg, arch = _setup(world, "bf16")
    actor = _actor(cfg, arch)
    opt, sched = build_optimizer(actor, cfg.optim, dtype="bf16")
    reference = build_model(arch, cfg.parallel, cfg.precision, role="reference")
    seeded_init(reference, arch, 0)
    models = Models(actor=Trained(actor, opt, sched), reference=reference)
    ref_param = dict(unwrap(reference[0]).named_parameters())[
        "decoder.layers.1.mlp.linear_fc2.weight"
    ]
    param, master, start, _ = master_pairs(opt)[3]

    def outcome():
        try:
            check_models(models)
            return None
        except InvariantError as e:
            return str(e)

    out = {"clean": outcome()}
    with torch.no_grad():
        if rank == 1:  # a master one bf16 step off its weight
            master[0] += 4 * max(float(master[0].abs()), 1e-3)
        out["master"] = outcome()
        if rank == 1:
            master[0] = param.detach().reshape(-1)[start].float()
        out["restored"] = outcome()
        if rank == 0:  # a frozen weight that kept TE's preserved init
            ref_param._high_precision_init_val = torch.zeros(ref_param.shape)
        out["preserved"] = outcome()
        if rank == 0:
            del ref_param._high_precision_init_val
            ref_param.main_param = torch.zeros(ref_param.numel())  # an optimizer's master
        out["frozen_master"] = outcome()
        if rank == 0:
            del ref_param.main_param
            ref_param.grad = torch.zeros_like(ref_param)
        out["frozen_grad"] = outcome()
    return out


def test_startup_invariants_name_the_role_and_tensor_and_stop_every_rank():
    r0, r1 = spawn(invariants_job, 2, timeout=600)
    assert r0["clean"] is None and r1["clean"] is None
    assert r0["restored"] is None and r1["restored"] is None
    # the rank that holds the defect names it in one line; the other names that rank
    assert r1["master"].startswith("start-up check: the actor's fp32 master of "), r1
    assert "is not the loaded weight: 1 of " in r1["master"] and "\n" not in r1["master"]
    assert r0["master"].startswith("start-up check failed on rank(s) [1]"), r0
    frozen = "start-up check: the reference's decoder.layers.1.mlp.linear_fc2.weight "
    assert r0["preserved"] == frozen + (
        "keeps Transformer-Engine's host copy of its initial value "
        "(`preserve_high_precision_init_val`), which nothing reads once the masters are set"
    )
    assert r1["preserved"].startswith("start-up check failed on rank(s) [0]"), r1
    assert r0["frozen_master"] == frozen.replace("reference's", "reference's frozen") + (
        "holds main_param"
    )
    assert r0["frozen_grad"].endswith(
        "frozen decoder.layers.1.mlp.linear_fc2.weight holds a gradient"
    )
    assert r1["frozen_master"].startswith("start-up check failed on rank(s) [0]")


def state_job(rank: int, world: int) -> dict:
    """For each optimizer megarl builds on CPU (DistributedOptimizer fp32 / bf16, megatron's
    Float16Optimizer): the state right after `build_optimizer`, and one real step against the
    same optimizer whose state is dropped first (megatron's own: it allocates in `step()`)."""
    from megarl.models.optim import build_optimizer

    _, arch = _setup(world, "fp32")
    out = {}
    for dtype, distributed in (("fp32", True), ("bf16", True), ("bf16", False)):
        cfg = _cfg(dtype, distributed)
        key = f"{dtype}_{'distributed' if distributed else 'float16'}"
        pre = _actor(cfg, arch)
        pre_opt, _ = build_optimizer(pre, cfg.optim, dtype=dtype)
        inner = [o.optimizer for o in getattr(pre_opt, "chained_optimizers", [pre_opt])]
        params = [p for o in inner for g in o.param_groups for p in g["params"]]
        states = [o.state[p] for o in inner for g in o.param_groups for p in g["params"]]
        r = {
            "params": len(params),
            "with_state": sum(bool(s) for s in states),
            "zero": all(not s["exp_avg"].any() and not s["exp_avg_sq"].any() for s in states if s),
            "steps": sorted({float(s["step"]) for s in states if s}),
            "moment_bytes": sum(
                s["exp_avg"].numel() * s["exp_avg"].element_size() * 2 for s in states if s
            ),
            "main_bytes": sum(p.numel() * p.element_size() * 2 for p in params),
        }
        lazy = _actor(cfg, arch)
        lazy_opt, _ = build_optimizer(lazy, cfg.optim, dtype=dtype)
        for o in getattr(lazy_opt, "chained_optimizers", [lazy_opt]):
            o.optimizer.state.clear()  # as megatron leaves it: allocated by the first step()
        g = torch.Generator().manual_seed(11)
        for a, b in zip(pre[0].parameters(), lazy[0].parameters(), strict=True):
            grad = torch.randn(a.shape, generator=g)
            a.main_grad.copy_(grad)
            b.main_grad.copy_(grad)
        pre_opt.step()
        lazy_opt.step()
        r["same_params"] = all(
            torch.equal(a, b)
            for a, b in zip(pre[0].parameters(), lazy[0].parameters(), strict=True)
        )
        lazy_inner = [o.optimizer for o in getattr(lazy_opt, "chained_optimizers", [lazy_opt])]
        lazy_states = [o.state[p] for o in lazy_inner for g in o.param_groups for p in g["params"]]
        r["same_state"] = all(
            set(a) == set(b)
            and all(torch.equal(a[k], b[k]) for k in a)
            and all(a[k].dtype == b[k].dtype for k in a)
            for a, b in zip(states, lazy_states, strict=True)
        )
        r["moved"] = not all(
            torch.equal(a, b)
            for a, b in zip(pre[0].parameters(), _actor(cfg, arch)[0].parameters(), strict=True)
        )
        out[key] = r
    return out


def test_adam_state_exists_before_the_first_step_without_taking_one():
    for key, r in spawn(state_job, 1, timeout=600)[0].items():
        assert r["params"] > 0 and r["with_state"] == r["params"], (key, r)
        assert r["zero"] and r["steps"] == [0.0], (key, r)  # no step was taken
        assert r["moment_bytes"] == r["main_bytes"], (key, r)  # m and v, fp32, every element
        assert r["moved"], (key, r)  # the step below is a real one
        assert r["same_params"] and r["same_state"], (key, r)  # bit for bit


def memory_job(rank: int, world: int, free_gib: list[float]) -> str | None:
    """Each rank's GPU reports its own free memory (80 GiB cards); the check runs for real over
    the gloo group."""
    from megarl.rollout.config import EngineConfig, RolloutConfigError
    from megarl.rollout.engine.checks import check_free_memory

    torch.cuda.empty_cache = lambda: None
    torch.cuda.mem_get_info = lambda: (free_gib[rank] * GIB, 80 * GIB)
    try:
        check_free_memory(EngineConfig(gpu_memory_utilization=0.6))
        return None
    except RolloutConfigError as e:
        return str(e)


def test_the_free_memory_verdict_is_the_same_on_every_rank():
    assert spawn(memory_job, 2, [60.0, 50.0], timeout=300) == [None, None]
    r0, r1 = spawn(memory_job, 2, [60.0, 40.0], timeout=300)
    assert r0 is not None and r0 == r1  # rank 0 had room: it stops too, with the same words
    assert "only 40.0 GiB are free on rank 1" in r0 and "short on 1 of 2 ranks" in r0
    assert "set it to at most 0.49" in r0


def test_free_memory_verdict_names_the_rank_with_least_room():
    from megarl.rollout.engine.checks import free_memory_verdict

    assert free_memory_verdict(0.5, [[41 * GIB, 80 * GIB], [40 * GIB, 80 * GIB]]) is None
    msg = free_memory_verdict(
        0.5, [[30 * GIB, 80 * GIB], [20 * GIB, 80 * GIB], [GIB // 2, 80 * GIB]]
    )
    assert "on rank 2" in msg and "short on 3 of 3 ranks" in msg, msg
    assert "the trainer alone leaves no room" in msg


@pytest.mark.parametrize(
    "recipe, capability, refused",
    [
        ("mxfp8", (9, 0), True),  # H100 / H200
        ("mxfp8", (10, 0), False),  # B200
        ("mxfp8", (12, 0), True),  # TE 2.9 does not run MXFP8 there yet
        ("blockwise", (9, 0), False),
        ("blockwise", (8, 9), True),
        ("tensorwise", (9, 0), False),
        ("delayed", (8, 0), True),  # A100: no FP8
    ],
)
def test_fp8_recipe_is_refused_on_a_gpu_that_cannot_run_it(recipe, capability, refused):
    from megarl.models.hf_config import ModelConfigError
    from megarl.models.mcore_config import check_fp8_recipe_device

    if not refused:
        check_fp8_recipe_device(recipe, capability)
        return
    with pytest.raises(ModelConfigError) as e:
        check_fp8_recipe_device(recipe, capability)
    assert f"precision.fp8_recipe={recipe} needs a GPU of compute capability" in str(e.value)
    assert f"this GPU has {capability[0]}.{capability[1]}" in str(e.value)
    if capability == (9, 0):
        assert "accepted on it: delayed, tensorwise, blockwise" in str(e.value)


def test_megatron_gets_the_fp8_recipe_and_fp8_parameter_gathering():
    from megarl.models.builder import default_ddp_config
    from megarl.models.hf_config import PrecisionConfig
    from megarl.models.optim import OptimConfig, megatron_config

    fp8 = PrecisionConfig(dtype="bf16", fp8="hybrid", fp8_recipe="tensorwise", fp8_param=True)
    oc = megatron_config(OptimConfig(), dtype="bf16", fp8_recipe=fp8.active_fp8_recipe)
    assert oc.fp8_recipe == "tensorwise" and oc.bf16
    assert default_ddp_config(fp8).fp8_param_gather is True
    plain = PrecisionConfig(dtype="bf16", fp8_recipe="mxfp8")  # a recipe without FP8: not used
    assert (
        megatron_config(OptimConfig(), dtype="bf16", fp8_recipe=plain.active_fp8_recipe).fp8_recipe
        is None
    )
    assert default_ddp_config(plain).fp8_param_gather is False


def test_the_gpu_model_config_refuses_mxfp8_on_hopper(monkeypatch):
    """The refusal is made where the FP8 config is built for a GPU, before any layer exists
    (Transformer-Engine's presence and the device stood in by what they answer)."""
    from megarl.config import ParallelConfig
    from megarl.models import hf_config, mcore_config

    monkeypatch.setattr(mcore_config, "require_transformer_engine", lambda what: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    arch = hf_config.arch_from_hf(TINY_LLAMA)
    prec = hf_config.PrecisionConfig(dtype="bf16", fp8="hybrid", fp8_recipe="mxfp8")
    with pytest.raises(hf_config.ModelConfigError, match="this GPU has 9.0 \\(Hopper\\)"):
        mcore_config.transformer_config(arch, ParallelConfig(), prec, gpu=True)
