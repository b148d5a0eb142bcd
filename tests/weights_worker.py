"""Distributed workers for the sharded-load / streamed-export tests (module-level so `spawn` can
import them), and a per-process peak-RSS meter."""

from __future__ import annotations

import ctypes
import gc
import json
import os
import threading
import time
from unittest import mock

import torch
import torch.distributed as dist

from megarl.convert.hf_io import LazyHFTensors
from megarl.convert.hf_write import StreamingShardWriter, save_hf_dir
from megarl.convert.layout import gather_full_state, load_full_state, local_params, replica
from megarl.convert.mapping import canonical_to_hf, hf_shapes_for, hf_to_canonical
from megarl.convert.sharded import (
    SeededHFTensors,
    copy_weights,
    load_hf_sharded,
    seeded_init,
)
from megarl.convert.stream import CanonicalStream, save_hf_streaming
from megarl.distributed import ParallelConfig, Topology
from megarl.models.builder import build_model, unwrap
from megarl.models.hf_config import PrecisionConfig, arch_from_hf

_PAGE = os.sysconf("SC_PAGE_SIZE")


# ----------------------------------------------------------------------------- RSS
def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


class PeakRSS:
    """Peak resident-set growth of this process over a `with` block, in bytes.

    Before the block: garbage is collected and glibc returns freed heap to the OS (so reused
    free memory cannot hide an allocation), the baseline RSS is read and the kernel's peak
    (VmHWM) is reset through /proc/self/clear_refs. During it a thread samples RSS every ~1 ms.
    The peak is the larger of the sampled maximum and VmHWM (exact, also inside C calls that
    hold the GIL)."""

    def __enter__(self) -> PeakRSS:
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        self.base = rss()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self._stop = threading.Event()
        self._max = self.base
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        self.t0 = time.perf_counter()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._max = max(self._max, rss())
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.t0
        self._stop.set()
        self._thread.join()
        self.sampled = self._max - self.base
        self.growth = max(self._max, _hwm()) - self.base


# ----------------------------------------------------------------------------- helpers
def write_random_hf_dir(hf: dict, path: str, seed: int = 0) -> int:
    """An HF directory of random fp32 weights for `hf` written tensor by tensor (no
    transformers, no whole model in memory); returns the weight bytes."""
    arch = arch_from_hf(hf)
    shapes = hf_shapes_for(arch)
    os.makedirs(path, exist_ok=True)
    w = StreamingShardWriter(
        path, [(n, s, torch.float32) for n, s in shapes.items()], max_shard_bytes=2**28
    )
    g = torch.Generator().manual_seed(seed)
    total = 0
    for n, s in shapes.items():
        t = 0.02 * torch.randn(s, generator=g)
        total += t.numel() * 4
        w.write(n, t)
    w.close()
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    return total


def _setup(arch, layout: dict, world: int):
    par = ParallelConfig(**layout)
    Topology.for_model(par, world, arch).initialize(seed=0)
    return par


def _params(chunks) -> list[tuple[str, torch.Tensor]]:
    return [(f"{k}.{n}", p) for k, c in enumerate(chunks) for n, p in unwrap(c).named_parameters()]


def _diff(a, b, what: str) -> list[str]:
    """Names where two models built at one layout differ (bitwise), per local parameter."""
    pa, pb = _params(a), _params(b)
    if [n for n, _ in pa] != [n for n, _ in pb]:
        return [f"{what}: parameter names differ"]
    return [f"{what}: {n}" for (n, x), (_, y) in zip(pa, pb, strict=True) if not torch.equal(x, y)]


