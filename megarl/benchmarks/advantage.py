"""Benchmark suite `advantage`: outcome advantages for 1M rewards, single process and DP=2.

Figures (times, lower is better):
- `single_<estimator>_G<G>`: one call of the estimator on 1M float32 rewards (scale='group').
  Floor: the memory traffic it cannot avoid, reading and writing 1M floats at memcpy speed.
- `dp2_<estimator>_G<G>`: `gather_advantages` on 2 gloo ranks holding 500k rewards each (whole
  groups per rank), slowest rank. Floor: one all_gather of the same reward bytes (500k float32
  per rank) measured in the same processes. The stage adds a size exchange, the run-length
  encoded group ids (12 bytes per group), the group check and the estimator on the global batch.
`--quick` uses 64k rewards.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from megarl.algorithms.advantages import get_advantage
from megarl.algorithms.distributed_advantage import gather_advantages
from megarl.benchmarks import median_time, memcpy_gbps, record, register_suite
from megarl.distributed.launch import spawn

ESTIMATORS = ("grpo", "rloo")
GENERATIONS = (8, 16)


def _rewards(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (n,), generator=g).to(torch.float32)


def _dist_times(rank: int, world_size: int, n_total: int, repeats: int) -> dict[str, float]:
    """Per-rank median seconds of each distributed figure and of the all_gather floor."""
    n_local = n_total // world_size
    rewards = _rewards(n_total)[rank * n_local : (rank + 1) * n_local].contiguous()
    idx = torch.arange(rank * n_local, (rank + 1) * n_local)

    def timed(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            dist.barrier()
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    out = {}
    chunks = [torch.empty_like(rewards) for _ in range(world_size)]
    out["all_gather"] = timed(lambda: dist.all_gather(chunks, rewards))
    for g in GENERATIONS:
        ids = idx // g
        for name in ESTIMATORS:
            out[f"{name}_G{g}"] = timed(
                lambda name=name, g=g, ids=ids: gather_advantages(
                    rewards,
                    ids,
                    estimator=name,
                    num_generations=g,
                    scale="group",
                    group=None,
                )
            )
    return out


@register_suite("advantage")
def suite(args) -> list[dict]:
    quick = bool(getattr(args, "quick", False))
    n = 65_536 if quick else 1_000_000
    repeats = 3 if quick else 7
    records = []
    rewards = _rewards(n)
    # read B floats + write B floats at the machine's copy bandwidth
    floor_s = 2 * rewards.numel() * rewards.element_size() / (memcpy_gbps() * 1e9)
    for g in GENERATIONS:
        for name in ESTIMATORS:
            fn = get_advantage(name)
            t = median_time(lambda fn=fn, g=g: fn(rewards, g, "group"), repeats=repeats)
            records.append(
                record(
                    f"single_{name}_G{g}",
                    t * 1e3,
                    "ms",
                    floor=floor_s * 1e3,
                    floor_unit="ms",
                    higher_is_better=False,
                    rewards=n,
                    num_generations=g,
                    scale="group",
                )
            )
    world = 2
    per_rank = spawn(_dist_times, world, n, repeats)
    slowest = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
    gather_s = slowest.pop("all_gather")
    for key, t in slowest.items():
        name, g = key.rsplit("_G", 1)
        records.append(
            record(
                f"dp{world}_{key}",
                t * 1e3,
                "ms",
                floor=gather_s * 1e3,
                floor_unit="ms (one all_gather of the reward bytes)",
                higher_is_better=False,
                rewards=n,
                ranks=world,
                num_generations=int(g),
                estimator=name,
                scale="group",
                backend="gloo",
            )
        )
    return records
