"""`megarl plan CONFIG --gpus N --gpu-mem GB`: will this run fit, before any GPU is asked for.

The layout is validated exactly as a real run would (`Topology`, plus vLLM's TP inside a node
and dividing the world), each pipeline stage's parameters are counted by building its first
rank's model on the meta device (`megarl.trainer.dry_run`), and every stage gets a table of what
one GPU holds (`formulas`) and the peak of each phase of an RL step:

    rollout   vLLM awake (weights + KV cache) beside the trainer's resident models
    logprobs  vLLM asleep; a forward pass without grad (old / reference / teacher logprobs)
    train     activations of the micro-batches in flight + the loss over the vocabulary
    sync      vLLM's weights woken up and written, KV cache still freed

"Resident" = actor weights, its fp32 grad buffer and Adam state (sharded over DP by the
DistributedOptimizer), the reference's weights, the critic's three, a distillation teacher's
weights, and the CUDA runtime; a judge's vLLM engine (`reward.judge`) is held in every phase
(`megarl.plan.engines`).
With LoRA (`model.lora`) the base is frozen: the grad buffer and Adam hold the adapters only,
there is no reference copy (the reference is the base, adapters off), and a merging sync
(`model.lora.merge: true`) holds a merged copy of every adapted weight
(`megarl.models.lora.merged`). Not counted: the adapters' own activations (rank-sized, about
2 rank e B per adapted linear and token) and, without merging, vLLM's adapter slots (allocated
with its weights, inside its budget).
A run fits when every phase's peak is at most `HEADROOM` of the GPU (allocator fragmentation).
"""

from __future__ import annotations

import dataclasses
import math

from megarl.algorithms.config import RL_ALGORITHMS
from megarl.config import ConfigError, RunConfig
from megarl.distributed import TopologyError
from megarl.dtypes import BYTES
from megarl.models.builder import num_params
from megarl.models.forward import sequence_multiple
from megarl.models.lora import te_refusal
from megarl.models.mcore_config import packing_refusal, te_attention_refusal
from megarl.plan import engines
from megarl.plan import formulas as fm
from megarl.plan.formulas import gib
from megarl.plan.records import HEADROOM, Plan, Row, Shape, StagePlan
from megarl.rollout.engine.checks import NO_ENGINE
from megarl.trainer.dry_run import dry_run
from megarl.trainer.model_source import check_shape_source, load_arch

RUNTIME_GPU = 2 * fm.GiB
"""CUDA context, NCCL communicators' buffers, cuBLAS / Transformer-Engine workspaces: an
assumption (H100 context ~0.5 GiB, NCCL ~0.5-1 GiB), not measured on CPU."""


