"""Workers of the LoRA tests (module-level so spawn can import them): PEFT on transformers as
the reference, megarl's adapters on megatron at a given layout: the policy (a causal LM), the
critic and the trained reward model (a one-label sequence classifier, its score head trained in
full), and fresh adapters (no PEFT directory) at each layout."""

from __future__ import annotations

import torch

from megarl.convert.layout import gather_full_state
from megarl.convert.mapping import canonical_to_hf
from megarl.convert.peft import load_peft, peft_tensors, save_peft
from megarl.convert.sharded import load_hf_sharded
from megarl.distributed import ParallelConfig, Topology
from megarl.models import forward, lora, vocab
from megarl.models.builder import BuildConfig, build_model
from megarl.models.hf_config import PrecisionConfig, arch_from_hf
from megarl.models.optim import OptimConfig, build_optimizer, wire_grad_finalization

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")  # a MoE model's adaptable linears


def peft_reference(
    rank, world, hf: dict, out: str, batch: dict, r: int, alpha: float, targets=TARGETS
):
    """An HF model and a PEFT adapter with non-zero B (written to out/hf, out/adapter), its
    logits, loss, adapter grads by PEFT key, and its merged weights by HF name."""
    import peft
    import transformers

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**hf)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    model.save_pretrained(f"{out}/hf")
    cfg = peft.LoraConfig(
        r=r, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False
    )
    model = peft.get_peft_model(model, cfg)
    model.save_pretrained(f"{out}/adapter")
    logits = model(input_ids=batch["tokens"]).logits.float()
    lp = torch.log_softmax(logits, -1).gather(-1, batch["targets"][..., None])[..., 0]
    loss = -(lp * batch["mask"]).sum() / batch["mask"].sum()
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        if "lora_" in name:  # ...q_proj.lora_A.default.weight -> PEFT's file key
            grads[name.replace(".default", "")] = p.grad.detach().clone()
    merged = {k: v.detach().clone() for k, v in model.merge_and_unload().state_dict().items()}
    return {"logits": logits.detach(), "loss": float(loss), "grads": grads, "merged": merged}


def actor_at(world, hf, out, batch, r, alpha, layout, ddp=None, targets=TARGETS):
    """(chunks, groups, micro-batches, loss_fn) of a LoRA actor at `layout`: the base from
    out/hf, the adapters from out/adapter."""
    arch = arch_from_hf(f"{out}/hf")  # as saved: transformers' defaults filled in (rope_theta)
    par = ParallelConfig(**layout)
    groups = Topology.for_model(par, world, arch).initialize(seed=0)
    cfg = lora.LoraConfig(rank=r, alpha=alpha, targets=targets)
    build = BuildConfig(lora=cfg)
    chunks = build_model(arch, par, PrecisionConfig(), role="actor", build=build, ddp_config=ddp)
    load_hf_sharded(chunks, arch, f"{out}/hf")
    load_peft(chunks, cfg, f"{out}/adapter")
    tokens = batch["mask"].sum()
    per = batch["tokens"].shape[0] // groups.dp_size
    idx = torch.arange(groups.dp_rank * per, (groups.dp_rank + 1) * per)
    mbs = [
        {k: batch[k][i] for k in ("tokens", "targets", "mask")} | {"idx": i} for i in idx.chunk(2)
    ]

    def loss_fn(mb, logits):
        lp = vocab.token_logprobs(
            logits, mb["targets"], vocab_size=arch.vocab_size, tp_group=groups.tp
        )
        loss = -(lp * mb["mask"]).sum() / tokens
        full = vocab.gather_vocab(logits.detach(), vocab_size=arch.vocab_size, tp_group=groups.tp)
        return loss, {"idx": mb["idx"], "logits": full, "loss": loss.detach()}

    return chunks, groups, mbs, loss_fn, cfg


def _logits(res, groups) -> dict:
    out = {}
    if groups.tp_rank == 0:
        for m in res:
            out.update(zip(m["idx"].tolist(), m["logits"], strict=True))
    return out


