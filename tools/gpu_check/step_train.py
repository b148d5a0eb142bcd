"""Step 2: megarl's trainer path on one device, one rank, with megarl's own builders and updates.

On the GPU: bf16, megatron-core's local layer spec (`precision.transformer_engine=False`: the
machine has no Transformer-Engine), a ~0.5B Llama-shaped model and one GRPO group of 4 sequences
of 1.4k-2k tokens, collated on the host as the trainer does (`forward.forward_backward` moves
micro-batches).
- build: actor (megatron DDP + DistributedOptimizer), reference and critic initialised from the
  actor as `megarl.trainer.recipe.build_run` does; parameters must sit on the device in the
  asked dtype.
- forward: `forward_logprobs` (actor, reference) and `forward_values` (critic) -> host [B, S]
  tensors, finite, logprobs <= 0, reference == actor (it is a copy).
- grpo_update: group advantages (`gather_advantages`), one `train_policy` step with a KL-to-
  reference and an entropy term: finite loss and grad norm, no skipped step, every matrix
  parameter changed, the reference unchanged. Peak CUDA memory is reported.
- ppo_update: GAE (`gae_advantages`) over the critic's values, two `train_value` steps (the
  first moves only the zero-initialised value head, the second every critic matrix) and one PPO
  `train_policy` step: finite losses.
- lora_update: a rank-16 LoRA actor (every linear adapted) on the actor's current weights:
  logprobs at step 0 equal the dense actor's (B starts at zero), one GRPO step moves every
  adapter `B` and no base parameter, the adapters switched off give the base logprobs back
  bitwise (a LoRA run's reference), and the merged weights W + scale B A (the weight sync's
  `lora.merged`) give the adapted logprobs within bf16 tolerance.
- optimizer_state: a fresh ~56M actor's `build_optimizer` allocates Adam's state (zero moments,
  step count 0) before any step; on the GPU the allocated memory grows by at least the masters
  and moments, and `check_free_memory` (the check before vLLM starts) then passes just below the
  device's free share and refuses just above it: it reads the memory with the state in use.
- cpu_parity: a ~56M model, the same weights and batch, one GRPO step here (bf16) and in a CPU
  process (fp32, `MEGARL_DEVICE=cpu`, GPU hidden): logprobs and the pre-update loss agree within
  bf16 tolerance. This is the check that the CUDA path computes what the tested CPU path does.
`--device cpu --tiny` runs all of it on CPU in fp32 with tiny shapes (then parity is fp32 vs fp32).
"""

from __future__ import annotations

import dataclasses
import math
import time
from types import SimpleNamespace

import common
import parity
import rl

CHECKS = [
    "build",
    "forward",
    "grpo_update",
    "ppo_update",
    "lora_update",
    "optimizer_state",
    "cpu_parity",
]
SHAPES = {
    False: dict(
        arch="llama_0.5b",
        prompt=384,
        resp=[1024, 1536, 1200, 1664],
        mbs=2,
        parity_arch="parity_56m",
        parity_prompt=128,
        parity_resp=[256, 384, 320, 200],
    ),
    True: dict(
        arch="tiny",
        prompt=8,
        resp=[12, 20, 16, 9],
        mbs=2,
        parity_arch="tiny",
        parity_prompt=6,
        parity_resp=[10, 14, 7, 12],
    ),
}


# ----------------------------------------------------------------------------- checks
def build_models(fig, st) -> None:
    from megarl.models.builder import unwrap

    common.reset_peak(st.device)
    st.par, st.groups = common.init_megatron(st.a)
    note = common.precision(st.dtype)[2]
    if note:
        fig["note"] = note
    st.actor = common.build(st.a, st.par, st.dtype, "actor", st.device)
    st.actor_opt, st.actor_sched = rl.optimizer(st.actor, st.dtype)
    st.reference = common.build(st.a, st.par, st.dtype, "reference", st.device)
    rl.copy_into(st.actor, st.reference)
    st.critic = common.build(st.a, st.par, st.dtype, "critic", st.device)
    rl.copy_into(st.actor, st.critic)
    st.critic_opt, st.critic_sched = rl.optimizer(st.critic, st.dtype)
    p = next(st.actor[0].parameters())
    te = sum(
        type(m).__module__.endswith("transformer_engine") for m in unwrap(st.actor[0]).modules()
    )
    fig.update(
        arch=st.arch_name,
        params=common.param_count(st.actor),
        dtype=str(p.dtype),
        param_device=str(p.device),
        te_modules=te,
        peak_gib=common.peak_gib(st.device),
    )
    if p.device.type != st.device:
        raise common.Fail(f"actor parameters are on {p.device}, expected {st.device}")


