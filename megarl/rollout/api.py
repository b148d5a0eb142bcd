"""What the trainer asks of a rollout, whatever its kind or placement (`RolloutComponent`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from megarl.rollout.samples import Samples
from megarl.rollout.sync.stats import SyncStats

if TYPE_CHECKING:  # an annotation only: importing it imports torch
    from megarl.metrics.reduce import LocalMetrics


class RolloutComponent(Protocol):
    """The rollout as the trainer sees it. Every method is collective over the trainer's
    ranks. Built by `megarl.rollout.build_rollout`; closed by its owner (`close`)."""

    def generate(
        self, prompts, positions: list[int], seed: int, *, upcoming=(), **sampling
    ) -> Samples:
        """The samples of this DP rank's `prompts` (a `megarl.data.dataset.PromptBatch`: token
        ids, raw prompts, columns); `positions`: each prompt's place in the step's global batch
        (its sampling seed depends on that, not on the split); `upcoming`: the requests (prompt
        batch, positions, seed) of the next steps, which a rollout that runs ahead
        (`max_staleness` > 0) starts generating now; `sampling`: overrides of n, greedy,
        temperature, max_tokens (trajectories: per turn)."""

    def release(self) -> None:
        """Give the trainer the memory generation held, until the next `sync_weights`."""

    def sync_weights(self) -> SyncStats:
        """Make the policy's current weights the ones generation uses."""

    def metrics(self, samples: Samples) -> LocalMetrics:
        """A training step's figures of its samples (trajectories, staleness)."""

    def samples_generated(self) -> int:
        """Samples this rank's engines generated in the last `generate` (each counted once in
        the world)."""

    def close(self) -> None:
        """Shut the engines down (separate engines: take the answers still owed first)."""