def megarl_side(
    rank, world, hf: dict, out: str, batch: dict, r: int, alpha: float, layout, targets=TARGETS
):
    """megarl's actor with LoRA at `layout`, its adapters from out/adapter: logits by sample
    (with the adapters on and off), adapter grads and merged HF weights (rank 0), the names of
    base parameters that train (none), the optimizer's element count, and the adapters written
    back as a PEFT directory (out/export-{world})."""
    from megatron.core.distributed import DistributedDataParallelConfig

    ddp = DistributedDataParallelConfig(use_distributed_optimizer=False, grad_reduce_in_fp32=True)
    chunks, groups, mbs, loss_fn, cfg = actor_at(
        world, hf, out, batch, r, alpha, layout, ddp, targets
    )
    arch = arch_from_hf(f"{out}/hf")
    wire_grad_finalization(chunks)
    dp = groups.dp_size
    res = forward.forward_backward(chunks, mbs, loss_fn, forward_only=False, dp_size=dp)
    grads = peft_tensors(chunks, grads=True)
    base_grads = [
        n
        for c in chunks
        for n, p in c.named_parameters()
        if p.requires_grad and not lora.is_lora(p)
    ]
    with lora.merged(chunks):
        full = gather_full_state(chunks)
    merged = dict(canonical_to_hf(arch, full.items())) if rank == 0 else {}
    with lora.disabled(chunks):
        base = forward.forward_backward(chunks, mbs, loss_fn, forward_only=True, dp_size=dp)
    opt, _ = build_optimizer(chunks, OptimConfig(lr=1e-2), dtype="fp32")
    n_opt = sum(p.numel() for g in opt.param_groups for p in g["params"])
    save_peft(chunks, cfg, f"{out}/export-{world}", base_model=f"{out}/hf")
    return {
        "logits": _logits(res, groups),
        "base_logits": _logits(base, groups),
        "grads": grads,
        "merged": merged,
        "base_grads": base_grads,
        "optimizer_numel": n_opt,
    }


def scalar_batch(hf: dict) -> dict:
    """Tokens without the pad id (0) and a weight per position: the loss sum(values x weights)
    reaches every position's value."""
    g = torch.Generator().manual_seed(3)
    return {
        "tokens": torch.randint(3, hf["vocab_size"], (4, 10), generator=g),
        "weights": torch.randn(4, 10, generator=g),
    }


def scalar_peft_reference(hf: dict, out: str, r: int, alpha: float) -> dict:
    """A one-label `LlamaForSequenceClassification` (out/cls, its score head perturbed off its
    init) and a PEFT SEQ_CLS adapter on it with non-zero B (out/cls-adapter; PEFT trains the
    `score` head in full, as megarl does a critic's or reward model's): the values (the score
    head at every position), transformers' own pooled score, and the gradients of
    sum(values x weights): the adapters' by PEFT key and the head's."""
    import peft
    import transformers

    batch = scalar_batch(hf)
    torch.manual_seed(1)
    config = transformers.AutoConfig.for_model(**hf, num_labels=1, pad_token_id=0)
    config.architectures = ["LlamaForSequenceClassification"]
    model = transformers.AutoModelForSequenceClassification.from_config(config).float()
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.3)
    model.save_pretrained(f"{out}/cls")
    cfg = peft.LoraConfig(
        task_type="SEQ_CLS", r=r, lora_alpha=alpha, target_modules=list(TARGETS),
        init_lora_weights=False,
    )  # fmt: skip
    model = peft.get_peft_model(model, cfg)
    model.save_pretrained(f"{out}/cls-adapter")
    inner = model.base_model.model  # the classifier, its linears adapted
    pooled = model(input_ids=batch["tokens"]).logits[:, 0].detach()
    values = inner.score(inner.model(input_ids=batch["tokens"]).last_hidden_state)[..., 0]
    (values * batch["weights"]).sum().backward()
    grads, head = {}, None
    for name, p in model.named_parameters():
        if "lora_" in name:
            grads[name.replace(".default", "")] = p.grad.detach().clone()
        elif p.requires_grad and "score" in name:
            head = p.grad.detach().clone()
    return {"values": values.detach(), "pooled": pooled, "grads": grads, "head": head}


