"""Where bf16 differs from fp32 in RL training, measured on a real model: the logprobs of the
trainer, the sampler and transformers on the same weights (`logprobs`), and what the bf16 weights
see of the fp32 master weights' updates (`updates`).

    python tools/precision_gap.py logprobs --hf models/smollm2 \
        --data examples/data/smollm2_arith_train.jsonl [--prompts 16 --n 4 --json OUT]
    python tools/precision_gap.py updates examples/grpo_smollm2_arith_cpu.yaml --steps 8 \
        [--set precision.dtype=bf16 ...] [--json OUT]

`logprobs`:

1. The HF model's weights are rounded to bf16 once (round to nearest even, as every loader here
   does); all systems below compute with exactly those weights.
2. vLLM (bf16, in this process) samples `--n` completions of `--prompts` chat prompts at
   temperature 1 and returns its per-token logprobs (`processed_logprobs`, what the trainer's
   `logprob_mismatch` compares against).
3. The same tokens are scored teacher-forced by transformers (bf16, and fp32 on the bf16-rounded
   weights: the reference), by megatron through megarl's own forward (bf16, and fp32), and by both
   bf16 models with the LM head (the logits GEMM) in fp32.
4. It prints, for each system, mean and max |logprob - reference| and |logprob - vLLM bf16| over
   the completion tokens. If megatron-vs-transformers is as large as megatron-vs-vLLM, the
   trainer-vs-sampler gap is bf16 arithmetic (two correct bf16 forwards differing in rounding
   order), not a defect of either.

`updates`: runs `megarl train CONFIG` (one process) for `--steps` steps and after every update
compares the actor's weights with those before the first: per parameter kind (linear weights,
embedding, norms), the fraction of elements of the compute weights (bf16: the model's copy) that
differ from their starting value, the mean |change| of the fp32 master weights over the learning
rate, the ratio of the compute weights' change to the masters' (L2), and whether every compute
weight equals its master rounded to bf16 (megatron's refresh after each step).

Assumes a Llama-family HF directory that transformers, vLLM and megarl all load; one process, CPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def parse_args(argv=None):
    top = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = top.add_subparsers(dest="command", required=True)
    u = sub.add_parser("updates", help="what the compute weights see of the masters' updates")
    u.add_argument("config", help="a megarl run config (one process)")
    u.add_argument("--steps", type=int, default=8, help="RL steps to run")
    u.add_argument("--set", dest="overrides", action="append", default=[], help="KEY=VALUE")
    u.add_argument("--out", default=None, help="run directory (default: a temporary one)")
    u.add_argument("--json", help="write the per-step figures to this JSON file")
    p = sub.add_parser("logprobs", help="bf16 logprob gaps on the same weights")
    p.add_argument("--hf", required=True, help="HF model directory")
    p.add_argument("--data", required=True, help="prompt file (data.path form: prompt column)")
    p.add_argument("--prompts", type=int, default=16, help="prompts to sample from (file order)")
    p.add_argument("--n", type=int, default=4, help="completions per prompt")
    p.add_argument("--max-tokens", type=int, default=48, help="longest completion")
    p.add_argument("--seed", type=int, default=0, help="vLLM's sampling seed")
    p.add_argument("--json", help="write the figures to this JSON file")
    return top.parse_args(argv)


def sample_vllm(
    hf: str, prompt_ids: list[list[int]], n: int, max_tokens: int, seed: int, stop: list[int]
):
    """(completion token ids, vLLM bf16 logprobs of them) per sample; prompts repeated n times;
    each completion ends at a token of `stop` (the model's EOS: vLLM has no tokenizer here)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=hf,
        dtype="bfloat16",
        enforce_eager=True,
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=256 * 2**20,
        max_model_len=512,
        enable_chunked_prefill=False,
        max_num_batched_tokens=4096,
        logprobs_mode="processed_logprobs",
        disable_log_stats=True,
        seed=seed,
    )
    params = SamplingParams(
        n=n,
        temperature=1.0,
        max_tokens=max_tokens,
        logprobs=0,
        seed=seed,
        detokenize=False,
        stop_token_ids=stop,
    )
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params)
    ids, lps, owner = [], [], []
    for i, o in enumerate(outs):
        for c in o.outputs:
            ids.append(list(c.token_ids))
            lps.append([next(iter(d.values())).logprob for d in c.logprobs])
            owner.append(i)
    del llm
    gc.collect()
    return ids, lps, owner


