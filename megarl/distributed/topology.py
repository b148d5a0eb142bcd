"""The one object that owns the parallel layout.

`Topology` validates TP x PP x CP x DP = world (and the VPP / EP / SP rules) *before* any process
group exists, with messages that show the arithmetic, then initialises megatron-core's
model-parallel state (gloo on CPU, NCCL on GPU) and hands process groups down explicitly. Code
below the trainer (losses, advantages, weight sync) receives groups from here and never reads
`parallel_state` globals.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import torch

from megarl.distributed import device
from megarl.errors import UserError

MINUTE = timedelta(minutes=1)

log = logging.getLogger(__name__)


class TopologyError(UserError, ValueError):
    """A parallel layout that cannot work; the message shows the arithmetic."""


RECOMPUTE = ("none", "full")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    tensor_parallel: int = 1
    """TP degree: attention heads / MLP columns split across this many ranks."""
    pipeline_parallel: int = 1
    """PP degree: transformer layers split into this many stages."""
    virtual_pipeline_parallel: int | None = None
    """Model chunks per pipeline stage (interleaved 1F1B); None = no virtual stages."""
    context_parallel: int = 1
    """CP degree: sequence split across ranks inside attention."""
    expert_parallel: int = 1
    """EP degree for MoE experts (carved out of DP x CP)."""
    expert_tensor_parallel: int | None = None
    """TP degree inside experts; None = same as tensor_parallel."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (requires TP > 1)."""
    pipeline_layers: tuple[int, ...] | None = None
    """Explicit layers per pipeline stage (uneven split); None = even split."""
    recompute: str = "none"
    """Activation recompute in training: none, or full (each transformer layer keeps only its
    input and is recomputed in the backward pass: ~1/15 of the activation memory of a Llama
    layer for ~1/3 more compute; see `megarl plan`)."""

    def __post_init__(self):
        for name in ("tensor_parallel", "pipeline_parallel", "context_parallel", "expert_parallel"):
            if getattr(self, name) < 1:
                raise TopologyError(f"parallel.{name}={getattr(self, name)} must be >= 1")
        if self.recompute not in RECOMPUTE:
            raise TopologyError(f"parallel.recompute={self.recompute!r}; accepted: {RECOMPUTE}")
        if self.context_parallel > 1:
            # accepted silently before, yet nothing split the sequence: refuse until the TE path
            # (load-balanced 2 x CP chunks, logprobs re-assembled) exists and is tested
            raise TopologyError(
                f"parallel.context_parallel={self.context_parallel}: context parallelism is not "
                "implemented in megarl yet (the forward does not split sequences across CP ranks "
                "and megatron-core's local attention cannot do CP); accepted: 1. For long "
                "sequences use tensor_parallel with sequence_parallel=true, or pipeline_parallel"
            )


