"""`convert` suite: hf-to-mcore (and back) on a synthetic >= 1B-parameter Llama-shaped model.

The synthetic HF checkpoint (random bf16, TinyLlama-1.1B shapes) is written layer by layer into
a temporary directory, so this process never holds more than one layer. Each conversion runs as
`tools/convert.py` in a child process; its peak RSS comes from `os.wait4` for that child alone.

`*_seconds` is the whole command; `*_seconds_in_process` is what the tool itself reports (after
interpreter start and its top-level imports; megatron's import, about 6 s here, is inside).

Floors, measured in the same run on the same directory: a conversion must at least read the
model once and write it once, so the time floor is bytes/read_GB/s + bytes/write_GB/s (the read
floor, like the conversion's read of a just-written file, may come from the page cache); the
memory floor is one copy of the model.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from megarl.benchmarks import disk_gbps, record, register_suite
from megarl.convert.mapping import hf_shapes_for
from megarl.models.hf_config import arch_from_hf

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# TinyLlama-1.1B shapes: 1.10e9 parameters; --quick: about 0.25e9
FULL = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    vocab_size=32000,
)
QUICK = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=4,
    vocab_size=32000,
)


def synthetic_llama(directory: str, shape: dict, *, seed: int = 0) -> tuple[int, int]:
    """Write a random bf16 Llama HF checkpoint (one safetensors shard per layer + index).
    Returns (parameters, bytes)."""
    from safetensors.torch import save_file

    cfg = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_act="silu",
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        dtype="bfloat16",
        **shape,
    )
    arch = arch_from_hf(cfg)
    shapes = hf_shapes_for(arch)
    groups: dict[str, list[str]] = {}
    for name in shapes:  # one file per layer, embeddings / head / norm in their own
        parts = name.split(".")
        key = f"layer{int(parts[2]):03d}" if parts[1] == "layers" else parts[-2]
        groups.setdefault(key, []).append(name)
    g = torch.Generator().manual_seed(seed)
    weight_map, total, params = {}, 0, 0
    for i, (_, names) in enumerate(sorted(groups.items())):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for n in names:
            t = torch.empty(shapes[n], dtype=torch.bfloat16)
            t.normal_(0, 0.02, generator=g) if t.dim() > 1 else t.fill_(1.0)
            tensors[n] = t
            weight_map[n] = fname
            total += t.numel() * 2
            params += t.numel()
        save_file(tensors, os.path.join(directory, fname), metadata={"format": "pt"})
        del tensors
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)
    return params, total


def _run_child(args: list[str]) -> tuple[float, float, dict]:
    """(wall seconds, peak RSS bytes, the tool's JSON summary) of `tools/convert.py ARGS` in a
    child process. The summary's `seconds` exclude interpreter start and imports."""
    cmd = [sys.executable, os.path.join(ROOT, "tools", "convert.py"), *args, "--no-progress"]
    t = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(p.pid, 0)
    secs = time.perf_counter() - t
    out, err = p.stdout.read().decode(), p.stderr.read().decode()
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{out}\n{err[-4000:]}")
    summary = json.loads(next(ln for ln in out.splitlines()[::-1] if ln.startswith("{")))
    return secs, usage.ru_maxrss * 1024, summary  # Linux reports ru_maxrss in KiB


def _du(directory: str) -> int:
    return sum(
        os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(directory) for f in files
    )


@register_suite("convert")
def suite(args) -> list[dict]:
    shape = QUICK if getattr(args, "quick", False) else FULL
    base = os.environ.get("MEGARL_BENCH_DIR") or tempfile.gettempdir()
    tmp = tempfile.mkdtemp(prefix="megarl-convert-bench-", dir=base)
    try:
        hf, ckpt, back = (os.path.join(tmp, n) for n in ("hf", "mcore", "hf_back"))
        os.makedirs(hf)
        t = time.perf_counter()
        params, nbytes = synthetic_llama(hf, shape)
        gen_s = time.perf_counter() - t
        write_gbps, read_gbps = disk_gbps(tmp)
        floor_s = nbytes / (read_gbps * 1e9) + nbytes / (write_gbps * 1e9)
        info = dict(
            params=params,
            model_bytes=nbytes,
            dtype="bf16",
            synth_seconds=gen_s,
            disk_write_gbps=write_gbps,
            disk_read_gbps=read_gbps,
            shape=shape,
        )
        recs = []
        for direction, cmd, out in (
            ("hf_to_mcore", ["hf-to-mcore", "--hf", hf, "--out", ckpt], ckpt),
            ("mcore_to_hf", ["mcore-to-hf", "--ckpt", ckpt, "--out", back], back),
        ):
            secs, rss, summary = _run_child(cmd)
            written = _du(out)
            work = summary["seconds"]
            recs += [
                record(
                    f"{direction}_seconds_in_process",
                    work,
                    "s",
                    floor=floor_s,
                    higher_is_better=False,
                    **info,
                ),
                record(
                    f"{direction}_seconds",
                    secs,
                    "s",
                    floor=floor_s,
                    higher_is_better=False,
                    bytes_written=written,
                    **info,
                ),
                record(
                    f"{direction}_throughput",
                    nbytes / secs / 1e9,
                    "GB/s",
                    floor=nbytes / floor_s / 1e9,
                    **info,
                ),
                record(
                    f"{direction}_peak_rss",
                    rss / 1e9,
                    "GB",
                    floor=nbytes / 1e9,
                    higher_is_better=False,
                    rss_over_model=rss / nbytes,
                    **info,
                ),
            ]
        return recs
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