def forward(fig, st) -> None:
    import torch

    from megarl.data.batch import MicroBatching
    from megarl.trainer.experience import forward_logprobs, forward_values

    sh, v = st.shape, st.a.vocab_size
    st.batch = common.random_batch(st.a, prompt_len=sh["prompt"], resp_lens=sh["resp"], seed=1)
    mask = st.batch.loss_mask.bool()
    micro = MicroBatching(size=sh["mbs"], pack=True)  # packed rows (THD) as the trainer runs
    kw = dict(micro=micro, vocab_size=v, groups=st.groups, temperature=1.0)
    t0 = time.perf_counter()
    st.old = forward_logprobs(st.actor, st.batch.fields(), **kw)
    common.sync(st.device)
    fig["logprobs_s"] = time.perf_counter() - t0
    st.ref = forward_logprobs(st.reference, st.batch.fields(), **kw)
    fields = st.batch.fields()
    st.values = forward_values(st.critic, fields, micro=micro, groups=st.groups)
    for name, x in (("logprobs", st.old), ("ref_logprobs", st.ref), ("values", st.values)):
        if x is None:
            raise common.Fail(f"{name} is None: this rank is not the last pipeline stage?")
        if tuple(x.shape) != tuple(st.batch.tokens.shape):
            raise common.Fail(
                f"{name} shape {tuple(x.shape)} != tokens {tuple(st.batch.tokens.shape)}"
            )
        if x.device.type != "cpu":
            raise common.Fail(f"{name} came back on {x.device}; the loop keeps results on the host")
        if not torch.isfinite(x[mask]).all():
            raise common.Fail(f"{name}: non-finite values on response tokens")
    lp = st.old[mask]
    diff = float((st.old - st.ref)[mask].abs().max())
    fig.update(
        shape=list(st.batch.tokens.shape),
        tokens=int(st.batch.seq_len.sum()),
        logprob_mean=float(lp.mean()),
        uniform_logprob=-math.log(v),
        actor_vs_reference_max_abs=diff,
        values_abs_max=float(st.values[mask].abs().max()),
        peak_gib=common.peak_gib(st.device),
    )
    if float(lp.max()) > 1e-4:
        raise common.Fail(f"a logprob is > 0 ({float(lp.max()):.3g})")
    if diff > 1e-2:
        raise common.Fail(f"reference logprobs differ from the actor's by {diff:.3g} (a copy)")