def hf_logprobs(model, seqs: list[list[int]], starts: list[int], fp32_head: bool) -> list:
    """Teacher-forced logprobs of seqs[b][starts[b]:] under an HF causal LM (one row at a time:
    no padding, so no padding-dependent kernels). fp32_head: the logits GEMM in fp32."""
    out = []
    with torch.no_grad():
        for seq, start in zip(seqs, starts, strict=True):
            ids = torch.tensor([seq])
            hidden = model.model(input_ids=ids).last_hidden_state
            w = model.lm_head.weight
            logits = hidden.float() @ w.float().t() if fp32_head else model.lm_head(hidden)
            lp = torch.log_softmax(logits.float(), dim=-1)[0, :-1]
            tgt = ids[0, 1:]
            out.append(lp.gather(-1, tgt[:, None])[:, 0][start - 1 :].tolist())
    return out


def megatron_job(rank: int, world: int, hf: str, seqs, starts, dtype: str, fp32_head: bool):
    """Teacher-forced logprobs through megarl's trainer forward (`forward_logprobs`), one row per
    micro-batch; fp32 loads the bf16-rounded weights."""
    from megarl.config import ParallelConfig
    from megarl.convert.sharded import load_hf_sharded
    from megarl.distributed import Topology
    from megarl.models.builder import build_model, unwrap
    from megarl.models.hf_config import PrecisionConfig, arch_from_hf
    from megarl.trainer import experience as xp

    arch = arch_from_hf(os.path.join(hf, "config.json"))
    parallel = ParallelConfig()
    groups = Topology.for_model(parallel, world, arch).initialize(seed=0)
    chunks = build_model(arch, parallel, PrecisionConfig(dtype=dtype), role="reference")
    load_hf_sharded(chunks, arch, hf)
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.copy_(p.to(torch.bfloat16).to(p.dtype))  # fp32: the bf16-rounded weights
    if fp32_head:
        _fp32_output_layer(unwrap(chunks[0]))
    prompts = [s[:st] for s, st in zip(seqs, starts, strict=True)]
    responses = [s[st:] for s, st in zip(seqs, starts, strict=True)]
    batch = xp.build_batch(prompts, responses, [[0.0] * len(r) for r in responses], pad_id=0,
                           pad_to=1)  # fmt: skip
    lp = xp.forward_logprobs(chunks, batch.fields(), micro_batch_size=1, vocab_size=arch.vocab_size,
                             groups=groups, temperature=1.0)  # fmt: skip
    mask = batch.loss_mask.bool()
    return [lp[b][mask[b]].tolist() for b in range(len(seqs))]


def _fp32_output_layer(model) -> None:
    """The output layer's GEMM in fp32 (its bf16 weight upcast): logits without bf16 rounding."""
    layer = model.output_layer

    def forward(hidden, weight=None, runtime_gather_output=None):
        w = layer.weight if weight is None else weight
        return hidden.float() @ w.float().t(), None

    layer.forward = forward


def gap(a: list[list[float]], b: list[list[float]]) -> dict:
    d = torch.cat([torch.tensor(x) - torch.tensor(y) for x, y in zip(a, b, strict=True)]).abs()
    return {"mean": float(d.mean()), "max": float(d.max()), "tokens": d.numel()}


def _kind(name: str) -> str:
    if "layernorm" in name or name.endswith("final_layernorm.weight") or "norm" in name:
        return "norms"
    return "embedding" if "embedding" in name else "linear"


def updates(args) -> int:
    """`updates`: train CONFIG for --steps steps, measuring after every update (module doc)."""
    import tempfile

    import megarl.trainer.loop as loop
    from megarl.config import load_config
    from megarl.distributed.process_group import init_distributed
    from megarl.models.builder import unwrap

    cfg = load_config(args.config, [*args.overrides, f"trainer.steps={args.steps}",
                                    "trainer.save_every=0", "logging.progress=false"])  # fmt: skip
    lr = cfg.optim.lr
    records: list[dict] = []
    start: dict = {}
    original = loop.update

    def masters_of(run) -> dict[int, torch.Tensor]:
        opt = run.models.actor.opt
        inner = getattr(opt, "chained_optimizers", [opt])
        out = {}
        for o in inner:
            if not hasattr(o, "shard_fp32_from_float16_groups"):  # fp32: the params are masters
                return {}
            for mg, fg in zip(
                o.model_float16_groups, o.shard_fp32_from_float16_groups, strict=True
            ):
                for m, f in zip(mg, fg, strict=True):
                    out[id(m)] = f
        return out

    def measured(run, batch):
        model = unwrap(run.models.actor.chunks[0])
        named = dict(model.named_parameters())
        if not start:
            masters = masters_of(run)
            for n, p in named.items():
                master = masters.get(id(p), p)
                start[n] = (p.detach().clone(), master.detach().clone().view(p.shape))
        result = original(run, batch)
        masters = masters_of(run)
        kinds: dict[str, dict] = {}
        refreshed = True
        for n, p in named.items():
            p0, m0 = start[n]
            m = masters.get(id(p), p).detach().view(p.shape)
            k = kinds.setdefault(_kind(n), {"elements": 0, "changed": 0, "master_moved": 0.0,
                                            "compute_l2": 0.0, "master_l2": 0.0})  # fmt: skip
            dp = p.detach().float() - p0.float()
            dm = m.float() - m0.float()
            k["elements"] += p.numel()
            k["changed"] += int((dp != 0).sum())
            k["master_moved"] += float(dm.abs().sum())
            k["compute_l2"] += float(dp.square().sum())
            k["master_l2"] += float(dm.square().sum())
            if p.dtype != torch.float32:
                refreshed &= torch.equal(p.detach(), m.to(p.dtype))
        row = {"step": run.step + 1, "dtype": cfg.precision.dtype, "refreshed": refreshed}
        for name, k in kinds.items():
            row[name] = {
                "changed_fraction": k["changed"] / k["elements"],
                "master_mean_move_over_lr": k["master_moved"] / k["elements"] / lr,
                "compute_over_master_l2": (k["compute_l2"] / k["master_l2"]) ** 0.5
                if k["master_l2"]
                else float("nan"),
            }
        records.append(row)
        print(json.dumps(row), flush=True)
        return result

    loop.update = measured
    init_distributed(None)
    with tempfile.TemporaryDirectory(prefix="precision_gap_") as tmp:
        loop.train(cfg, args.out or tmp)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.command == "updates":
        return updates(args)
    return logprobs(args)


