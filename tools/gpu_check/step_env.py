"""Step 1: the machine, megarl's process-group init, and the two floors the other steps use.

- versions: Python, torch (CUDA, cuDNN, NCCL), megatron-core, transformers, megarl's commit, the
  GPU (name, memory, capability, driver), and which optional packages import (TE, vLLM, apex).
- matmul: 8192^3 bf16 TFLOP/s next to the peak megarl divides by for MFU
  (`megarl.metrics.throughput.peak_flops(torch.cuda.get_device_name(), torch.bfloat16)`); no peak
  for this GPU means megarl logs no MFU on it (FAIL); measured above the peak means the table is
  wrong (FAIL).
- d2d_copy: bytes copied per second by a 4 GiB device-to-device copy: the floor of a colocated
  weight sync (each synced byte is written once); `rw_GBps` counts bytes read + written.
- collectives: `megarl.distributed.process_group.init_distributed()` (one rank) initialises the
  default group with `megarl.distributed.device.backend()`: on GPU a device-mapped
  `cpu:gloo,cuda:nccl`, so that the CPU tensors the trainer reduces (loss flags, denominators,
  metrics) and object collectives go through gloo and CUDA tensors through NCCL. all_reduce of a
  CPU and a CUDA tensor, `broadcast_object_list`, and both again on a `new_group` (megatron-core
  creates its groups with the default backend), then a barrier. Any failure here breaks every
  trainer step on GPU. It runs last: a hanging NCCL init would otherwise cost the figures above.
With `--device cpu` the same checks run on CPU (gloo only, fp32 matmul, small copy).
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import platform
import subprocess
import sys

import common

CHECKS = ["versions", "matmul", "d2d_copy", "collectives"]


def _version(dist_name: str) -> str | None:
    try:
        return md.version(dist_name)
    except md.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", common.ROOT, *args], capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def _try(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - a figure, not a verdict
        return f"{type(e).__name__}: {e}"[:120]


def versions(fig: dict, device: str | None) -> None:
    import torch

    fig.update(
        python=platform.python_version(),
        python_exe=sys.executable,
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        megatron_core=_version("megatron-core"),
        transformers=_version("transformers"),
        megarl_commit=_git("rev-parse", "--short", "HEAD"),
        megarl_dirty_files=len((_git("status", "--porcelain") or "").splitlines()),
        importable={
            m: _try(lambda m=m: importlib.util.find_spec(m) is not None) is True
            for m in ("megatron.core", "transformer_engine", "vllm", "apex", "flash_attn")
        },
    )
    if not fig["importable"]["megatron.core"]:
        raise common.Fail(
            "megatron.core is not importable: the wheels from .gpu_wheels are missing"
        )
    if device == "cuda":
        fig.update(
            gpu=torch.cuda.get_device_name(),
            gpu_count=torch.cuda.device_count(),
            gpu_mem_gib=_try(lambda: torch.cuda.get_device_properties(0).total_memory / 2**30),
            capability=_try(lambda: ".".join(map(str, torch.cuda.get_device_capability()))),
            cudnn=_try(torch.backends.cudnn.version),
            nccl=_try(lambda: ".".join(map(str, torch.cuda.nccl.version()))),
        )
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=15,
            )
            fig["driver"] = smi.stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            fig["driver"] = None
    else:
        fig["gpu"] = None


def collectives(fig: dict, device: str) -> None:
    import torch
    import torch.distributed as dist

    from megarl.distributed import device as mdev
    from megarl.distributed.process_group import init_distributed

    rank, world = init_distributed()
    fig.update(
        rank=rank,
        world=world,
        megarl_backend=mdev.backend(),
        group_backend=str(dist.get_backend()),
    )
    ops: dict[str, str] = {}

    def attempt(name, fn):
        try:
            fn()
            ops[name] = "ok"
        except Exception as e:  # noqa: BLE001 - each op reported on its own
            ops[name] = f"{type(e).__name__}: {e}"[:300]

    def reduce(dev, group=None):
        def go():
            t = torch.full((1 << 20,), 2.0, device=dev)
            dist.all_reduce(t, group=group)
            if dev != "cpu":
                torch.cuda.synchronize()
            if not torch.all(t == 2.0 * world):
                raise AssertionError(f"all_reduce gave {t[0].item()}, expected {2.0 * world}")

        return go

    def objects(group=None):
        def go():
            message = [{"step": 7, "tensor": torch.arange(3)}] if rank == 0 else [None]
            dist.broadcast_object_list(message, src=0, group=group)
            if message[0]["step"] != 7 or message[0]["tensor"].tolist() != [0, 1, 2]:
                raise AssertionError(f"broadcast_object_list gave {message[0]}")

        return go

    attempt("all_reduce_cpu", reduce("cpu"))
    if device == "cuda":
        attempt("all_reduce_cuda", reduce(torch.device("cuda", torch.cuda.current_device())))
    attempt("broadcast_object_list", objects())
    group = dist.new_group(list(range(world)))
    attempt("new_group_all_reduce_cpu", reduce("cpu", group))
    if device == "cuda":
        attempt("new_group_all_reduce_cuda", reduce(torch.device("cuda"), group))
    attempt("new_group_broadcast_object_list", objects(group))
    attempt("barrier", dist.barrier)
    fig["ops"] = ops
    bad = {k: v for k, v in ops.items() if v != "ok"}
    if bad:
        first = next(iter(bad))
        raise common.Fail(
            f"{len(bad)} of {len(ops)} collectives failed on backend {fig['group_backend']!r}; "
            f"first: {first}: {bad[first]}"
        )


def matmul(fig: dict, device: str, tiny: bool) -> None:
    import torch

    from megarl.metrics.throughput import peak_flops

    n = 1024 if tiny else 8192
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, dtype=dtype, device=device, generator=g)
    b = torch.randn(n, n, dtype=dtype, device=device, generator=g)
    c = torch.empty(n, n, dtype=dtype, device=device)
    reps = 10

    def run():
        for _ in range(reps):
            torch.matmul(a, b, out=c)

    t = common.median_time(run, device, repeats=3, warmup=1) / reps
    rate = 2 * n**3 / t
    fig.update(n=n, dtype=str(dtype).removeprefix("torch."), tflops=rate / 1e12)
    if device != "cuda":
        return
    name = torch.cuda.get_device_name()
    peak = peak_flops(name, torch.bfloat16)
    fig.update(device_name=name, megarl_peak_tflops=peak and peak / 1e12)
    if peak is None:
        raise common.Fail(
            f"megarl.metrics.throughput.peak_flops has no bf16 peak for {name!r}: the trainer "
            "would log no MFU on this GPU"
        )
    fig["fraction_of_peak"] = rate / peak
    if rate > 1.05 * peak:
        raise common.Fail(f"measured {rate / 1e12:.0f} TFLOP/s exceeds megarl's peak for {name!r}")


def d2d_copy(fig: dict, device: str, tiny: bool) -> None:
    nbytes = (256 if tiny or device != "cuda" else 4096) * 2**20
    rate = common.copy_rate(device, nbytes)
    fig.update(bytes=nbytes, copy_GBps=rate / 1e9, rw_GBps=2 * rate / 1e9)


def body(rec: common.Recorder, args, device: str) -> None:
    rec.run("versions", versions, device)
    rec.run("matmul", matmul, device, args.tiny)
    rec.run("d2d_copy", d2d_copy, device, args.tiny)
    # last: a hanging NCCL init would otherwise cost the figures above
    rec.run("collectives", collectives, device, needs=["versions"])


def main(argv=None) -> None:
    args = common.parse_args("env", argv)
    device, why = common.resolve_device(args.device)
    rec = common.Recorder("env", args.records, device, args.budget_s)
    if device is None:  # versions still tell what is on the machine
        rec.run("versions", versions, None)
        rec.skip_all(CHECKS[1:], why)
    else:
        body(rec, args, device)
    common.exit_now(1 if rec.failed else 0)


if __name__ == "__main__":
    main()
