"""Workers and references for the offline-loss parity tests (module-level so spawn imports them).

`hf_reference` computes each variant's loss, metrics and gradients with transformers'
LlamaForCausalLM in fp32, written out from the formulas (not through megarl's loss code);
`megarl_step` runs the same batch through megarl's offline stage at one layout (the real stage
objects, micro-batching and megatron schedule) and returns the same figures, the gradients
mapped back to HF names.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F

# a tiny Llama: GQA, a vocabulary megatron pads (250 -> 256), untied head
HF = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=250,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    hidden_act="silu",
)
BETA = 0.3
GAMMA = 0.4
# name -> algorithm overrides; every variant of the sft / dpo registry, and the options
VARIANTS = {
    "sft": {"algorithm.name": "sft"},
    "dpo-sigmoid": {"algorithm.name": "dpo", "algorithm.dpo_loss": "sigmoid"},
    "dpo-cdpo-lennorm": {
        "algorithm.name": "dpo",
        "algorithm.dpo_loss": "sigmoid",
        "algorithm.dpo_label_smoothing": 0.1,
        "algorithm.dpo_length_norm": True,
    },
    # IPO on mean token logprobs, as TRL runs it: on sums its loss is 5.5 here and squares
    # the summed logprobs' fp32 round-off (7e-6 of absolute error seen at TP2, near the bar)
    "dpo-ipo-lennorm": {
        "algorithm.name": "dpo",
        "algorithm.dpo_loss": "ipo",
        "algorithm.dpo_length_norm": True,
    },
    "dpo-hinge": {"algorithm.name": "dpo", "algorithm.dpo_loss": "hinge"},
    "simpo": {
        "algorithm.name": "dpo",
        "algorithm.dpo_loss": "simpo",
        "algorithm.dpo_label_smoothing": 0.05,
    },
}


def write_models(root: str) -> dict[str, str]:
    """Policy and reference HF directories (the reference a perturbed policy, so the DPO
    rewards are not 0)."""
    import os

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**{k: v for k, v in HF.items() if k != "architectures"})
    cfg.architectures = HF["architectures"]
    policy = LlamaForCausalLM(cfg).float()
    with torch.no_grad():  # norms start at 1: perturb everything
        for p in policy.parameters():
            p.add_(0.02 * torch.randn_like(p))
    ref = LlamaForCausalLM(cfg).float()
    ref.load_state_dict(policy.state_dict())
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    dirs = {"policy": os.path.join(root, "policy"), "reference": os.path.join(root, "ref")}
    policy.save_pretrained(dirs["policy"], safe_serialization=True)
    ref.save_pretrained(dirs["reference"], safe_serialization=True)
    return dirs


def sequences(kind: str) -> list[tuple[list[int], list[bool]]]:
    """Fixed token sequences with their trained flags: SFT rows with several trained spans, or
    4 preference pairs (chosen, rejected per pair: a shared prompt, responses of different
    lengths)."""
    g = torch.Generator().manual_seed(3)
    out = []
    if kind == "sft":
        for n in (9, 5, 13, 7, 4, 11):
            ids = torch.randint(3, 250, (n,), generator=g).tolist()
            trained = [False] * n
            for t in range(1, n):  # two trained spans where the row is long enough
                trained[t] = (2 <= t < 5) or t >= n - 3
            out.append((ids, trained))
        return out
    for p_len, c_len, r_len in ((4, 3, 5), (2, 6, 2), (6, 2, 4), (3, 4, 4)):
        prompt = torch.randint(3, 250, (p_len,), generator=g).tolist()
        for n in (c_len, r_len):
            resp = torch.randint(3, 250, (n,), generator=g).tolist()
            out.append((prompt + resp, [False] * p_len + [True] * n))
    return out


def _token_logprobs(model, seqs):
    width = max(len(s) for s, _ in seqs)
    tokens = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width)
    for b, (ids, trained) in enumerate(seqs):
        tokens[b, : len(ids)] = torch.tensor(ids)
        mask[b, : len(ids) - 1] = torch.tensor(trained[1:], dtype=torch.float32)
    logits = model(input_ids=tokens).logits.float()[:, :-1]
    targets = tokens[:, 1:]
    lp = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    correct = logits.argmax(-1) == targets
    return lp, mask[:, :-1], correct


def hf_reference(dirs: dict, variant: str) -> dict:
    """Loss, metrics and gradients (HF names) of `variant` on the fixed batch, transformers."""
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    over = VARIANTS[variant]
    policy = LlamaForCausalLM.from_pretrained(dirs["policy"], torch_dtype=torch.float32)
    if over["algorithm.name"] == "sft":
        seqs = sequences("sft")
        lp, mask, correct = _token_logprobs(policy, seqs)
        n = mask.sum()
        loss = -(lp * mask).sum() / n
        metrics = {"token_accuracy": float((correct * mask).sum() / n), "ppl": math.exp(loss)}
    else:
        seqs = sequences("dpo")
        kind = over.get("algorithm.dpo_loss")
        eps = over.get("algorithm.dpo_label_smoothing", 0.0)
        mean = over.get("algorithm.dpo_length_norm", False) or kind == "simpo"

        def seq_logps(model):
            lp, mask, _ = _token_logprobs(model, seqs)
            s = (lp * mask).sum(-1)
            return s / mask.sum(-1) if mean else s

        pi = seq_logps(policy)
        pc, pr = pi[0::2], pi[1::2]
        if kind == "simpo":
            rc, rr = torch.zeros_like(pc), torch.zeros_like(pr)
        else:
            ref_model = LlamaForCausalLM.from_pretrained(
                dirs["reference"], torch_dtype=torch.float32
            )
            with torch.no_grad():
                ref = seq_logps(ref_model)
            rc, rr = ref[0::2], ref[1::2]
        h = (pc - rc) - (pr - rr)
        if kind in ("sigmoid", "simpo"):
            z = BETA * h - (GAMMA if kind == "simpo" else 0.0)
            losses = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
        elif kind == "ipo":
            losses = (h - 1 / (2 * BETA)) ** 2
        else:
            losses = torch.relu(1 - BETA * h)
        loss = losses.mean()
        chosen_r, rejected_r = BETA * (pc - rc).detach(), BETA * (pr - rr).detach()
        metrics = {
            "rewards/chosen": float(chosen_r.mean()),
            "rewards/rejected": float(rejected_r.mean()),
            "rewards/margins": float((chosen_r - rejected_r).mean()),
            "rewards/accuracies": float((chosen_r > rejected_r).float().mean()),
            "logps/chosen": float(pc.mean()),
            "logps/rejected": float(pr.mean()),
            "preference_accuracy": float((pc > pr).float().mean()),
        }
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in policy.named_parameters()}
    return {"loss": float(loss), "metrics": metrics, "grads": grads}


def megarl_step(rank, world, dirs: dict, layout: dict, variants: list[str], sizes: list[int]):
    """Per (variant, micro-batch size): the step's global loss and metrics (on every rank) and
    the full gradients in HF names (rank 0) from megarl's offline stage at `layout`."""
    from megatron.core.distributed import DistributedDataParallelConfig

    from megarl.config import load_config
    from megarl.convert.layout import gather_full_state
    from megarl.convert.mapping import canonical_to_hf
    from megarl.convert.sharded import load_hf_sharded
    from megarl.data.batch import MicroBatching
    from megarl.data.offline import PreferenceDataset, SFTDataset, Tokens
    from megarl.distributed import Topology
    from megarl.models import forward
    from megarl.models.builder import build_model
    from megarl.models.hf_config import arch_from_hf
    from megarl.models.optim import wire_grad_finalization, zero_grads
    from megarl.trainer import offline
    from megarl.trainer.models import Models, Trained
    from megarl.trainer.stages import get_stage
    from megarl.trainer.update import step_metrics

    torch.set_num_threads(1)
    arch = arch_from_hf(dirs["policy"])
    par = [f"parallel.{k}={v}" for k, v in layout.items()]
    base = load_config(None, par)
    groups = Topology.for_model(base.parallel, world, arch).initialize(seed=0)
    # the models once per layout; each variant starts from zero grads on the same weights
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=False, grad_reduce_in_fp32=True)
    actor = build_model(arch, base.parallel, base.precision, role="actor", ddp_config=ddp)
    load_hf_sharded(actor, arch, dirs["policy"])
    wire_grad_finalization(actor)
    reference = build_model(arch, base.parallel, base.precision, role="reference")
    load_hf_sharded(reference, arch, dirs["reference"])
    results = {}
    for variant, micro_batch_size in [(v, m) for v in variants for m in sizes]:
        over = {
            **VARIANTS[variant],
            "algorithm.dpo_beta": BETA,
            "algorithm.simpo_gamma": GAMMA,
            "algorithm.micro_batch_size": micro_batch_size,
        }
        cfg = load_config(None, [f"{k}={v}" for k, v in over.items()] + par)
        stage = get_stage(cfg.algorithm)
        if cfg.algorithm.name == "sft":
            seqs = [Tokens(i, t) for i, t in sequences("sft")]
            dataset = SFTDataset(seqs, list(range(len(seqs))), "<test>", (0, 0))
        else:
            seqs = [Tokens(i, t) for i, t in sequences("dpo")]
            dataset = PreferenceDataset(
                seqs[0::2], seqs[1::2], [None] * 4, list(range(4)), "<test>", (0, 0)
            )
        run = SimpleNamespace(
            cfg=cfg,
            arch=arch,
            groups=groups,
            tokenizer=SimpleNamespace(pad_token_id=0, eos_token_id=2),
            pad_to=forward.sequence_multiple(
                groups.tp_size,
                cfg.parallel.sequence_parallel,
                cfg.precision.fp8 and cfg.precision.fp8_recipe,
            ),  # Run.pad_to
            models=Models(
                actor=Trained(actor, None, None), reference=reference if stage.reference else None
            ),
            data=SimpleNamespace(dataset=dataset),
        )
        run.micro_batching = MicroBatching.of(cfg.algorithm, pad_to=run.pad_to)
        rows = list(range(len(dataset)))
        share = len(rows) // groups.dp_size  # the sampler's contiguous share of the step
        mine = rows[groups.dp_rank * share : (groups.dp_rank + 1) * share]
        batch = dataset.batch(mine, pad_id=0, pad_to=run.pad_to)
        batch["global_indices"] = rows
        stage.prepare(run, batch)
        zero_grads(actor)
        out = forward.forward_backward(
            actor,
            offline._micro_batches(run, stage, batch),
            stage.loss_fn(run, stage.denominator(dataset, rows)),
            forward_only=False,
            dp_size=groups.dp_size,
        )
        metrics = offline.collect_metrics(run, stage, batch, step_metrics(out, 1))
        full = gather_full_state(actor, grads=True)
        grads = dict(canonical_to_hf(arch, full.items())) if rank == 0 else {}
        results[variant, micro_batch_size] = {"metrics": metrics, "grads": grads}
    return results