@dataclass(frozen=True)
class Topology:
    """A validated layout for `world_size` ranks. Build with `Topology.create`."""

    parallel: ParallelConfig
    world_size: int
    data_parallel: int

    @property
    def tp(self) -> int:
        return self.parallel.tensor_parallel

    @property
    def pp(self) -> int:
        return self.parallel.pipeline_parallel

    @property
    def cp(self) -> int:
        return self.parallel.context_parallel

    @property
    def dp(self) -> int:
        return self.data_parallel

    @property
    def vpp(self) -> int | None:
        return self.parallel.virtual_pipeline_parallel

    @property
    def ep(self) -> int:
        return self.parallel.expert_parallel

    @staticmethod
    def create(
        parallel: ParallelConfig,
        world_size: int,
        *,
        num_layers: int | None = None,
        num_attention_heads: int | None = None,
        num_query_groups: int | None = None,
        num_experts: int | None = None,
    ) -> Topology:
        """Validate `parallel` against the world size and the model shape; raise `TopologyError`
        naming the degrees and the rule that fails."""
        p = parallel
        tp, pp, cp, ep = (
            p.tensor_parallel,
            p.pipeline_parallel,
            p.context_parallel,
            p.expert_parallel,
        )
        model_parallel = tp * pp * cp
        if world_size % model_parallel:
            raise TopologyError(
                f"world size {world_size} is not divisible by TP x PP x CP = {tp} x {pp} x {cp} "
                f"= {model_parallel}; choose degrees whose product divides {world_size}"
            )
        dp = world_size // model_parallel
        if p.sequence_parallel and tp == 1:
            raise TopologyError("sequence_parallel=True requires tensor_parallel > 1 (got TP=1)")
        if p.virtual_pipeline_parallel is not None:
            if pp == 1:
                raise TopologyError(
                    f"virtual_pipeline_parallel={p.virtual_pipeline_parallel} requires "
                    "pipeline_parallel > 1 (got PP=1)"
                )
            if p.virtual_pipeline_parallel < 1:
                raise TopologyError("virtual_pipeline_parallel must be >= 1 or None")
            if p.pipeline_layers is not None:
                raise TopologyError("an uneven pipeline_layers split cannot be combined with VPP")
        etp = p.expert_tensor_parallel or tp
        if ep > 1 and num_experts is None and num_layers is not None:
            raise TopologyError(f"expert_parallel={ep} > 1 needs a MoE model (num_experts unset)")
        if ep > 1 or p.expert_tensor_parallel:
            if num_experts is not None and num_experts % ep:
                raise TopologyError(
                    f"num_experts={num_experts} is not divisible by expert_parallel={ep}"
                )
            # megatron-core folds experts as ETP x EP x EDP over the TP x CP x DP ranks of a stage
            if (tp * cp * dp) % (etp * ep):
                raise TopologyError(
                    f"expert layout ETP x EP = {etp} x {ep} = {etp * ep} must divide "
                    f"TP x CP x DP = {tp} x {cp} x {dp} = {tp * cp * dp}"
                )
        if etp != tp and ep == 1:
            # megatron-core marks expert parameters as such (allreduce=False: their own grad
            # reduction, TP group and DP replicas) only when EP > 1
            raise TopologyError(
                f"expert_tensor_parallel={etp} != tensor_parallel={tp} needs expert_parallel > 1 "
                "(megatron-core treats experts as dense parameters at EP=1); accepted: "
                f"expert_tensor_parallel null or {tp}, or expert_parallel > 1"
            )
        if num_attention_heads is not None:
            if num_attention_heads % tp:
                raise TopologyError(
                    f"num_attention_heads={num_attention_heads} is not divisible by TP={tp}"
                )
            groups = num_query_groups or num_attention_heads
            if groups % tp:
                raise TopologyError(
                    f"num_query_groups={groups} (KV heads) is not divisible by TP={tp}; "
                    f"megatron-core shards whole KV heads, so TP must divide {groups}"
                )
        if num_layers is not None:
            if p.pipeline_layers is not None:
                if len(p.pipeline_layers) != pp or sum(p.pipeline_layers) != num_layers:
                    raise TopologyError(
                        f"pipeline_layers={list(p.pipeline_layers)} must have PP={pp} entries "
                        f"summing to num_layers={num_layers}"
                    )
            else:
                chunks = pp * (p.virtual_pipeline_parallel or 1)
                if num_layers % chunks:
                    raise TopologyError(
                        f"num_layers={num_layers} is not divisible by PP x VPP = {pp} x "
                        f"{p.virtual_pipeline_parallel or 1} = {chunks}; set "
                        "parallel.pipeline_layers for an uneven split"
                    )
        return Topology(parallel=p, world_size=world_size, data_parallel=dp)

    @staticmethod
    def for_model(parallel: ParallelConfig, world_size: int, arch) -> Topology:
        """`create` with the shape rules of a `ModelArch` (layers, heads, KV heads, experts)."""
        return Topology.create(
            parallel,
            world_size,
            num_layers=arch.num_layers,
            num_attention_heads=arch.num_attention_heads,
            num_query_groups=arch.num_key_value_heads,
            num_experts=arch.num_experts,
        )

    def check_training(self, arch) -> None:
        """Rules that only training has (inference and conversion run without them): megatron-
        core's MoE layer refuses TP > 1 without sequence parallelism in training mode, in the
        middle of the first step; say so before anything is built."""
        tp = self.parallel.tensor_parallel
        if arch.is_moe and tp > 1 and not self.parallel.sequence_parallel:
            raise TopologyError(
                f"tensor_parallel={tp} with a MoE model (num_experts={arch.num_experts}) needs "
                "sequence_parallel=true to train (megatron-core's MoE layer refuses TP > 1 "
                "without it)"
            )

    # ----------------------------------------------------------------- process groups
    def initialize(
        self, *, seed: int = 1234, gloo_groups: bool = True, timeout: timedelta | None = None
    ) -> Groups:
        """Initialise torch.distributed (if needed) and megatron-core's parallel state.

        On CPU this also installs the CUDA emulation megatron-core needs (see `cpu.py`).
        gloo_groups=False skips megatron's gloo side groups (the dry run's fake process group
        cannot make them). `timeout`: of the collectives on every group made here (NCCL's
        watchdog aborts a collective that waits longer); None keeps torch's and megatron's
        defaults (30 minutes for megatron's groups)."""
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel

        device.setup()
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group(device.backend(), timeout=timeout)
        if torch.distributed.get_world_size() != self.world_size:
            raise TopologyError(
                f"topology was validated for world size {self.world_size} but torch.distributed "
                f"has {torch.distributed.get_world_size()} ranks"
            )
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        p = self.parallel
        ps.initialize_model_parallel(
            tensor_model_parallel_size=p.tensor_parallel,
            pipeline_model_parallel_size=p.pipeline_parallel,
            virtual_pipeline_model_parallel_size=p.virtual_pipeline_parallel,
            context_parallel_size=p.context_parallel,
            expert_model_parallel_size=p.expert_parallel,
            expert_tensor_parallel_size=p.expert_tensor_parallel,
            create_gloo_process_groups=gloo_groups,
            **({} if timeout is None else {"distributed_timeout_minutes": timeout / MINUTE}),
        )
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        return Groups.from_parallel_state()


@dataclass(frozen=True)
class Groups:
    """Process groups and this rank's coordinates, passed down explicitly."""

    tp: object
    pp: object
    dp: object
    dp_cp: object
    cp: object
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_size: int
    pp_size: int
    dp_size: int
    ep_rank: int
    ep_size: int
    ep: object

    @staticmethod
    def from_parallel_state() -> Groups:
        from megatron.core import parallel_state as ps

        return Groups(
            tp=ps.get_tensor_model_parallel_group(),
            pp=ps.get_pipeline_model_parallel_group(),
            dp=ps.get_data_parallel_group(),
            dp_cp=ps.get_data_parallel_group(with_context_parallel=True),
            cp=ps.get_context_parallel_group(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            dp_rank=ps.get_data_parallel_rank(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            pp_size=ps.get_pipeline_model_parallel_world_size(),
            dp_size=ps.get_data_parallel_world_size(),
            ep_rank=ps.get_expert_model_parallel_rank(),
            ep_size=ps.get_expert_model_parallel_world_size(),
            ep=ps.get_expert_model_parallel_group(),
        )

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1