def plan(
    cfg: RunConfig,
    *,
    gpus: int,
    gpu_mem_gib: float,
    nodes: int | None = None,
    config_path: str | None = None,
    device: str = "gpu",
) -> Plan:
    """The memory plan of `cfg` on `gpus` GPUs of `gpu_mem_gib` GiB in `nodes` nodes (default:
    8 GPUs per node). `device="cpu"` plans a CPU run (local layers, vLLM's CPU KV cache, no CUDA
    runtime) for comparison with measurements. User errors raise `ConfigError`."""

    if gpus < 1:
        raise ConfigError(f"--gpus {gpus}: accepted: a number of GPUs >= 1")
    if gpu_mem_gib <= 0:
        raise ConfigError(f"--gpu-mem {gpu_mem_gib}: accepted: GiB of memory per GPU, > 0")
    if nodes is None:
        nodes = gpus // 8 if gpus % 8 == 0 and gpus >= 8 else 1
    if nodes < 1 or gpus % nodes:
        raise ConfigError(f"--nodes {nodes} does not divide --gpus {gpus}; accepted: a divisor")
    check_shape_source(cfg)  # the one input a plan reads: the model's shape
    arch = load_arch(cfg)
    base = dict(
        config_path=config_path,
        gpus=gpus,
        gpu_mem=gpu_mem_gib * fm.GiB,
        nodes=nodes,
        device=device,
        cfg=cfg,
        arch=arch,
    )
    problems, warnings = _cluster_checks(cfg, gpus, nodes)
    problems = [f"layout: {p}" for p in problems]
    refused = te_refusal(cfg.model.lora, cfg.precision) if device == "gpu" else None
    if refused:  # a real run stops at its model build (`check_lora`)
        problems.append(f"LoRA: {refused}")
    if device == "gpu" and cfg.precision.transformer_engine is not False:
        refused = te_attention_refusal(arch, packed=cfg.algorithm.pack_sequences, te_version=None)
        if refused:  # a real run stops at its model build
            problems.append(f"attention: {refused}")
    if refused := packing_refusal(arch, packed=cfg.algorithm.pack_sequences):
        problems.append(f"packing: {refused}")
    if cfg.algorithm.name in RL_ALGORITHMS and (refused := NO_ENGINE.get(arch.family)):
        problems.append(f"rollout: {arch.family} has no rollout engine yet: {refused}")
    advice = []
    try:
        shape, topo = count_params(cfg, gpus, dry_run)
    except TopologyError as e:  # no layout of the trainer: say what any layout would need
        problems.append(f"layout: {e}")
        shape = topo = None
        advice = _lower_bound(cfg, arch, gpus, gpu_mem_gib * fm.GiB)
    if problems:
        return Plan(
            **base,
            topo=topo,
            problems=tuple(problems),
            warnings=tuple(warnings),
            advice=tuple(advice),
        )
    stages = tuple(
        stage_plan(cfg, arch, topo, shape, r, device=device, gpu_mem=gpu_mem_gib * fm.GiB)
        for r in range(topo.pp)
    )
    result = Plan(**base, topo=topo, stages=stages, warnings=tuple(warnings))
    if not result.fits:
        advice = _advice(cfg, arch, topo, shape, result, device)
        result = dataclasses.replace(result, advice=tuple(advice))
    return result


