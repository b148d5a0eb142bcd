"""Workers and references for the reward-model tests (module-level so spawn imports them).

`write_models` saves tiny random `LlamaForSequenceClassification` directories (one whose
`pad_token_id` is its EOS, one with a pad token of its own); `hf_scores` / `hf_bradley_terry`
compute, with transformers in fp32, the scores of a fixed right-padded batch (the model's own
`logits`: transformers picks the position) and one Bradley-Terry step written from the formula
(loss, metrics, gradients); `megarl_layouts` runs the same through megarl at several layouts in
one process group: the frozen reward model's `RewardModel.score`, and the `rm` stage's loss and
gradients through the offline loop's micro-batching and megatron's schedule.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch
import torch.nn.functional as F

EOS, PAD = 2, 0
HF = dict(
    model_type="llama",
    vocab_size=250,  # padded to 256 by megatron
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
    bos_token_id=1,
    eos_token_id=EOS,
)
# name -> pad_token_id of the model's config
MODELS = {"pad_is_eos": EOS, "own_pad": PAD}


def write_models(root: str) -> dict[str, str]:
    """{name: HF directory} of random one-label Llama sequence classifiers (norms and the score
    head perturbed off their init)."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    dirs = {}
    for k, (name, pad) in enumerate(MODELS.items()):
        torch.manual_seed(k)
        cfg = LlamaConfig(**HF, pad_token_id=pad, num_labels=1)
        cfg.architectures = ["LlamaForSequenceClassification"]
        model = LlamaForSequenceClassification(cfg).float()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        dirs[name] = os.path.join(root, name)
        model.save_pretrained(dirs[name], safe_serialization=True)
    return dirs


def sequences(pad: int) -> list[list[int]]:
    """Sequences whose score position covers transformers' cases: ending in EOS, EOS inside and
    at the end, cut without EOS, pad tokens inside (pad == eos), and (own pad) a pad token at
    the end. 8 rows: 4 (chosen, rejected) pairs sharing prompts."""
    g = torch.Generator().manual_seed(5)

    def rand(n):
        return torch.randint(3, 250, (n,), generator=g).tolist()

    p = [rand(n) for n in (4, 3, 5, 2)]
    return [
        p[0] + rand(3) + [EOS],
        p[0] + rand(5) + [EOS],
        p[1] + rand(2) + [EOS] + rand(2) + [EOS],  # an EOS inside
        p[1] + rand(6),  # cut: no EOS
        p[2] + rand(4) + [EOS, EOS],  # pad == eos: both skipped
        p[2] + rand(1) + [EOS],
        p[3] + rand(5) + ([pad] if pad != EOS else []) + [EOS],
        p[3] + rand(3) + [EOS],
    ]


def _padded(seqs: list[list[int]], pad: int) -> torch.Tensor:
    width = max(len(s) for s in seqs)
    out = torch.full((len(seqs), width + 3), pad, dtype=torch.long)  # extra right padding
    for b, s in enumerate(seqs):
        out[b, : len(s)] = torch.tensor(s)
    return out


def hf_scores(hf_dir: str, pad: int) -> torch.Tensor:
    """transformers' scores [8] of `sequences(pad)`, batched with right padding by `pad`."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids=_padded(sequences(pad), pad)).logits[:, 0].float()


MARGINS = [0.5, 0.0, 1.0, 0.25]


def hf_bradley_terry(hf_dir: str, pad: int, margin: bool) -> dict:
    """One Bradley-Terry step on the 4 pairs of `sequences(pad)` with transformers: loss,
    metrics and the gradients by HF name."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(hf_dir, dtype=torch.float32)
    r = model(input_ids=_padded(sequences(pad), pad)).logits[:, 0].float()
    rc, rr = r[0::2], r[1::2]
    m = torch.tensor(MARGINS) if margin else torch.zeros(4)
    loss = -F.logsigmoid(rc - rr - m).mean()
    loss.backward()
    d = (rc - rr).detach()
    metrics = {
        "rm/accuracy": float((d > 0).float().mean()),
        "rm/margin": float(d.mean()),
        "rm/chosen": float(rc.mean()),
        "rm/rejected": float(rr.mean()),
    }
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return {"loss": float(loss), "metrics": metrics, "grads": grads}