# ----------------------------------------------------------------------------- correctness
def correctness(rank, world, cases: dict, layouts: dict, out_root: str) -> list[str]:
    """Per (layout, case): the sharded HF load vs `load_full_state(hf_to_canonical)`, reference
    and critic copies vs the actor, and the streamed export vs `gather_full_state` +
    `canonical_to_hf` and vs the source files. Returns the failures seen on this rank."""
    bad: list[str] = []
    for tag, (layout, names) in layouts.items():
        for name in names:
            hf_dir, dtype = cases[name]
            where = f"{tag}/{name}"
            arch = arch_from_hf(hf_dir)
            par = _setup(arch, layout, world)
            prec = PrecisionConfig(dtype=dtype)
            actor = build_model(arch, par, prec, role="actor")
            load_hf_sharded(actor, arch, hf_dir)
            expected = build_model(arch, par, prec, role="reference")
            lazy = LazyHFTensors(hf_dir)
            load_full_state(expected, dict(hf_to_canonical(arch, lazy.get, lazy.names)))
            bad += _diff(actor, expected, f"{where} load")
            # the random init: the same full model at every layout (what load_full_state of one
            # full state gives), so a run resumed at another layout rebuilds the same reference
            seeded = SeededHFTensors(arch, 7)
            load_full_state(expected, dict(hf_to_canonical(arch, seeded.get, seeded.names)))
            random_init = build_model(arch, par, prec, role="reference")
            seeded_init(random_init, arch, 7)
            bad += _diff(random_init, expected, f"{where} seeded init")
            del expected, random_init

            reference = build_model(arch, par, prec, role="reference")
            copy_weights(actor, reference)
            bad += _diff(actor, reference, f"{where} reference")
            critic = build_model(arch, par, prec, role="critic")
            with torch.no_grad():  # the copy must overwrite, and zero the head
                for _, p in _params(critic):
                    p.fill_(7.0)
            copy_weights(actor, critic)
            full_actor = gather_full_state(actor)
            full_critic = gather_full_state(critic)
            for n, t in full_critic.items():
                if n == "output_layer.weight":
                    if t.shape != (1, arch.hidden_size) or t.count_nonzero():
                        bad.append(f"{where} critic value head {tuple(t.shape)} not zero")
                elif not torch.equal(t, full_actor[n]):
                    bad.append(f"{where} critic trunk {n}")
            if "output_layer.weight" not in full_critic:
                bad.append(f"{where} critic has no value head")
            del full_actor, full_critic

            out = os.path.join(out_root, f"{tag}-{name}")
            save_hf_streaming(actor, arch, out, max_shard_bytes=40_000, tokenizer_dir=hf_dir)
            naive = gather_full_state(actor, to_all=False)
            if rank == 0:
                bad += _check_export(arch, out, naive, hf_dir, where, dtype)
            dist.barrier()
            if name == names[0]:
                bad += _export_errors(actor, arch, out, where)
            bad += _check_spread(actor, arch, where, rank, world)
    return bad


def _check_spread(actor, arch, where: str, rank: int, world: int) -> list[str]:
    """The spread walk (the separate placement's sync): every canonical tensor made whole once,
    on its collector, equal bit for bit to the walk through rank 0; every rank collects (in
    these layouts each holds pieces: a pipeline stage's, a TP shard's or a DP replica's), and
    from the pieces of its own DP replica."""
    whole = dict(CanonicalStream(actor, arch).tensors())  # rank 0's; nothing elsewhere
    spread = CanonicalStream(actor, arch, spread=True)
    got: list | None = [None] * world if rank == 0 else None
    dist.gather_object(dict(spread.tensors()), got, dst=0)
    if rank != 0:
        return []
    bad, seen = [], {}
    for r, tensors in enumerate(got):
        for n, t in tensors.items():
            if n in seen or spread.collector[n] != r:
                bad.append(f"{where} spread: {n} on rank {r} (collector {spread.collector[n]})")
            seen[n] = r
            if not torch.equal(t, whole[n]):
                bad.append(f"{where} spread: {n} on rank {r} differs")
    if sorted(seen) != sorted(whole):
        bad.append(f"{where} spread: missing {sorted(set(whole) - set(seen))[:4]}")
    if sorted(set(seen.values())) != list(range(world)):
        bad.append(f"{where} spread: collected on ranks {sorted(set(seen.values()))}")
    for n, pieces in spread.plan.items():
        if spread.collector[n] not in [x.src for x in pieces]:
            bad.append(f"{where} spread: {n} collected on a rank holding none of its pieces")
    return bad


class _FailingWriter(StreamingShardWriter):
    """Fails on the third tensor (a full disk, say)."""

    def write(self, name, t):
        if self._next == 2:
            raise OSError(f"test: no space left writing {name!r}")
        super().write(name, t)


def _export_errors(actor, arch, out, where) -> list[str]:
    """A refused directory and a write failure part-way both raise on every rank (nobody is
    left waiting in a send) and leave no directory behind."""
    import megarl.convert.stream as stream

    bad = []
    try:
        save_hf_streaming(actor, arch, out)  # exists, no overwrite
        bad.append(f"{where}: existing directory not refused")
    except RuntimeError as e:
        if "already holds" not in str(e):
            bad.append(f"{where}: refusal says {e}")
    failed = out + "-failed"
    merge, calls = stream._merge, []
    own = {n for n, _, p in local_params(actor) if replica(p) is not None}
    has_received = len(own) < len(CanonicalStream(actor, arch).plan)  # (collective)

    def failing_merge(arch, name, dim, parts):
        # rank 0's merge fails inside the walk: of the first tensor whose pieces it received
        # (they must not be received twice), or, holding every tensor itself, of the third
        calls.append(name)
        if (name not in own) if has_received else len(calls) == 3:
            raise RuntimeError("test: merge failed")
        return merge(arch, name, dim, parts)

    for attr, broken, says, what in (
        ("StreamingShardWriter", _FailingWriter, "no space left writing", "write failure"),
        ("_merge", failing_merge, "merge failed", "a failure inside the walk"),
    ):
        with mock.patch.object(stream, attr, broken):
            try:
                save_hf_streaming(actor, arch, failed)
                bad.append(f"{where}: {what} not raised")
            except RuntimeError as e:
                if says not in str(e):
                    bad.append(f"{where}: {what} says {e}")
    parent, base = os.path.split(failed)
    if any(n.startswith(("." + base, base)) for n in os.listdir(parent)):
        bad.append(f"{where}: failed export left files in {parent}")
    dist.barrier()
    return bad