def count_params(cfg: RunConfig, world: int, dry_run) -> tuple[Shape, object]:
    """Per-stage parameter counts from megatron-core's own meta-device build (first rank of each
    stage: megatron orders pipeline stages outermost)."""
    first = dry_run(cfg, world_size=world, rank=0)
    runs = [first] + [
        dry_run(cfg, world_size=world, rank=s * world // first.topo.pp)
        for s in range(1, first.topo.pp)
    ]
    lora = cfg.model.lora.enabled
    return Shape(
        params=tuple(r.rank_params - r.rank_adapters for r in runs),
        expert_params=tuple(sum(c.params.get("experts", 0) for c in r.chunks) for r in runs),
        layers=tuple(tuple(len(c.layers) for c in r.chunks) for r in runs),
        critic=tuple(r.critic_params for r in runs) if first.critic_params is not None else None,
        critic_trained=(
            tuple(r.critic_trained for r in runs) if cfg.model.critic_lora.enabled else None
        ),
        padded_vocab=first.padded_vocab,
        adapters=tuple(r.rank_adapters for r in runs) if lora else (),
        adapted=tuple(sum(c.adapted for c in r.chunks) for r in runs) if lora else (),
        largest_adapted=(
            tuple(max(c.largest_adapted for c in r.chunks) for r in runs) if lora else ()
        ),
        teacher=tuple(r.teacher_params for r in runs) if first.teacher_arch is not None else None,
        teacher_arch=first.teacher_arch,
    ), first.topo


def micro_batching(cfg: RunConfig, topo) -> tuple[int, int, int]:
    """(sequence length, sequences per micro-batch, micro-batches per mini-batch per DP rank)."""
    p = cfg.parallel
    multiple = sequence_multiple(
        topo.tp, p.sequence_parallel, cfg.precision.fp8_recipe if cfg.precision.fp8 else None
    )
    seq = fm.round_up(cfg.data.max_prompt_length + cfg.rollout.sampling.max_tokens, multiple)
    mbs = cfg.algorithm.micro_batch_size
    if cfg.algorithm.max_tokens_per_micro_batch is not None:
        mbs = max(1, min(mbs, cfg.algorithm.max_tokens_per_micro_batch // seq))
    sequences = cfg.data.prompts_per_step * cfg.rollout.sampling.n
    per_rank = math.ceil(sequences / (cfg.algorithm.mini_batches * topo.dp))
    mbs = max(1, min(mbs, per_rank))  # a mini-batch smaller than a micro-batch
    micro = max(1, math.ceil(per_rank / mbs))
    # the interleaved schedule runs micro-batches in groups of PP (forward.forward_backward)
    if topo.vpp:
        micro = fm.round_up(micro, topo.pp)
    return seq, mbs, micro


def stage_plan(cfg, arch, topo, shape: Shape, r: int, *, device: str, gpu_mem: float):
    """The rows of pipeline stage `r` (see the module docstring)."""
    p, prec, alg = cfg.parallel, cfg.precision, cfg.algorithm
    e = BYTES[prec.dtype]
    rows: list[Row] = []
    total, experts = shape.params[r], shape.expert_params[r]
    dense = total - experts
    dp_shard = topo.dp * topo.cp if cfg.optim.distributed else 1
    edp = topo.world_size // (topo.pp * topo.ep * (p.expert_tensor_parallel or topo.tp))
    edp_shard = edp if cfg.optim.distributed else 1
    w = 1 if prec.fp8 and prec.fp8_param else e
    wname = "1 B (FP8 params)" if w == 1 else f"{e} B ({prec.dtype})"
    per, per_text = fm.optimizer_bytes_per_param(prec.dtype)
    shard = f"/ DP x CP {dp_shard}" + (f", experts / expert-DP {edp_shard}" if experts else "")
    if cfg.model.lora.enabled:
        rows += _lora_rows(cfg, shape, r, w=w, wname=wname, e=e, dp_shard=dp_shard)
    else:
        rows.append(Row("actor weights", total * w, f"{total:,} params x {wname}"))
        rows.append(Row("actor grads", total * 4, f"{total:,} x 4 B (fp32 main-grad buffer)"))
        opt = dense * per / dp_shard + experts * per / edp_shard
        rows.append(Row("actor Adam", opt, f"{per_text} {shard}"))
        if alg.needs_reference:
            rows.append(Row("reference weights", total * e, f"{total:,} x {e} B (frozen)"))
    if shape.critic is not None and shape.critic_trained is not None:
        c, t = shape.critic[r], shape.critic_trained[r]  # LoRA: a frozen base, t trained
        rows.append(
            Row(
                "critic weights + grads + Adam",
                c * e + t * 4 + t * per / dp_shard,
                f"{c:,} x {e} B + {t:,} trained (LoRA adapters, value head) x 4 B + "
                f"{per_text} / DP x CP {dp_shard}",
            )
        )
    elif shape.critic is not None:
        c = shape.critic[r]
        cexp = experts  # the critic shares the actor's trunk, experts included
        copt = (c - cexp) * per / dp_shard + cexp * per / edp_shard
        rows.append(
            Row(
                "critic weights + grads + Adam",
                c * (e + 4) + copt,
                f"{c:,} x ({e} + 4) B + {per_text} {shard}",
            )
        )
    if shape.teacher is not None:
        t, te = shape.teacher[r], BYTES[cfg.teacher.dtype or cfg.precision.dtype]
        rows.append(Row("teacher weights", t * te, f"{t:,} x {te} B (frozen)"))
    if device == "gpu":
        rows.append(Row("CUDA runtime", RUNTIME_GPU, "context, NCCL, workspaces (assumed)"))

    seq, mbs, micro = micro_batching(cfg, topo)
    tokens = seq * mbs
    impl = _impl(cfg, device)
    per_layer, layer_text = fm.layer_activation_bytes_per_token(
        arch,
        elem=e,
        tp=topo.tp,
        sequence_parallel=p.sequence_parallel,
        impl=impl,
        expert_tp=p.expert_tensor_parallel,
    )
    passes, pass_text = fm.in_flight_layer_passes(
        layers_per_chunk=list(shape.layers[r]),
        pp=topo.pp,
        pp_rank=r,
        vpp=topo.vpp,
        micro_batches=micro,
    )
    mb_text = f"micro-batch {mbs} x {seq} tokens"
    if p.recompute == "full":
        sp = topo.tp if p.sequence_parallel else 1
        act = passes * tokens * e * arch.hidden_size / sp + tokens * per_layer
        act_text = (
            f"recompute: {pass_text} x e h{' / TP' if sp > 1 else ''} per token + one "
            f"layer recomputed ({layer_text}); {mb_text}"
        )
    else:
        act = passes * tokens * per_layer
        act_text = f"{pass_text} x ({layer_text}) per token; {mb_text}"
    rows.append(Row("train activations", act, act_text, ("train",)))
    if r == topo.pp - 1:
        lg, lg_text = fm.logits_bytes_per_token(
            shape.padded_vocab, tp=topo.tp, elem=e, packed=alg.pack_sequences
        )
        scratch, scratch_text = fm.vocab_scratch_bytes(entropy=alg.entropy_coef > 0)
        rows.append(
            Row(
                "train loss over the vocabulary",
                lg * tokens + scratch,
                f"{lg_text} per token; {mb_text}; + {scratch_text}",
                ("train",),
            )
        )
        rows.append(_logprob_pass(cfg, arch, shape, topo, tokens, e))
    if prec.fp8 and not prec.fp8_param:
        rows.append(
            Row(
                "FP8 weight copies",
                total * 2,
                "Transformer-Engine's cached FP8 "
                "weight and its transpose, 2 B/param, while training",
                ("train",),
            )
        )
    if cfg.algorithm.name in RL_ALGORITHMS:  # SFT, DPO and reward models build no engine
        rows += engines.vllm_rows(cfg, arch, device, gpu_mem, e)
    rows += engines.judge_rows(cfg, device, gpu_mem, e)
    return StagePlan(
        pp_rank=r,
        rank=r * topo.world_size // topo.pp,
        layers=sum(shape.layers[r]),
        rows=tuple(rows),
    )


def _logprob_pass(cfg, arch, shape: Shape, topo, tokens: int, e: int) -> Row:
    """The forward pass without grad of the logprobs phase: the policy's (old / reference
    logprobs), or a distillation teacher's when that is larger (one pass at a time)."""

    def one(model, vocab: int, e: int = e) -> tuple[float, str]:
        lg, lg_text = fm.logits_bytes_per_token(
            vocab, tp=topo.tp, elem=e, packed=cfg.algorithm.pack_sequences
        )
        work, work_text = fm.forward_working_bytes_per_token(model, elem=e, tp=topo.tp)
        scratch, scratch_text = fm.vocab_scratch_bytes(entropy=False)
        text = f"({lg_text} + {work_text}) per token, no grad; + {scratch_text}"
        return (lg + work) * tokens + scratch, text

    nbytes, text = one(arch, shape.padded_vocab)
    name = "logprob pass"
    if shape.teacher_arch is not None:
        t = shape.teacher_arch
        vocab = t.padded_vocab_size(cfg.model.make_vocab_size_divisible_by, topo.tp)
        t_bytes, t_text = one(t, vocab, BYTES[cfg.teacher.dtype or cfg.precision.dtype])
        if t_bytes > nbytes:
            nbytes, text, name = t_bytes, t_text, "logprob pass (the teacher's, the larger)"
    return Row(name, nbytes, text, ("logprobs",))


def _lora_rows(
    cfg, shape: Shape, r: int, *, w: int, wname: str, e: int, dp_shard: int
) -> list[Row]:
    """LoRA's actor rows: the frozen base (also the reference) beside the adapters, which alone
    have grads and Adam state (dense: no adapter sits on an expert, `check_lora`), and a
    merging sync's copies of the adapted weights."""
    base, ad = shape.params[r], shape.adapters[r]
    per, per_text = fm.optimizer_bytes_per_param(cfg.precision.dtype)
    ref = "; the reference is this base with the adapters off (no copy)"
    rows = [
        Row(
            "actor weights",
            base * w + ad * e,
            f"{base:,} frozen base params x {wname} + {ad:,} adapter params x {e} B"
            f"{ref if cfg.algorithm.needs_reference else ''}",
        ),
        Row("actor grads", ad * 4, f"{ad:,} adapter params x 4 B (fp32 main-grad buffer)"),
        Row(
            "actor Adam",
            ad * per / dp_shard,
            f"{ad:,} adapter params x {per_text} / DP x CP {dp_shard}",
        ),
    ]
    if cfg.model.lora.merge:  # the sync sends W + scale B A (`megarl.models.lora.merged`)
        merged, text = fm.lora_merged_bytes(shape.adapted[r], shape.largest_adapted[r], elem=e)
        rows.append(Row("LoRA merged weights", merged, text, ("sync",)))
    return rows


def _impl(cfg, device: str) -> str:
    if device == "gpu" and cfg.precision.transformer_engine is not False:
        return "te"
    if device == "cpu" and cfg.precision.dtype != "fp32":
        return "local-fp32"  # megarl's SDPA attends 16-bit CPU tensors in fp32
    return "local"


def _cluster_checks(cfg, gpus: int, nodes: int) -> tuple[list[str], list[str]]:
    per_node = gpus // nodes
    ro, p = cfg.rollout.engine, cfg.parallel
    problems, warnings = [], []
    if ro.tensor_parallel > per_node or per_node % ro.tensor_parallel:
        problems.append(
            f"rollout.engine.tensor_parallel={ro.tensor_parallel} must divide the {per_node} GPUs "
            "of a node (each vLLM engine's TP group lives inside one node)"
        )
    elif gpus % ro.tensor_parallel:
        problems.append(
            f"rollout.engine.tensor_parallel={ro.tensor_parallel} must divide {gpus} GPUs"
        )
    if p.tensor_parallel > per_node:
        warnings.append(
            f"parallel.tensor_parallel={p.tensor_parallel} spans nodes ({per_node} GPUs each): "
            "its all-reduces run over the inter-node network; keep TP within a node"
        )
    return problems, warnings


def _lower_bound(cfg, arch, gpus: int, gpu_mem: float) -> list[str]:
    """What no layout of `gpus` GPUs can avoid: the model states spread over every GPU."""
    n, e = num_params(arch), BYTES[cfg.precision.dtype]
    per, _ = fm.optimizer_bytes_per_param(cfg.precision.dtype)
    trained = e + 4 + per  # weights, fp32 grads, Adam
    critic = ", critic" if cfg.algorithm.name == "ppo" else ""
    # the critic: trained in full, or a frozen base whose adapters (and head) train
    c_lora = cfg.model.critic_lora
    c_per, adapters = (trained if critic else 0), 0  # per critic parameter; adapter parameters
    if critic and c_lora.enabled:
        c_per = e
        adapters = fm.lora_adapter_params(arch, rank=c_lora.rank, modules=c_lora.modules())
        critic = ", frozen critic base"
    lora = cfg.model.lora
    if lora.enabled:  # the frozen base (also the reference) + the adapters, trained
        adapters += fm.lora_adapter_params(arch, rank=lora.rank, modules=lora.modules())
        base = e + c_per
        total = n * base + adapters * trained
        what = (
            f"{n:,} params x {base} B (frozen base{critic}) + {adapters:,} LoRA adapter params "
            f"x {trained} B (weights, fp32 grads, Adam; the reference is the base)"
        )
    else:
        states = trained + (e if cfg.algorithm.needs_reference else 0) + c_per
        total = n * states + adapters * trained
        what = (
            f"{n:,} params x {states} B (weights, fp32 grads, Adam"
            f"{', reference' if cfg.algorithm.needs_reference else ''}{critic})"
            + (f" + {adapters:,} critic LoRA adapter params x {trained} B" if adapters else "")
        )
    need = math.ceil(total / (HEADROOM * gpu_mem))
    fits = "" if total / gpus <= HEADROOM * gpu_mem else " (does not fit)"
    return [
        f"model states alone: {what} = {gib(total)}; spread over "
        f"all {gpus} GPUs that is {gib(total / gpus)} per GPU{fits}",
        f"at least {need} GPUs of {gib(gpu_mem)} are needed for those alone; then set "
        "parallel.tensor_parallel x pipeline_parallel to divide the GPU count",
    ]


def _advice(cfg, arch, topo, shape, result: Plan, device: str) -> list[str]:
    """Changes that make the worst stage fit, each checked by re-planning it."""
    out = []
    worst = max(result.stages, key=lambda s: s.worst[1])
    phase, peak = worst.worst
    tried = []
    p, a, ro = cfg.parallel, cfg.algorithm, cfg.rollout.engine
    vllm_weights = num_params(arch) * BYTES[cfg.precision.dtype] / ro.tensor_parallel
    if device == "gpu" and a.name in RL_ALGORITHMS and vllm_weights > result.usable:
        out.append(
            f"vLLM's weights alone take {gib(vllm_weights)} per GPU at "
            f"rollout.engine.tensor_parallel={ro.tensor_parallel}, more than the "
            f"{gib(result.usable)} usable; an engine spans at most one node "
            f"({result.gpus // result.nodes} GPUs), so this model's rollout does not fit these "
            "GPUs in megarl (engines across nodes and vLLM expert parallelism are not built): "
            "GPUs with more memory"
        )
    if phase in ("train", "logprobs") and p.recompute == "none":
        tried.append(("--set parallel.recompute=full", _with(cfg, parallel={"recompute": "full"})))
    if phase in ("train", "logprobs") and a.micro_batch_size > 1:
        tried.append(
            ("--set algorithm.micro_batch_size=1", _with(cfg, algorithm={"micro_batch_size": 1}))
        )
    if phase == "train" and topo.tp > 1 and not p.sequence_parallel:
        tried.append(
            (
                "--set parallel.sequence_parallel=true",
                _with(cfg, parallel={"sequence_parallel": True}),
            )
        )
    if not cfg.optim.distributed and topo.dp > 1:
        tried.append(("--set optim.distributed=true", _with(cfg, optim={"distributed": True})))
    for text, variant in tried:
        stages = [
            stage_plan(variant, arch, topo, shape, s.pp_rank, device=device, gpu_mem=result.gpu_mem)
            for s in result.stages
        ]
        new = max(s.worst[1] for s in stages)
        verdict = "fits" if new <= result.usable else "still too large"
        out.append(f"{text}: peak {gib(peak)} -> {gib(new)} ({verdict})")
    if phase == "rollout" and device == "gpu" and ro.kv_cache_memory_bytes is None:
        out.append(_smaller_vllm(cfg, arch, worst, result))
    states = sum(
        r.nbytes for r in worst.rows if r.name.startswith(("actor", "reference", "critic"))
    )
    dp_helps = (
        "the frozen base is not sharded over DP (LoRA: Adam holds the adapters only)"
        if cfg.model.lora.enabled
        else "more GPUs (DP) shard the Adam row"
    )
    out.append(
        f"model states take {gib(states)} of stage {worst.pp_rank}'s GPU: more "
        f"tensor_parallel / pipeline_parallel divides them, {dp_helps}"
    )
    return out


def _smaller_vllm(cfg, arch, worst: StagePlan, result: Plan) -> str:
    """A lower `rollout.engine.gpu_memory_utilization`, if vLLM can still hold its weights, one
    sequence of KV cache and its working memory."""
    ro, e = cfg.rollout.engine, BYTES[cfg.precision.dtype]
    vllm = next(r for r in worst.rows if r.name == "vLLM (awake)").nbytes
    room = result.usable - (worst.peak("rollout") - vllm)
    seq = cfg.data.max_prompt_length + cfg.rollout.sampling.max_tokens
    need = (
        num_params(arch) * e / ro.tensor_parallel
        + engines.VLLM_ACTIVATIONS
        + seq * fm.kv_bytes_per_token(arch, elem=e, vllm_tp=ro.tensor_parallel)
    )
    if room >= need:
        util = math.floor(room / result.gpu_mem * 100) / 100
        return (
            f"--set rollout.engine.gpu_memory_utilization={util:.2f}: vLLM gets {gib(room)}, "
            f"{gib(room - need)} more than its weights, "
            f"one {seq}-token sequence of KV cache and 1 GiB working memory"
        )
    return (
        f"a smaller rollout.engine.gpu_memory_utilization cannot help: vLLM needs at least "
        f"{gib(need)} (weights, one {seq}-token sequence of KV cache, 1 GiB working "
        f"memory) and only {gib(max(room, 0))} is left beside the trainer"
    )


def _with(cfg: RunConfig, **sections) -> RunConfig:
    return dataclasses.replace(
        cfg, **{k: dataclasses.replace(getattr(cfg, k), **v) for k, v in sections.items()}
    )