def sampled(args) -> tuple[list[list[int]], list[int], list[list[float]]]:
    """(prompt + completion ids, where each completion starts, vLLM's logprobs of it) for the
    first `args.prompts` chat prompts of `args.data`, `args.n` completions each."""
    from transformers import AutoTokenizer

    from megarl.data import DataConfig, PromptDataset

    tok = AutoTokenizer.from_pretrained(args.hf)
    ds = PromptDataset.from_config(DataConfig(path=args.data, shuffle=False), tok)
    prompt_ids = [list(ds.prompt_ids[i]) for i in range(min(args.prompts, len(ds)))]
    ids, vllm_lp, owner = sample_vllm(
        args.hf, prompt_ids, args.n, args.max_tokens, args.seed, stop=[tok.eos_token_id]
    )
    seqs = [prompt_ids[o] + c for o, c in zip(owner, ids, strict=True)]
    return seqs, [len(prompt_ids[o]) for o in owner], vllm_lp


def logprobs(args) -> int:
    from transformers import AutoModelForCausalLM

    from megarl.distributed.launch import spawn

    seqs, starts, vllm_lp = sampled(args)
    results = {"vllm_bf16": vllm_lp}
    # fp32 compute on the bf16-rounded weights. Only the parameters are rounded: casting the
    # whole module would also round its rope buffer (inv_freq), which no system here does
    ref = AutoModelForCausalLM.from_pretrained(args.hf, dtype=torch.float32)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    results["transformers_fp32"] = hf_logprobs(ref, seqs, starts, fp32_head=False)
    del ref
    bf16 = AutoModelForCausalLM.from_pretrained(args.hf, dtype=torch.bfloat16)  # as users load
    results["transformers_bf16"] = hf_logprobs(bf16, seqs, starts, fp32_head=False)
    results["transformers_bf16_fp32_head"] = hf_logprobs(bf16, seqs, starts, fp32_head=True)
    del bf16
    gc.collect()
    for dtype, head, name in (
        ("fp32", False, "megatron_fp32"),
        ("bf16", False, "megatron_bf16"),
        ("bf16", True, "megatron_bf16_fp32_head"),
    ):
        results[name] = spawn(megatron_job, 1, args.hf, seqs, starts, dtype, head)[0]
    reference = results["transformers_fp32"]
    table = {
        name: {"vs_fp32": gap(lp, reference), "vs_vllm_bf16": gap(lp, results["vllm_bf16"])}
        for name, lp in results.items()
    }
    table["megatron_bf16"]["vs_transformers_bf16"] = gap(
        results["megatron_bf16"], results["transformers_bf16"]
    )
    print(f"{len(seqs)} sequences, {table['vllm_bf16']['vs_fp32']['tokens']} completion tokens")
    print(f"{'system':30s} {'vs fp32 mean / max':>22s} {'vs vLLM bf16 mean / max':>26s}")
    for name, row in table.items():
        a, b = row["vs_fp32"], row["vs_vllm_bf16"]
        print(f"{name:30s} {a['mean']:10.2e} / {a['max']:8.2e} {b['mean']:12.2e} / {b['max']:8.2e}")
    mt = table["megatron_bf16"]["vs_transformers_bf16"]
    print(f"megatron_bf16 vs transformers_bf16: {mt['mean']:.2e} / {mt['max']:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
