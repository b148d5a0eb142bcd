"""Step 2's bf16-vs-fp32 parity: the same small model, weights and batch, one GRPO step on the
device (bf16 on the GPU) and one in a CPU process (fp32, `MEGARL_DEVICE=cpu`, GPU hidden; megarl's
CPU emulation of CUDA is process-wide, so the CPU side needs its own process). Logprobs and the
pre-update loss must agree within bf16 tolerance: the check that the CUDA path computes what the
tested CPU path does. Run as `python parity.py IN OUT` it is that CPU process."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import common
import rl


def cpu_parity(fig, st, scratch: str) -> None:
    """The same small model, weights and batch: one GRPO step here and one on CPU in fp32."""
    import torch

    from megarl.config import AlgorithmConfig
    from megarl.data.batch import MicroBatching
    from megarl.models.builder import unwrap
    from megarl.trainer.experience import forward_logprobs
    from megarl.trainer.update import train_policy

    sh = st.shape
    pa = common.arch(sh["parity_arch"])
    actor = common.build(pa, st.par, st.dtype, "actor", st.device)
    opt, sched = rl.optimizer(actor, st.dtype)
    batch = common.random_batch(
        pa, prompt_len=sh["parity_prompt"], resp_lens=sh["parity_resp"], seed=2
    )
    mask = batch.loss_mask
    micro = MicroBatching(size=sh["mbs"], pack=True)  # as train_policy cuts the batch
    kw = dict(micro=micro, vocab_size=pa.vocab_size, groups=st.groups, temperature=1.0)
    lp = forward_logprobs(actor, batch.fields(), **kw)
    noise = 0.1 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(3))
    batch.old_logprobs = (lp + noise) * mask
    batch.advantages = rl.grpo_advantages(st.groups, batch)
    alg = dict(name="grpo", micro_batch_size=sh["mbs"])
    state = {n: p.detach().cpu() for n, p in unwrap(actor[0]).named_parameters()}
    src = os.path.join(scratch, "parity_in.pt")
    dst = os.path.join(scratch, "parity_out.pt")
    torch.save(
        dict(
            arch=sh["parity_arch"],
            state=state,
            batch=batch,
            alg=alg,
            max_tokens=max(sh["parity_resp"]),
            mbs=sh["mbs"],
        ),
        src,
    )
    m = common.metrics_dict(
        train_policy(
            actor,
            opt,
            sched,
            batch,
            alg=AlgorithmConfig(**alg),
            sampling=rl.sampling_cfg(len(sh["parity_resp"]), max(sh["parity_resp"])),
            vocab_size=pa.vocab_size,
            groups=st.groups,
            seed=0,
        ),
        st.groups,
    )
    del actor, opt, sched
    budget = max(30.0, min(240.0, st.rec.remaining() - 10))
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), src, dst],
        env=common.child_env(MEGARL_DEVICE="cpu", CUDA_VISIBLE_DEVICES=""),
        capture_output=True,
        text=True,
        timeout=budget,
    )
    fig["cpu_process_s"] = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise common.Fail(
            f"CPU reference process exited {proc.returncode}: "
            f"{proc.stderr.strip().splitlines()[-1:] or proc.stdout[-300:]}"
        )
    ref = torch.load(dst, weights_only=False)
    valid = mask.bool()
    d = (lp - ref["logprobs"]).abs()[valid]
    loss, loss_ref = float(m["loss"]), float(ref["loss"])
    adv_abs = float(batch.advantages.abs()[valid].mean())
    bf16 = st.dtype != "fp32"
    lp_tol = 0.02 if bf16 else 1e-4
    loss_tol = (5e-3 * (adv_abs + abs(loss_ref))) if bf16 else (1e-5 + 1e-4 * abs(loss_ref))
    fig.update(
        arch=sh["parity_arch"],
        device_dtype=st.dtype,
        logprob_abs_diff_mean=float(d.mean()),
        logprob_abs_diff_max=float(d.max()),
        logprob_tol_mean=lp_tol,
        loss_device=loss,
        loss_cpu_fp32=loss_ref,
        loss_abs_diff=abs(loss - loss_ref),
        loss_tol=loss_tol,
        grad_norm_device=m.get("grad_norm"),
        grad_norm_cpu_fp32=ref.get("grad_norm"),
    )
    if not float(d.mean()) <= lp_tol:
        raise common.Fail(f"mean |logprob diff| vs CPU fp32 = {float(d.mean()):.3g} > {lp_tol}")
    if not abs(loss - loss_ref) <= loss_tol:
        raise common.Fail(f"loss {loss:.6g} vs CPU fp32 {loss_ref:.6g}: |diff| > {loss_tol:.3g}")


def parity_ref(src: str, dst: str) -> None:
    """The CPU fp32 side of cpu_parity (its own process: megarl's CPU emulation is process-wide)."""
    os.environ["MEGARL_DEVICE"] = "cpu"
    import torch

    from megarl.config import AlgorithmConfig
    from megarl.data.batch import MicroBatching
    from megarl.models.builder import unwrap
    from megarl.trainer.experience import forward_logprobs
    from megarl.trainer.update import train_policy

    d = torch.load(src, weights_only=False)
    a = common.arch(d["arch"])
    par, groups = common.init_megatron(a)
    actor = common.build(a, par, "fp32", "actor", "cpu")
    with torch.no_grad():
        for n, p in unwrap(actor[0]).named_parameters():
            p.copy_(d["state"][n])
    opt, sched = rl.optimizer(actor, "fp32")
    batch = d["batch"]
    lp = forward_logprobs(
        actor,
        batch.fields(),
        micro=MicroBatching(size=d["mbs"], pack=True),
        vocab_size=a.vocab_size,
        groups=groups,
        temperature=1.0,
    )
    m = common.metrics_dict(
        train_policy(
            actor,
            opt,
            sched,
            batch,
            alg=AlgorithmConfig(**d["alg"]),
            sampling=rl.sampling_cfg(len(batch), d["max_tokens"]),
            vocab_size=a.vocab_size,
            groups=groups,
            seed=0,
        ),
        groups,
    )
    torch.save({"logprobs": lp, "loss": m["loss"], "grad_norm": m.get("grad_norm")}, dst)


if __name__ == "__main__":
    parity_ref(sys.argv[1], sys.argv[2])
    common.exit_now(0)
