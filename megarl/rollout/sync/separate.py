"""Separate-placement sync, the trainer's side: the policy's weights (or its LoRA adapters) from
the trainer ranks to the engine ranks, and what the engines' answers are checked against.

Full weights (`SeparateWeights`): the HF-named tensors, one whole tensor at a time, from every
trainer rank that holds pieces of them, each sending about an equal share of the bytes, the
senders at once, each over a link of its own (`Job.sender_link`; trainer rank 0's is the link):
`megarl.convert.stream.CanonicalStream(spread=True)` makes each tensor whole on one of the ranks
holding a piece of it, in any DP replica; each HF tensor is cast to the engine dtype into the
bucket it is broadcast in (`megarl.rollout.sync.buckets`), a few buckets in flight per sender.
Trainer rank 0 tells the engines every sender's bucket layout in the update's message. The
senders' checksums per tensor family (`megarl.rollout.sync.checksum`) add up on trainer rank 0
into a `WeightsCheck`, compared with the engines' answers when they arrive (the receiving side:
`megarl.rollout.sync.receiver`). Adapters (`SeparateAdapters`, `model.lora.merge: false`): the
base once, then the adapters whole every sync, checked by the sums the engines read back.

Each tensor is made whole on its sender (which holds one tensor and the buckets in flight beyond
its parameters); the links are gloo on host memory, also on GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megarl.convert.mapping import canonical_to_hf, mapped_tensors
from megarl.convert.peft import adapter_config, whole_adapters
from megarl.convert.stream import CanonicalStream
from megarl.distributed.placement import Job
from megarl.models import lora
from megarl.models.hf_config import ModelArch
from megarl.models.lora import LoraConfig
from megarl.rollout.sync.adapters import compare, trainer_sums
from megarl.rollout.sync.buckets import bucket_layout, bucket_numel, send_buckets, timed_broadcasts
from megarl.rollout.sync.checksum import FamilySums, merged, mismatched
from megarl.rollout.sync.stats import SyncStats

log = logging.getLogger(__name__)

BUCKET_BYTES = 16 * 2**20
"""Bytes per broadcast bucket: each is packed and checksummed while the ones before it are on
the wire, so small buckets keep the two overlapped (docs/placement.md)."""

UPDATES = ("weights", "adapters")
"""The requests an engine answers as soon as they are loaded, ahead of generate requests still
running (the trainer tells the two kinds of answer apart by their `op`)."""


@dataclass
class WeightsCheck:
    """A weight sync out to the engines, verified when their answers arrive (before any sample
    generated after it is taken): the version sent and the senders' checksums."""

    version: int
    expect: dict
    replies: dict = field(default_factory=dict)
    """{engine: its answer}, once received."""

    what = "the weights"
    holds_other = "holds other weights than sent"

    @property
    def key(self) -> tuple:
        return ("weights", self.version)

    def error(self) -> str | None:
        """What went wrong in the engines' load, or None when each holds what was sent."""
        for e, r in sorted(self.replies.items()):
            if "error" in r:
                return f"engine {e} failed to load {self.what}: {r['error']}"
            bad = self.differences(r)
            if bad is not None or r["version"] != self.version:
                return (
                    f"engine {e} {self.holds_other} (policy version {self.version}, engine's "
                    f"{r['version']}); {bad or 'none'}"
                )
        return None

    def differences(self, reply: dict) -> str | None:
        bad = mismatched(self.expect, reply["sums"])
        return f"tensor families whose checksums differ: {bad}" if bad else None


@dataclass
class AdapterCheck(WeightsCheck):
    """An adapter-only sync: `expect` is the trainer's sums per adapted module
    (`adapters.trainer_sums`), compared with the sums the engine read back from its LoRA layers
    after loading."""

    what = "the LoRA adapters"
    holds_other = "does not hold the trainer's LoRA adapters"

    def differences(self, reply: dict) -> str | None:
        bad = compare(self.expect, reply["adapter_sums"])
        more = " ..." if len(bad) > 3 else ""
        return f"{len(bad)} modules differ: {'; '.join(bad[:3])}{more}" if bad else None


