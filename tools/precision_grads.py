"""How much of a policy-gradient step a precision keeps: the gradient of one GRPO-shaped loss on
the same sampled batch and the same (bf16-rounded) weights, computed by megarl's trainer in fp32
and in each 16-bit setting, compared with the fp32 one.

    python tools/precision_grads.py --hf models/smollm2 \
        --data examples/data/smollm2_arith_train.jsonl [--prompts 16 --n 4 --json OUT]

vLLM (bf16) samples `--n` completions of `--prompts` chat prompts at temperature 1; each group
gets seeded 0/1 rewards, normalised per group (GRPO's advantages); the loss is the token-mean of
-advantage x logprob over the completions, micro-batches of 16 as the example trains. Printed
per setting: the cosine of its gradient with fp32's, the relative error |g - g32| / |g32|, and
the sign agreement weighted by |g32| (Adam's first step moves each weight by lr x sign(g): a
disagreeing sign is a step the wrong way), over all parameters and per kind (linear, norms,
embedding).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.join(ROOT, "tools")):
    if path not in sys.path:
        sys.path.insert(0, path)

SETTINGS = {
    "fp32": {"dtype": "fp32"},
    "bf16": {"dtype": "bf16"},
    "bf16+res32": {"dtype": "bf16", "fp32_residual": True},
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--settings", nargs="+", default=list(SETTINGS))
    p.add_argument("--json")
    return p.parse_args(argv)


def grads_job(rank, world, hf: str, seqs, starts, advantages, precision: dict) -> dict:
    """Full gradient of the loss (module doc) under `precision`, on the bf16-rounded weights."""
    from megarl.config import ParallelConfig
    from megarl.convert.layout import gather_full_state
    from megarl.convert.sharded import load_hf_sharded
    from megarl.distributed import Topology
    from megarl.models import forward, vocab
    from megarl.models.builder import build_model
    from megarl.models.hf_config import PrecisionConfig, arch_from_hf
    from megarl.models.optim import wire_grad_finalization
    from megarl.trainer import experience as xp

    arch = arch_from_hf(os.path.join(hf, "config.json"))
    parallel = ParallelConfig()
    Topology.for_model(parallel, world, arch).initialize(seed=0)
    model = build_model(arch, parallel, PrecisionConfig(**precision), role="actor")
    load_hf_sharded(model, arch, hf)
    with torch.no_grad():
        for p in model[0].parameters():
            p.copy_(p.to(torch.bfloat16).to(p.dtype))
    wire_grad_finalization(model)
    prompts = [s[:st] for s, st in zip(seqs, starts, strict=True)]
    responses = [s[st:] for s, st in zip(seqs, starts, strict=True)]
    batch = xp.build_batch(prompts, responses, [[0.0] * len(r) for r in responses], pad_id=0,
                           pad_to=1)  # fmt: skip
    adv = torch.tensor(advantages)[:, None] * batch.loss_mask
    tokens = batch.loss_mask.sum()
    mbs = [
        {"tokens": batch.tokens[rows], "targets": batch.targets[rows], "adv": adv[rows]}
        for rows in torch.arange(len(seqs)).split(16)
    ]

    def loss_fn(mb, out):
        lp = vocab.token_logprobs(out, mb["targets"], vocab_size=arch.vocab_size, tp_group=None)
        loss = -(lp.float() * mb["adv"]).sum() / tokens
        return loss, {"loss": loss.detach()}

    forward.forward_backward(model, mbs, loss_fn, forward_only=False, dp_size=1)
    return {k: v.float() for k, v in gather_full_state(model, grads=True).items()}


def _kind(name: str) -> str:
    if "norm" in name:
        return "norms"
    return "embedding" if "embedding" in name else "linear"


def compare(g: dict, ref: dict) -> dict:
    out = {}
    for kind in ("all", "linear", "norms", "embedding"):
        names = [n for n in ref if kind == "all" or _kind(n) == kind]
        if not names:
            continue
        a = torch.cat([g[n].flatten() for n in names]).double()
        b = torch.cat([ref[n].flatten() for n in names]).double()
        agree = (torch.sign(a) == torch.sign(b)).float()
        out[kind] = {
            "cosine": float(torch.nn.functional.cosine_similarity(a, b, dim=0)),
            "rel_err": float((a - b).norm() / b.norm()),
            "sign_agreement": float((agree * b.abs()).sum() / b.abs().sum()),
        }
    return out


def main(argv=None) -> int:
    from precision_gap import sample_vllm
    from transformers import AutoTokenizer

    from megarl.data import DataConfig, PromptDataset
    from megarl.distributed.launch import spawn

    args = parse_args(argv)
    tok = AutoTokenizer.from_pretrained(args.hf)
    ds = PromptDataset.from_config(DataConfig(path=args.data, shuffle=False), tok)
    prompt_ids = [list(ds.prompt_ids[i]) for i in range(min(args.prompts, len(ds)))]
    ids, _, owner = sample_vllm(
        args.hf, prompt_ids, args.n, args.max_tokens, args.seed, stop=[tok.eos_token_id]
    )
    seqs = [prompt_ids[o] + c for o, c in zip(owner, ids, strict=True)]
    starts = [len(prompt_ids[o]) for o in owner]
    g = torch.Generator().manual_seed(args.seed)
    rewards = torch.randint(0, 2, (len(seqs),), generator=g).float().view(-1, args.n)
    adv = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)
    grads = {
        name: spawn(grads_job, 1, args.hf, seqs, starts, adv.flatten().tolist(), SETTINGS[name])[0]
        for name in args.settings
    }
    table = {name: compare(g, grads["fp32"]) for name, g in grads.items() if name != "fp32"}
    print(f"{len(seqs)} sequences; gradient against fp32's on the same weights and batch")
    for name, row in table.items():
        for kind, r in row.items():
            print(f"{name:12s} {kind:10s} cosine {r['cosine']:.4f}  rel err {r['rel_err']:.3f}  "
                  f"sign agreement (|g32|-weighted) {r['sign_agreement']:.3f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
