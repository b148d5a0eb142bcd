"""`torchrun ... -m tests.lagged_worker train ...`: megarl's command line with the colocated
engine one update behind, the sequential reference of an asynchronous run a step ahead
(tests/test_separate_e2e.py).

Each update reaches the engine one step late: a step generates with the weights the engine
holds, then the weights of the update before it are written (`ColocatedRollout.generate`
wrapped here), and the sync at the end of a step does nothing. So step t trains the samples of
the weights before update t-1, at the weights after it: what `rollout.placement.max_staleness: 1` on
separate engines does, one step after another in one process. The sync at setup is kept (the
engine starts from the initial weights). Held-out evaluation is not lagged: run it with
`eval.every=0`. megarl reads none of this.
"""

from __future__ import annotations


def install() -> None:
    from megarl.rollout import SyncStats
    from megarl.rollout.placement.colocated import ColocatedRollout

    generate, sync_weights = ColocatedRollout.generate, ColocatedRollout.sync_weights

    def generate_then_sync(self, *args, **kwargs):
        rollout = generate(self, *args, **kwargs)
        if getattr(self, "lagged_update", False):
            sync_weights(self)  # the weights of the update before this step, after its samples
        return rollout

    def sync_one_step_late(self) -> SyncStats:
        if not hasattr(self, "lagged_update"):  # at setup: the initial weights, now
            self.lagged_update = False
            return sync_weights(self)
        self.lagged_update = True
        return SyncStats(mode="lagged", bytes=0, seconds=0.0)

    ColocatedRollout.generate = generate_then_sync
    ColocatedRollout.sync_weights = sync_one_step_late


if __name__ == "__main__":
    from megarl import cli

    install()
    raise SystemExit(cli.main())