class SeparateWeights:
    """The policy's full weights into the engine ranks (module docstring). Collective over the
    trainer ranks. `post(msg)`: trainer rank 0 sends a message to every engine; `expect(check)`:
    trainer rank 0 keeps a check for the engines' answers. `version`: the syncs sent."""

    def __init__(
        self, policy: list, arch: ModelArch, job: Job, dtype: torch.dtype, *,
        post: Callable[[dict], None], expect: Callable[[WeightsCheck], None],
    ):  # fmt: skip
        self.policy, self.arch, self.job, self.dtype = policy, arch, job, dtype
        self.post, self.expect = post, expect
        self.version = 0
        self._floor_s: float | None = None
        self._stream: CanonicalStream | None = None
        """The policy's tensors, whole, each on its sender (made at the first sync)."""
        self._buckets: dict[int, list] = {}
        """{trainer rank: the buckets it sends} (`sender_buckets`)."""

    @property
    def rank0(self) -> bool:
        """Whether this is trainer rank 0, the one that talks to the engines."""
        return self.job.link is not None

    def sync(self) -> SyncStats:
        t0 = time.perf_counter()
        with lora.merged(self.policy):  # LoRA: the engines get W + scale B A
            stats = self.send(self.version + 1)
        self.version += 1
        return dataclasses.replace(stats, seconds=time.perf_counter() - t0, version=self.version)

    def send(self, version: int) -> SyncStats:
        """The policy's tensors, whole, from the trainer ranks to the engines as `version`:
        each rank that holds pieces makes its share of the tensors whole (the other TP ranks of
        its replica send it their pieces) and broadcasts them over its own link, each HF tensor
        cast to the engine dtype into the bucket it is sent in; the senders send at once."""
        t0, me = time.perf_counter(), dist.get_rank()
        if self._stream is None:
            self._stream = CanonicalStream(self.policy, self.arch, spread=True)  # (metadata)
            self._buckets = sender_buckets(self.arch, self._stream.collector, self.dtype)
            if self.rank0:
                sizes = {r: sum(map(bucket_numel, b)) * self.dtype.itemsize / 1e6
                         for r, b in self._buckets.items()}  # fmt: skip
                log.info(
                    "weight syncs: trainer ranks %s send to the engines, each over its own link",
                    ", ".join(f"{r} ({mb:.1f} MB)" for r, mb in sizes.items()),
                )
        layouts = self._buckets
        floor = self._floor_s is None  # the first sync also times a raw broadcast of its bytes
        if self.rank0:
            msg = {"op": "weights", "version": version, "floor": floor}
            msg["senders"] = [(r, len(b)) for r, b in layouts.items()]
            msg["buckets"] = [b for r in layouts for b in layouts[r]]
            self.post(msg)
        mine = layouts.get(me)
        wire = self.job.sender_link(me) if mine is not None else None  # (made once)
        if floor:  # every link made before any sender's clock starts
            dist.barrier()
        own_floor = timed_broadcasts(wire, mine, self.dtype, me) if floor and mine else 0.0
        t_names = time.perf_counter() - t0 - own_floor  # the engines receive every bucket first
        sent, t1, packing = FamilySums(), time.perf_counter(), 0.0
        with contextlib.closing(self._stream.tensors()) as tensors:
            hf = _Timed(canonical_to_hf(self.arch, tensors))
            if mine is not None:
                packing = send_buckets(wire, hf, mine, self.dtype, sent, me)
            else:
                for _ in hf:  # (nothing: this rank only sends its pieces to its collector)
                    pass
        t_sent = time.perf_counter()
        shares: list | None = [None] * dist.get_world_size() if me == 0 else None
        dist.gather_object((sent.state(), own_floor), shares, dst=0)  # each sender's share
        if floor:  # the senders' raw broadcasts ran at once: the slowest is the floor
            self._floor_s = max(f for _, f in shares) if me == 0 else own_floor
            if me == 0:
                each = ", ".join(f"rank {r} {shares[r][1]:.3f} s" for r in layouts)
                log.info("weight sync floor (a raw broadcast of the same bytes): %s", each)
        expect = merged([state for state, _ in shares]) if me == 0 else sent.state()
        if self.rank0:
            self.expect(WeightsCheck(version, expect))
        numel = sum(bucket_numel(b) for r in layouts for b in layouts[r])
        return SyncStats(
            mode="separate",
            bytes=numel * self.dtype.itemsize,
            seconds=time.perf_counter() - t0,
            transfer_s=t_sent - t1 - packing,  # the wire's time after the packing
            gather_s=hf.seconds,  # waiting for the other ranks' pieces
            checksum_s=t_names + packing - hf.seconds,
            floor_s=self._floor_s,
            families_verified=len(expect),
        )


