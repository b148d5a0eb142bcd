"""On CPU megarl runs vLLM's two torch.compile'd integer helpers eagerly
(`megarl.rollout.engine.vllm_patches.eager_integer_helpers`): no inductor build at a process's
first generation, the same integers. Checked in a child with dynamo on (the suite turns it off)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

CHILD = r"""
import json, torch
from torch._dynamo.utils import counters
from megarl.rollout.engine import vllm_patches
from vllm.model_executor.layers import vocab_parallel_embedding as vpe
from vllm.v1.sample import sampler

vllm_patches.eager_integer_helpers()
x = torch.randn(5, 300, generator=torch.Generator().manual_seed(0))
values = x[:, 7:8]
ranks = sampler.batched_count_greater_than(x, values)
ids = torch.tensor([0, 5, 31, 32, 40, 47, 60])
masked, mask = vpe.get_masked_input_and_mask(ids, 0, 32, 0, 32, 48)
print(json.dumps({
    "frames": counters["frames"]["total"],
    "ranks": ranks.tolist(), "expected": (x >= values).sum(-1).tolist(),
    "masked": masked.tolist(), "mask": mask.tolist(),
}))
"""


def test_the_helpers_run_eagerly_with_the_same_integers():
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "0"}
    out = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["frames"] == 0  # nothing traced: the helpers are the plain functions
    assert r["ranks"] == r["expected"]
    # ids of the shard's vocabulary [0, 32) and added [32, 48) kept, the rest masked to 0
    assert r["masked"] == [0, 5, 31, 32, 40, 47, 0]
    assert r["mask"] == [False, False, False, False, False, False, True]