def scalar_side(rank, world, hf: dict, out: str, r: int, alpha: float, layout, role: str):
    """megarl's `role` (critic: `critic_lora`; reward: `lora`, the reward-model stage's trained
    model) from out/cls with the adapters of out/cls-adapter, at `layout`: values by sample
    (rank 0 of the last stage's TP group), adapter grads by PEFT key, the head's grad, and the
    names of base parameters that train (none)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    batch = scalar_batch(hf)
    arch = arch_from_hf(f"{out}/cls")
    par = ParallelConfig(**layout)
    groups = Topology.for_model(par, world, arch).initialize(seed=0)
    cfg = lora.LoraConfig(rank=r, alpha=alpha)
    build = BuildConfig(lora=cfg) if role == "reward" else BuildConfig(critic_lora=cfg)
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=False, grad_reduce_in_fp32=True)
    chunks = build_model(arch, par, PrecisionConfig(), role=role, build=build, ddp_config=ddp)
    load_hf_sharded(chunks, arch, f"{out}/cls")
    load_peft(chunks, cfg, f"{out}/cls-adapter")
    wire_grad_finalization(chunks)
    per = batch["tokens"].shape[0] // groups.dp_size
    idx = torch.arange(groups.dp_rank * per, (groups.dp_rank + 1) * per)
    mbs = [
        {"tokens": batch["tokens"][i], "targets": batch["tokens"][i],
         "mask": torch.ones(len(i), 10), "weights": batch["weights"][i], "idx": i}
        for i in idx.chunk(2)
    ]  # fmt: skip

    def loss_fn(mb, values):
        values = values.reshape(mb["weights"].shape).float()
        return (values * mb["weights"]).sum(), {"idx": mb["idx"], "logits": values.detach()}

    dp = groups.dp_size
    res = forward.forward_backward(chunks, mbs, loss_fn, forward_only=False, dp_size=dp)
    grads = peft_tensors(chunks, grads=True)
    head = "output_layer.weight"
    heads = [p for c in chunks for n, p in c.named_parameters() if n.endswith(head)]
    trained = [
        n
        for c in chunks
        for n, p in c.named_parameters()
        if p.requires_grad and not lora.is_lora(p) and not n.endswith(head)
    ]
    return {
        "values": _logits(res, groups),
        "grads": grads,
        "head": heads[0].main_grad.detach().clone().reshape(-1) if heads else None,
        "base_grads": trained,
    }


def fresh_adapters(rank, world, hf: dict, out: str, layout) -> dict:
    """The adapters of an actor built with `model.lora` and no `init_from` (trainer.seed 7) at
    `layout`, whole, by PEFT key (rank 0)."""
    arch = arch_from_hf(f"{out}/hf")
    par = ParallelConfig(**layout)
    Topology.for_model(par, world, arch).initialize(seed=0)
    build = BuildConfig(lora=lora.LoraConfig(rank=4, alpha=8.0), lora_seed=7)
    chunks = build_model(arch, par, PrecisionConfig(), role="actor", build=build)
    return peft_tensors(chunks)


def single_rank(rank, world, hf: dict, out: str, batch: dict, r: int, alpha: float, moe: dict):
    """`peft_reference` and `megarl_side` at one rank, in one process; also of the MoE model
    `moe` with attention adapters (in out/moe): {"moe": (reference, one rank)}; and the scalar
    models' reference and megarl's critic and reward model, and fresh adapters, at one rank."""
    ref = peft_reference(rank, world, hf, out, batch, r, alpha)
    one = megarl_side(rank, world, hf, out, batch, r, alpha, {})
    moe_ref = peft_reference(rank, world, moe, f"{out}/moe", batch, r, alpha, ATTENTION)
    moe_one = megarl_side(rank, world, moe, f"{out}/moe", batch, r, alpha, {}, ATTENTION)
    scalar = {"reference": scalar_peft_reference(hf, out, r, alpha)}
    for role in ("critic", "reward"):
        scalar[role] = scalar_side(rank, world, hf, out, r, alpha, {}, role)
    one["fresh"] = fresh_adapters(rank, world, hf, out, {})
    return ref, one, moe_ref, moe_one, scalar


DP2 = {}  # two ranks, nothing else split
TP2_SP = {"tensor_parallel": 2, "sequence_parallel": True}
PP2 = {"pipeline_parallel": 2}
PP2_VPP2 = {"pipeline_parallel": 2, "virtual_pipeline_parallel": 2}  # one layer per chunk


def two_ranks(rank, world, hf: dict, out: str, batch: dict, r: int, alpha: float, moe: dict):
    """`megarl_side` at DP2, TP2 + SP, PP2 and PP2 x VPP2, the MoE model's at EP2 (its experts
    split, the rest DP2), and `resume_elsewhere`, in one pair of processes."""
    layouts = {
        n: megarl_side(rank, world, hf, out, batch, r, alpha, lay)
        for n, lay in (("dp2", DP2), ("tp2-sp", TP2_SP), ("pp2", PP2), ("pp2-vpp2", PP2_VPP2))
    }
    layouts["moe-ep2"] = megarl_side(
        rank, world, moe, f"{out}/moe", batch, r, alpha, {"expert_parallel": 2}, ATTENTION
    )
    for role in ("critic", "reward"):  # the layout of test_lora_stages' PPO run
        layouts[f"{role}-tp2-sp"] = scalar_side(rank, world, hf, out, r, alpha, TP2_SP, role)
    layouts["fresh"] = {
        n: fresh_adapters(rank, world, hf, out, lay)
        for n, lay in (("dp2", DP2), ("tp2-sp", TP2_SP), ("pp2", PP2), ("pp2-vpp2", PP2_VPP2))
    }
    return layouts, resume_elsewhere(rank, world, hf, out, batch, r, alpha)


def _adam_step(chunks, opt, mbs, loss_fn, groups) -> None:
    for c in chunks:
        c.zero_grad_buffer()
    opt.zero_grad()
    forward.forward_backward(chunks, mbs, loss_fn, forward_only=False, dp_size=groups.dp_size)
    opt.step()


def resume_elsewhere(rank, world, hf: dict, out: str, batch: dict, r: int, alpha: float):
    """One Adam step at TP2 + SP, a checkpoint, a second step; the checkpoint loaded at PP2 and
    the same second step: {layout: adapters after the second step} (rank 0)."""
    from megarl.checkpoint.training import load_models, save

    after = {}
    for name, layout in (("tp2-sp", TP2_SP), ("pp2", PP2)):
        chunks, groups, mbs, loss_fn, _ = actor_at(world, hf, out, batch, r, alpha, layout)
        opt, _ = build_optimizer(chunks, OptimConfig(lr=1e-2), dtype="fp32")
        models = {"actor": (chunks, opt)}

        if name == "tp2-sp":
            _adam_step(chunks, opt, mbs, loss_fn, groups)
            # what a LoRA run's checkpoint records besides the adapters (the model source's
            # architecture, the data order): a later stage reads them
            state = {"step": 1, "arch": arch_from_hf(f"{out}/hf").hf_config, "sampler": {}}
            save(f"{out}/run", 1, models, state, keep_last=0)
        else:
            load_models(f"{out}/run/checkpoints/step_000001", models)
        _adam_step(chunks, opt, mbs, loss_fn, groups)
        after[name] = peft_tensors(chunks)
        after[f"{name}/fingerprint"] = lora.base_fingerprint(chunks)
    # another base under the same adapters: a resume refuses it, naming the checkpoint
    from megarl.config import load_config
    from megarl.trainer.run import check_lora_base

    with torch.no_grad():
        next(p for n, p in chunks[0].named_parameters() if "linear_fc2.weight" in n).add_(1e-3)
    cfg = load_config(overrides=["model.lora.rank=4"])
    try:
        check_lora_base(
            f"{out}/run/checkpoints/step_000001", "actor", after["pp2/fingerprint"], chunks, cfg
        )
        after["other base"] = None
    except Exception as e:
        after["other base"] = f"{type(e).__name__}: {e}"
    return after