def megarl_layouts(rank, world, dirs: dict, layouts: list[dict], sizes: list[int]):
    """Per (layout index, model name): the frozen reward model's scores of `sequences` (every
    rank) and, per micro-batch size, the `rm` stage's step (metrics on every rank, gradients in
    HF names on rank 0), with and without margins."""
    from megatron.core.distributed import DistributedDataParallelConfig

    from megarl.config import load_config
    from megarl.convert.layout import gather_full_state
    from megarl.convert.mapping import canonical_to_hf
    from megarl.convert.sharded import load_hf_sharded
    from megarl.data.batch import MicroBatching
    from megarl.data.offline import PreferenceDataset, Tokens
    from megarl.distributed import Topology
    from megarl.models import forward
    from megarl.models.builder import build_model
    from megarl.models.hf_config import arch_from_hf
    from megarl.models.optim import wire_grad_finalization, zero_grads
    from megarl.rewards.model import RewardModel
    from megarl.trainer import offline
    from megarl.trainer.models import Models, Trained
    from megarl.trainer.stages import get_stage
    from megarl.trainer.update import step_metrics

    torch.set_num_threads(1)
    results = {}
    for li, layout in enumerate(layouts):
        par = [f"parallel.{k}={v}" for k, v in layout.items()]
        for name, hf_dir in dirs.items():
            arch = arch_from_hf(hf_dir)
            pad = arch.hf_config["pad_token_id"]
            base = load_config(None, [*par, "algorithm.micro_batch_size=3"])
            groups = Topology.for_model(base.parallel, world, arch).initialize(seed=0)
            sp = base.parallel.sequence_parallel
            pad_to = forward.sequence_multiple(groups.tp_size, sp, None)
            seqs = sequences(pad)
            # the frozen reward model of an RL run: every DP rank scores all rows here
            frozen = build_model(arch, base.parallel, base.precision, role="reward", frozen=True)
            load_hf_sharded(frozen, arch, hf_dir)
            rm = RewardModel(
                frozen, arch, None, reuse_ids=True, cfg=base, groups=groups, pad_to=pad_to
            )
            results[li, name, "scores"] = rm.score(seqs)
            # the rm stage: one step's loss, metrics and gradients
            ddp = DistributedDataParallelConfig(
                use_distributed_optimizer=False, grad_reduce_in_fp32=True
            )
            model = build_model(arch, base.parallel, base.precision, role="reward", ddp_config=ddp)
            load_hf_sharded(model, arch, hf_dir)
            wire_grad_finalization(model)
            toks = [Tokens(s, [False] * 2 + [True] * (len(s) - 2)) for s in seqs]
            for margin in (False, True):
                dataset = PreferenceDataset(
                    toks[0::2],
                    toks[1::2],
                    MARGINS if margin else [None] * 4,
                    list(range(4)),
                    "<test>",
                    (0, 0),
                )
                for mbs in sizes:
                    cfg = load_config(
                        None, [*par, "algorithm.name=rm", f"algorithm.micro_batch_size={mbs}"]
                    )
                    stage = get_stage(cfg.algorithm)
                    run = SimpleNamespace(
                        cfg=cfg,
                        arch=arch,
                        groups=groups,
                        tokenizer=SimpleNamespace(pad_token_id=pad, eos_token_id=EOS),
                        pad_to=forward.sequence_multiple(
                            groups.tp_size,
                            cfg.parallel.sequence_parallel,
                            cfg.precision.fp8 and cfg.precision.fp8_recipe,
                        ),  # Run.pad_to
                        models=Models(reward=Trained(model, None, None)),
                        data=SimpleNamespace(dataset=dataset),
                    )
                    run.micro_batching = MicroBatching.of(cfg.algorithm, pad_to=run.pad_to)
                    rows = list(range(len(dataset)))
                    share = len(rows) // groups.dp_size
                    mine = rows[groups.dp_rank * share : (groups.dp_rank + 1) * share]
                    batch = dataset.batch(mine, pad_id=pad, pad_to=run.pad_to)
                    batch["global_indices"] = rows
                    stage.prepare(run, batch)
                    zero_grads(model)
                    out = forward.forward_backward(
                        model,
                        offline._micro_batches(run, stage, batch),
                        stage.loss_fn(run, stage.denominator(dataset, rows)),
                        forward_only=False,
                        dp_size=groups.dp_size,
                    )
                    metrics = offline.collect_metrics(run, stage, batch, step_metrics(out, 1))
                    full = gather_full_state(model, grads=True)
                    grads = dict(canonical_to_hf(arch, full.items())) if rank == 0 else {}
                    results[li, name, margin, mbs] = {"metrics": metrics, "grads": grads}
    return results
