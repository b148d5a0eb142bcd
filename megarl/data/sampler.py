"""Which prompts each step uses, on every data-parallel rank, resumable.

The global prompt stream is the concatenation of per-epoch orders: epoch e is a permutation of
`range(num_rows)` seeded with `seed + e` (numpy PCG64), or the identity when `shuffle=False`.
Step k takes stream positions [k * P, (k + 1) * P) with P = `prompts_per_step`, so every prompt
appears exactly once per epoch and a step may span two epochs. Every rank computes the same stream
(no communication) and takes its contiguous share: rank r of D gets the step's global list
[r * P / D, (r + 1) * P / D).

The P prompts of one step are always distinct, because the advantage stage uses their global
indices as group ids. When a step spans epochs e-1 and e, the head of epoch e's permutation is
adjusted: prompts that already sit in epoch e-1's tail of that step are moved back just behind
the head (stable; at most P positions of the epoch change). This needs num_rows >= P.

The state is global — (epoch, position in the epoch) — so a run resumes exactly, even with a
different number of data-parallel ranks.
"""

from __future__ import annotations

import numpy as np

from megarl.data.dataset import DataError


class PromptSampler:
    """Infinite, deterministic, DP-sharded prompt order. `next_step()` -> this rank's indices."""

    def __init__(
        self,
        num_rows: int,
        *,
        prompts_per_step: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if num_rows < 1:
            raise ValueError(f"PromptSampler: num_rows must be >= 1, got {num_rows}")
        if prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be >= 1, got {prompts_per_step}")
        if prompts_per_step > num_rows:
            raise DataError(
                f"data.prompts_per_step={prompts_per_step} > {num_rows} prompts in the dataset: a "
                "step would hold a prompt twice, and prompt ids are the advantage groups"
            )
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(
                f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank}, dp_size={dp_size}"
            )
        if prompts_per_step % dp_size:
            raise DataError(
                f"data.prompts_per_step={prompts_per_step} is not divisible by the data-parallel "
                f"size {dp_size} ({prompts_per_step} % {dp_size} = {prompts_per_step % dp_size}); "
                "every DP rank must get the same number of prompts"
            )
        self.num_rows = num_rows
        self.prompts_per_step = prompts_per_step
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        """Epoch of the next prompt to hand out."""
        self.position = 0
        """Position of the next prompt within that epoch's order."""
        self.steps = 0
        """Steps handed out so far (over the whole run, resumed state included)."""
        self.last_global_indices: list[int] = []
        """All P prompt indices of the last step, in global order (identical on every rank)."""
        self._cached: tuple[int, np.ndarray] | None = None

    @property
    def rank_slice(self) -> slice:
        """This rank's part of `last_global_indices`."""
        share = self.prompts_per_step // self.dp_size
        return slice(self.dp_rank * share, (self.dp_rank + 1) * share)

    def next_step(self) -> list[int]:
        """Advance one step; return this rank's contiguous share of the step's prompt indices."""
        out: list[int] = []
        while len(out) < self.prompts_per_step:
            order = self._order(self.epoch)
            take = min(self.prompts_per_step - len(out), self.num_rows - self.position)
            out.extend(int(i) for i in order[self.position : self.position + take])
            self.position += take
            if self.position == self.num_rows:
                self.epoch, self.position = self.epoch + 1, 0
        self.steps += 1
        self.last_global_indices = out
        return out[self.rank_slice]

    def state_dict(self) -> dict:
        """Global state (no rank in it): load it into a sampler with any dp_size."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "steps": self.steps,
            "num_rows": self.num_rows,
            "prompts_per_step": self.prompts_per_step,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state`. The stream depends on num_rows, prompts_per_step, seed and
        shuffle, so each must equal the saved value (ValueError naming the one that differs)."""
        for name in ("num_rows", "prompts_per_step", "seed", "shuffle"):
            if state[name] != getattr(self, name):
                raise DataError(
                    f"PromptSampler state was saved with {name}={state[name]!r} but this run has "
                    f"{name}={getattr(self, name)!r}; the prompt order would not continue"
                )
        if not 0 <= state["position"] < self.num_rows or state["epoch"] < 0:
            raise ValueError(f"PromptSampler state out of range: {state}")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.steps = int(state["steps"])
        self.last_global_indices = []

    def _base(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_rows)
        return np.random.default_rng(self.seed + epoch).permutation(self.num_rows)

    def _order(self, epoch: int) -> np.ndarray:
        """Epoch `epoch`'s order: its permutation with the cross-epoch step de-duplicated."""
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        n, p = self.num_rows, self.prompts_per_step
        if epoch == 0:
            order = self._base(0)
        elif n >= 2 * p:
            # The de-duplication changes only positions < P, so the previous epoch's tail
            # (its last < P positions, all >= n - P >= P) is that of its plain permutation.
            order = _fix_head(self._base(epoch), self._base(epoch - 1), (epoch * n) % p, p)
        else:
            order = self._base(0)
            for e in range(1, epoch + 1):
                order = _fix_head(self._base(e), order, (e * n) % p, p)
        self._cached = (epoch, order)
        return order


def _fix_head(order: np.ndarray, previous: np.ndarray, tail_len: int, p: int) -> np.ndarray:
    """Reorder `order` so its first `p - tail_len` entries avoid the last `tail_len` entries of
    `previous` (they share a step); the displaced entries follow the head in their order."""
    if tail_len == 0:
        return order
    tail = set(previous[-tail_len:].tolist())
    head: list[int] = []
    deferred: list[int] = []
    scanned = 0
    while len(head) < p - tail_len:
        x = int(order[scanned])
        (deferred if x in tail else head).append(x)
        scanned += 1
    if not deferred:
        return order
    return np.concatenate([np.array(head + deferred, dtype=order.dtype), order[scanned:]])
