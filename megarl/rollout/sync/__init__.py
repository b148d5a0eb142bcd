"""Megatron -> engine: the policy's weights into the engines that generate with them.

One interface (`WeightSender.sync() -> SyncStats`), chosen once per run by the placement:
`ColocatedWeights` / `ColocatedAdapters` (`colocated`, `adapters`) write this process's engine
through a reshard plan built once (`plan`, `reshard`); `SeparateWeights` / `SeparateAdapters`
(`separate`) send to engine ranks over links, whose side is `receiver.Receiver`. `naive_sync`
(`colocated`) is the bitwise reference; `checksum` the sums both sides of a transfer compare.
"""

from __future__ import annotations

from typing import Protocol

from megarl.rollout.sync.stats import SyncError, SyncStats

__all__ = ["SyncError", "SyncStats", "WeightSender"]


class WeightSender(Protocol):
    def sync(self) -> SyncStats:
        """Make the policy's current weights the ones the engines generate with (collective
        over the trainer ranks)."""
