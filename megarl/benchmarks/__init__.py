"""One benchmark harness for every suite (`megarl bench --suite NAME`).

A suite is a function `suite(args) -> list[dict]` registered with `@register_suite(name)`. Each
record names the figure, its value and unit, the machine it ran on and, where a physical floor is
known, the floor measured in the same run and the ratio to it. Benchmarks measure; tests assert.
Suites are imported lazily so that one suite's heavy dependencies (vLLM, megatron) do not slow
another.
"""

from __future__ import annotations

import importlib
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

_SUITES: dict[str, Callable[[Any], list[dict]]] = {}
# suite name -> module that registers it (imported on demand)
SUITE_MODULES = {
    "sync": "megarl.benchmarks.sync",
    "advantage": "megarl.benchmarks.advantage",
    "rollout": "megarl.benchmarks.rollout",
    "train": "megarl.benchmarks.train",
    "step": "megarl.benchmarks.step",
    "convert": "megarl.benchmarks.convert",
    "peer": "megarl.benchmarks.peer",
    "multi_turn": "megarl.benchmarks.multi_turn",
    "passes": "megarl.benchmarks.passes",
}
# run only when named (not by `--suite all`): tens of minutes, an optional dependency (TRL) or
# a fetched model (SmolLM2)
OPT_IN_SUITES = ("peer", "multi_turn", "passes")
_SUMMARIES: dict[str, Callable[[list[dict]], str]] = {}


def register_suite(name: str, *, summary: Callable[[list[dict]], str] | None = None):
    """Decorator: register `fn(args) -> list[record]` as suite `name` (duplicates raise).
    `summary(records) -> str`, if given, is a human-readable table of the records that
    `megarl bench` prints after them."""

    def wrap(fn):
        if name in _SUITES:
            raise ValueError(f"benchmark suite {name!r} is registered twice")
        _SUITES[name] = fn
        if summary is not None:
            _SUMMARIES[name] = summary
        return fn

    return wrap


def get_summary(name: str) -> Callable[[list[dict]], str] | None:
    """The summary function of a suite that was loaded with `get_suite`, or None."""
    return _SUMMARIES.get(name)


def get_suite(name: str) -> Callable[[Any], list[dict]]:
    if name not in SUITE_MODULES:
        raise ValueError(f"unknown suite {name!r}; known: {sorted(SUITE_MODULES)} or 'all'")
    if name not in _SUITES:
        importlib.import_module(SUITE_MODULES[name])
    return _SUITES[name]


def cpu_model() -> str:
    """The CPU's model name as the kernel reports it (`platform.processor()` is often only the
    architecture), with its vector extensions that decide the GEMM floor."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    field_ = lambda key: next(  # noqa: E731
        (ln.split(":", 1)[1].strip() for ln in lines if ln.split(":", 1)[0].strip() == key), ""
    )
    name = field_("model name") or platform.processor() or platform.machine()
    flags = set(field_("flags").split())
    ext = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name} ({', '.join(ext)})" if ext else name


def machine_info() -> dict:
    """What the figures were measured on."""
    info = {
        "host": platform.node(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    try:
        with open("/proc/meminfo") as f:
            info["mem_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    return info


def record(
    name: str,
    value: float,
    unit: str,
    *,
    floor: float | None = None,
    floor_unit: str | None = None,
    higher_is_better: bool = True,
    **params: Any,
) -> dict:
    """One benchmark figure. `ratio_to_floor` is value/floor for rates and floor/value for times
    would be confusing, so it is always reported as "fraction of the physical bound reached"."""
    rec = {"name": name, "value": value, "unit": unit, "machine": machine_info(), "params": params}
    if floor is not None:
        rec["floor"] = floor
        rec["floor_unit"] = floor_unit or unit
        rec["ratio_to_floor"] = (value / floor) if higher_is_better else (floor / value)
    return rec


def median_time(fn: Callable[[], Any], *, repeats: int = 5, warmup: int = 1) -> float:
    """Median wall seconds of `fn()` over `repeats` runs (the machines are shared and noisy)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync()
        t = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def memcpy_gbps(nbytes: int = 256 * 2**20, device: str = "cpu", repeats: int = 5) -> float:
    """Memory-copy floor: GB/s of `dst.copy_(src)` for `nbytes` (bytes read + written counted
    once, as a copy of N bytes "moves" N bytes)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    t = median_time(lambda: dst.copy_(src), repeats=repeats)
    return nbytes / t / 1e9


def disk_gbps(directory: str, nbytes: int = 512 * 2**20) -> tuple[float, float]:
    """Disk floor: (write GB/s with fsync, read GB/s) of one file of `nbytes` in `directory`.
    The read may be served from the page cache; that is the floor a conversion sees too."""
    path = os.path.join(directory, ".megarl_disk_probe")
    buf = os.urandom(16 * 2**20) * (nbytes // (16 * 2**20))
    t = time.perf_counter()
    with open(path, "wb") as f:
        f.write(buf)
        f.flush()
        os.fsync(f.fileno())
    write = len(buf) / (time.perf_counter() - t) / 1e9
    t = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(64 * 2**20):
            pass
    read = len(buf) / (time.perf_counter() - t) / 1e9
    os.remove(path)
    return write, read