class SeparateAdapters:
    """The policy's LoRA adapters into the engine ranks (`model.lora.merge: false`): the base
    once (unmerged: the engines keep it), then the adapters every sync, each checked by the
    engines' read-back sums when their answer arrives."""

    def __init__(
        self, policy: list, arch: ModelArch, job: Job, dtype: torch.dtype, cfg: LoraConfig, *,
        post: Callable[[dict], None], expect: Callable[[WeightsCheck], None],
    ):  # fmt: skip
        self.base = SeparateWeights(policy, arch, job, dtype, post=post, expect=expect)
        self.policy, self.cfg, self.dtype = policy, cfg, dtype
        self.post, self.expect = post, expect
        self.version = 0
        self._base_sent = False

    def sync(self) -> SyncStats:
        t0, base = time.perf_counter(), None
        version = self.version + 1
        if not self._base_sent:
            base = self.base.send(version)
            self._base_sent = True
        t1 = time.perf_counter()
        tensors = whole_adapters(self.policy)  # collective over the trainer ranks
        want = trainer_sums(self.policy, self.cfg, self.dtype)
        if self.base.rank0:
            msg = {"op": "adapters", "version": version, "tensors": tensors}
            msg["config"] = adapter_config(self.cfg, base_model=None)
            self.post(msg)
            self.expect(AdapterCheck(version, want))
        self.version = version
        return SyncStats(
            mode="adapters",
            bytes=sum(t.numel() for t in tensors.values()) * self.dtype.itemsize,
            seconds=time.perf_counter() - t0,
            gather_s=time.perf_counter() - t1,
            version=version,
            base=base,
        )


class _Timed:
    """Iterates `it`, adding up the seconds spent inside `it` (`seconds`)."""

    def __init__(self, it):
        self.it, self.seconds = it, 0.0

    def __iter__(self):
        return self

    def __next__(self):
        t0 = time.perf_counter()
        try:
            return next(self.it)
        finally:
            self.seconds += time.perf_counter() - t0


def sender_buckets(arch: ModelArch, collector: dict, dtype: torch.dtype) -> dict[int, list]:
    """{trainer rank: the buckets it broadcasts}, for each rank that makes tensors whole
    (`collector`: canonical name -> rank, in canonical order), by rank: its HF tensors in the
    order its walk yields them (`canonical_to_hf`), cut into `BUCKET_BYTES` buckets."""
    mapped, per = mapped_tensors(arch), {}
    for name, rank in collector.items():
        if name == "output_layer.weight" and arch.tie_word_embeddings:
            continue  # (the tied head is the embedding: `canonical_to_hf` drops it)
        item = mapped[name]
        per.setdefault(rank, []).extend(
            (n, torch.empty(shape, dtype=dtype, device="meta"))
            for n, shape in zip(item.hf, item.shapes, strict=True)
        )
    return {r: bucket_layout(per[r], BUCKET_BYTES) for r in sorted(per)}