def grpo_update(fig, st) -> None:
    import torch

    from megarl.config import AlgorithmConfig
    from megarl.trainer.update import train_policy

    batch = dataclasses.replace(
        st.batch,
        old_logprobs=st.old,
        ref_logprobs=st.ref,
        advantages=rl.grpo_advantages(st.groups, st.batch),
    )
    alg = AlgorithmConfig(
        name="grpo", kl_coef=0.01, entropy_coef=1e-3, micro_batch_size=st.shape["mbs"]
    )
    snap, ref_snap = rl.snapshot(st.actor), rl.snapshot(st.reference)
    common.reset_peak(st.device)
    t0 = time.perf_counter()
    m = train_policy(
        st.actor,
        st.actor_opt,
        st.actor_sched,
        batch,
        alg=alg,
        sampling=rl.sampling_cfg(len(st.shape["resp"]), max(st.shape["resp"])),
        vocab_size=st.a.vocab_size,
        groups=st.groups,
        seed=0,
    )
    common.sync(st.device)
    fig["step_s"] = time.perf_counter() - t0
    m = common.metrics_dict(m, st.groups)
    mat, mats, vec, vecs = rl.changed(st.actor, snap)
    ref_same = rl.changed(st.reference, ref_snap)
    fig.update({k: m.get(k) for k in ("loss", "grad_norm", "kl_loss", "entropy", "skipped_steps")})
    fig.update(
        matrices_changed=f"{mat}/{mats}",
        vectors_changed=f"{vec}/{vecs}",
        peak_gib=common.peak_gib(st.device),
    )
    if st.device == "cuda":
        fig["max_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    del snap, ref_snap
    if not math.isfinite(float(m.get("loss", float("nan")))):
        raise common.Fail(f"policy loss is {m.get('loss')}")
    if m.get("skipped_steps", 0):
        raise common.Fail("the optimizer step was skipped (non-finite loss on some rank)")
    if not (math.isfinite(m.get("grad_norm", float("nan"))) and m["grad_norm"] > 0):
        raise common.Fail(f"grad norm is {m.get('grad_norm')}")
    if mat != mats:
        raise common.Fail(f"only {mat} of {mats} actor matrices changed after the step")
    if ref_same[0] or ref_same[2]:
        raise common.Fail("the frozen reference changed during the actor's update")


def ppo_update(fig, st) -> None:
    import torch

    from megarl.algorithms.advantages import GAEOptions
    from megarl.algorithms.distributed_advantage import gae_advantages
    from megarl.config import AlgorithmConfig
    from megarl.trainer.experience import final_token_rewards
    from megarl.trainer.update import train_policy, train_value

    b = st.batch
    mask = b.loss_mask
    rewards = torch.tensor(rl.REWARDS[: len(b)])
    adv, ret = gae_advantages(
        final_token_rewards(rewards, mask),
        st.values,
        mask,
        GAEOptions(gamma=1.0, lam=0.95),
        group=st.groups.dp,
    )
    batch = dataclasses.replace(
        b, old_logprobs=st.old, old_values=st.values, returns=ret, advantages=adv
    )
    alg = AlgorithmConfig(name="ppo", micro_batch_size=st.shape["mbs"])
    snap = rl.snapshot(st.critic)
    t0 = time.perf_counter()

    def value_step():
        m = train_value(st.critic, st.critic_opt, st.critic_sched, batch, alg=alg,
                        groups=st.groups, seed=0)  # fmt: skip
        return common.metrics_dict(m, st.groups)

    # the value head starts at zero, so the first step moves only the head (the trunk's gradient
    # flows through it); the second one moves every matrix
    mv = value_step()
    head_moved = rl.changed(st.critic, snap)[0]
    mv2 = value_step()
    mp = common.metrics_dict(
        train_policy(
            st.actor,
            st.actor_opt,
            st.actor_sched,
            batch,
            alg=alg,
            sampling=rl.sampling_cfg(1, max(st.shape["resp"])),
            vocab_size=st.a.vocab_size,
            groups=st.groups,
            seed=0,
        ),
        st.groups,
    )
    common.sync(st.device)
    mat, mats, _, _ = rl.changed(st.critic, snap)
    fig.update(
        value_loss=mv.get("value_loss"),
        value_loss_2nd=mv2.get("value_loss"),
        matrices_changed_1st=head_moved,
        policy_loss=mp.get("loss"),
        critic_matrices_changed=f"{mat}/{mats}",
        seconds_both=time.perf_counter() - t0,
        peak_gib=common.peak_gib(st.device),
    )
    for m in (mv, mv2):
        if not math.isfinite(float(m.get("value_loss", float("nan")))):
            raise common.Fail(f"value loss is {m.get('value_loss')}")
    if head_moved < 1:
        raise common.Fail("no critic matrix changed in the first value step")
    if not math.isfinite(float(mp.get("loss", float("nan")))):
        raise common.Fail(f"PPO policy loss is {mp.get('loss')}")
    if mat != mats:
        raise common.Fail(f"only {mat} of {mats} critic matrices changed after two value steps")


def lora_update(fig, st) -> None:
    import torch

    from megarl.config import AlgorithmConfig
    from megarl.data.batch import MicroBatching
    from megarl.models import lora
    from megarl.models.builder import build_model, unwrap
    from megarl.trainer.experience import forward_logprobs
    from megarl.trainer.update import train_policy

    prec, bcfg, _ = common.precision(st.dtype)
    cfg = lora.LoraConfig(rank=16, alpha=32.0)
    chunks = build_model(
        st.a, st.par, prec, role="actor", build=dataclasses.replace(bcfg, lora=cfg),
        gpu=st.device == "cuda",
    )  # fmt: skip
    have = {n: p for c in st.actor for n, p in unwrap(c).named_parameters()}
    with torch.no_grad():
        for c in chunks:
            for n, p in unwrap(c).named_parameters():
                if not lora.is_lora(p):
                    p.copy_(have[n])
    opt, sched = rl.optimizer(chunks, st.dtype)
    mask = st.batch.loss_mask.bool()
    kw = dict(
        micro=MicroBatching(size=st.shape["mbs"], pack=True),
        vocab_size=st.a.vocab_size,
        groups=st.groups,
        temperature=1.0,
    )

    def logprobs(models):
        return forward_logprobs(models, st.batch.fields(), **kw)

    dense = logprobs(st.actor)
    start = logprobs(chunks)
    snap = rl.snapshot(chunks)
    batch = dataclasses.replace(
        st.batch,
        old_logprobs=start,
        ref_logprobs=start,
        advantages=rl.grpo_advantages(st.groups, st.batch),
    )
    alg = AlgorithmConfig(name="grpo", kl_coef=0.01, micro_batch_size=st.shape["mbs"])
    t0 = time.perf_counter()
    m = common.metrics_dict(
        train_policy(
            chunks, opt, sched, batch, alg=alg,
            sampling=rl.sampling_cfg(len(st.shape["resp"]), max(st.shape["resp"])),
            vocab_size=st.a.vocab_size, groups=st.groups, seed=0,
        ),
        st.groups,
    )  # fmt: skip
    common.sync(st.device)
    fig["step_s"] = time.perf_counter() - t0
    moved = {"A": [0, 0], "B": [0, 0], "base": [0, 0]}
    for c in chunks:
        for n, p in unwrap(c).named_parameters():
            kind = ("B" if n.endswith(".B") else "A") if lora.is_lora(p) else "base"
            moved[kind][1] += 1
            moved[kind][0] += int(not torch.equal(p.detach(), snap[n]))
    adapted = logprobs(chunks)
    with lora.disabled(chunks):
        base = logprobs(chunks)
    with lora.merged(chunks):
        merged = logprobs(chunks)
    step0 = float((start - dense)[mask].abs().max())
    off = float((base - dense)[mask].abs().max())
    moved_by = float((adapted - start)[mask].abs().max())
    merge_err = float((merged - adapted)[mask].abs().max())
    tol = 0.05 if st.dtype == "bf16" else 1e-4
    fig.update(
        loss=m.get("loss"),
        grad_norm=m.get("grad_norm"),
        adapters=moved["A"][1] + moved["B"][1],
        B_changed=f"{moved['B'][0]}/{moved['B'][1]}",
        base_changed=f"{moved['base'][0]}/{moved['base'][1]}",
        step0_vs_dense_max=step0,
        off_vs_dense_max=off,
        update_moved_logprobs_max=moved_by,
        merged_vs_adapted_max=merge_err,
        merge_tol=tol,
        peak_gib=common.peak_gib(st.device),
    )
    del snap, opt, chunks
    if not math.isfinite(float(m.get("loss", float("nan")))) or m.get("skipped_steps", 0):
        raise common.Fail(f"LoRA policy loss {m.get('loss')}, skipped {m.get('skipped_steps')}")
    if moved["base"][0]:
        raise common.Fail(f"{moved['base'][0]} frozen base parameter(s) changed in a LoRA step")
    if moved["B"][0] != moved["B"][1] or not moved["B"][1]:
        raise common.Fail(f"only {moved['B'][0]} of {moved['B'][1]} adapter B matrices moved")
    if step0 != 0.0 or off != 0.0:
        raise common.Fail(
            f"zero adapters / adapters off differ from the dense actor: {step0:.3g} / {off:.3g}"
        )
    if not moved_by > 0:
        raise common.Fail("the LoRA step did not change the policy's logprobs")
    if merge_err > tol:
        raise common.Fail(f"merged weights' logprobs differ by {merge_err:.3g} (> {tol})")


def optimizer_state(fig, st) -> None:
    import torch

    a = common.arch(st.shape["parity_arch"])
    chunks = common.build(a, st.par, st.dtype, "actor", st.device)
    cuda = st.device == "cuda"
    before = torch.cuda.memory_allocated() if cuda else 0
    opt, _ = rl.optimizer(chunks, st.dtype)
    grown = (torch.cuda.memory_allocated() - before) if cuda else None
    inner = [o.optimizer for o in getattr(opt, "chained_optimizers", [opt])]
    mains = [p for o in inner for g in o.param_groups for p in g["params"]]
    states = [o.state[p] for o in inner for g in o.param_groups for p in g["params"]]
    moments = [t for s in states for k, t in s.items() if k in ("exp_avg", "exp_avg_sq")]
    steps = sorted({float(s["step"]) for s in states if "step" in s})
    state_bytes = sum(t.numel() * t.element_size() for t in moments)
    master_bytes = 0 if st.dtype == "fp32" else sum(p.numel() * p.element_size() for p in mains)
    fig.update(
        params=common.param_count(chunks),
        with_state=sum(bool(s) for s in states),
        optimizer_params=len(mains),
        moment_bytes=state_bytes,
        master_bytes=master_bytes,
        steps=steps,
        allocated_growth_gib=None if grown is None else grown / 2**30,
    )
    if not mains or len(moments) != 2 * len(mains) or any(t.any() for t in moments):
        raise common.Fail("Adam's moments are missing or not zero after build_optimizer")
    if steps not in ([], [0.0]):
        raise common.Fail(f"Adam's step count is {steps} before any step")
    if not cuda:
        return
    if grown < state_bytes + master_bytes:
        raise common.Fail(
            f"allocated memory grew by {grown / 2**30:.3f} GiB with the optimizer, less than its "
            f"masters and moments ({(state_bytes + master_bytes) / 2**30:.3f} GiB)"
        )
    from megarl.rollout.config import EngineConfig, RolloutConfigError
    from megarl.rollout.engine.checks import check_free_memory

    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    share = free / total
    fig["free_share"] = share
    check_free_memory(EngineConfig(gpu_memory_utilization=max(round(share - 0.02, 2), 0.01)))
    try:
        check_free_memory(EngineConfig(gpu_memory_utilization=min(round(share + 0.02, 2), 1.0)))
    except RolloutConfigError as e:
        fig["refusal"] = str(e)[:200]
    else:
        raise common.Fail(f"check_free_memory let vLLM ask for more than the free {share:.2f}")


def body(rec: common.Recorder, args, device: str) -> None:
    sh = SHAPES[args.tiny]
    dtype = args.dtype or ("bf16" if device == "cuda" else "fp32")
    st = SimpleNamespace(
        rec=rec,
        device=device,
        dtype=dtype,
        shape=sh,
        arch_name=sh["arch"],
        a=common.arch(sh["arch"]),
    )
    big = device == "cuda" and not args.tiny
    rec.run("build", build_models, st, min_s=30 if big else 5)
    rec.run("forward", forward, st, needs=["build"])
    rec.run("grpo_update", grpo_update, st, needs=["forward"])
    rec.run("ppo_update", ppo_update, st, needs=["forward"])
    rec.run("lora_update", lora_update, st, needs=["forward"])
    rec.run("optimizer_state", optimizer_state, st, needs=["build"])
    rec.run(
        "cpu_parity", parity.cpu_parity, st, args.scratch, needs=["build"], min_s=40 if big else 10
    )


if __name__ == "__main__":
    common.main(
        "train",
        body,
        CHECKS,
        extra=lambda p: p.add_argument(
            "--dtype",
            choices=("bf16", "fp32"),
            default=None,
            help="default: bf16 on GPU, fp32 on CPU",
        ),
    )