def _check_export(arch, out, naive, hf_dir, where, dtype) -> list[str]:
    from safetensors.torch import load_file

    bad = []
    want = dict(canonical_to_hf(arch, naive.items()))
    got = LazyHFTensors(out)
    if got.names != list(hf_shapes_for(arch)):
        bad.append(f"{where} export names/order differ")
    for n, t in want.items():
        g = got.get(n)
        if g.dtype != t.dtype or not torch.equal(g, t):
            bad.append(f"{where} export {n} != gather_full_state + canonical_to_hf")
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    if len(files) < 2 or not os.path.exists(os.path.join(out, "model.safetensors.index.json")):
        bad.append(f"{where} export not sharded: {files}")
    for f in files:  # the safetensors library accepts the streamed files
        for n, t in load_file(os.path.join(out, f)).items():
            if not torch.equal(t, want[n]):
                bad.append(f"{where} safetensors.load_file {f}:{n}")
    src = LazyHFTensors(hf_dir)
    if dtype == "fp32":  # fp32 end to end: the export is the source, bit for bit
        for n in src.names:
            if n in want and not torch.equal(src.get(n), want[n]):
                bad.append(f"{where} export {n} != source")
    # the source's config, with the dtype the tensors were written in (a bf16 model: bfloat16)
    written = {"fp32": "float32", "bf16": "bfloat16"}[dtype]
    want_cfg = {**arch.hf_config, "dtype": written}
    if "torch_dtype" in arch.hf_config:
        want_cfg["torch_dtype"] = written
    with open(os.path.join(out, "config.json")) as f:
        if json.load(f) != want_cfg:
            bad.append(f"{where} config.json")
    if not os.path.exists(os.path.join(out, "tokenizer_config.json")):
        bad.append(f"{where} tokenizer files not copied")
    return bad


# ----------------------------------------------------------------------------- memory
def _old_initial_state(actor, arch, hf_dir):
    """The replaced code (run.py's `_initial_state` before streamed init), kept as the control."""
    if hf_dir is not None:
        lazy = LazyHFTensors(hf_dir)
        full = dict(hf_to_canonical(arch, lazy.get, lazy.names))
        load_full_state(actor, full)
        return full
    return gather_full_state(actor)


def _old_fill(arch, init_state, reference, critic):
    load_full_state(reference, init_state)
    trunk = dict(init_state)
    trunk.pop("output_layer.weight", None)
    trunk["output_layer.weight"] = torch.zeros(1, arch.hidden_size)
    load_full_state(critic, trunk)


def _old_export(actor, arch, out):
    full = gather_full_state(actor, to_all=False)
    if dist.get_rank() == 0:
        save_hf_dir(out, arch.hf_config, canonical_to_hf(arch, full.items()), overwrite=True)
    dist.barrier()


def memory(rank, world, hf_dir: str, layout: dict, out_root: str, old: bool) -> dict:
    """Peak RSS growth of each phase on this rank, for the new path (or, with `old`, the
    gather_full_state path it replaced): HF load into the actor; random init + reference +
    critic from the actor; HF export."""
    arch = arch_from_hf(hf_dir)
    par = _setup(arch, layout, world)
    prec = PrecisionConfig()
    actor = build_model(arch, par, prec, role="actor")
    reference = build_model(arch, par, prec, role="reference")
    critic = build_model(arch, par, prec, role="critic")
    held = sum(p.numel() * p.element_size() for _, p in _params(actor))
    res = {"held": held}

    dist.barrier()
    with PeakRSS() as m:  # model.hf: the actor's initial weights
        if old:
            _old_initial_state(actor, arch, hf_dir)
        else:
            load_hf_sharded(actor, arch, hf_dir)
    res["load_hf"] = (m.growth, m.sampled, m.seconds)

    actor = build_model(arch, par, prec, role="actor")  # random init, as from model.config
    dist.barrier()
    with PeakRSS() as m:  # initial weights (nothing to read) + reference + critic
        if old:
            state = _old_initial_state(actor, arch, None)
            _old_fill(arch, state, reference, critic)
            del state
        else:
            copy_weights(actor, reference)
            copy_weights(actor, critic)
    res["init_ref_critic"] = (m.growth, m.sampled, m.seconds)

    dist.barrier()
    out = os.path.join(out_root, "old" if old else "new")
    with PeakRSS() as m:
        if old:
            _old_export(actor, arch, out)
        else:
            save_hf_streaming(actor, arch, out, overwrite=True)
    res["export"] = (m.growth, m.sampled, m.seconds)
    if rank == 0:
        res["exported"] = sorted(LazyHFTensors(out).names) == sorted(hf_shapes_for(arch))
    return res
