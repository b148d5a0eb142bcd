"""glibc's allocator in a CPU process (`megarl.distributed.heap`): after `reuse_heap_blocks`, a
64 MiB block (above glibc's largest default mmap threshold, 32 MiB) comes from the heap, and a
block written after one is freed reuses its pages: of three such writes the fewest page faults
is near 0 (glibc's default mmaps each block: 16k faults every time; one write in about four
lands on fresh pages even with the setting, seen idle). The environment's own MALLOC_*
settings win. Each case runs in a process of its own: the setting lasts for the process's
life."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megarl.distributed import heap

CODE = """
import resource
import torch
from megarl.distributed import heap
from tests.test_sync_plan import _in_heap
before = torch.empty(64 * 2**20 // 4)
applied = heap.reuse_heap_blocks()
after = torch.empty(64 * 2**20 // 4)
in_heap = _in_heap(after.data_ptr())
del after
torch.ones(64 * 2**20 // 4)  # written, then freed
fewest = 16384
for _ in range(3):  # a write now and then lands on fresh pages (1 in 4 seen): the fewest faults
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(64 * 2**20 // 4)  # 16384 pages
    fewest = min(fewest, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
reused = fewest < 1000
print(applied, _in_heap(before.data_ptr()), in_heap, reused)
"""


def _run(env: dict) -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-c", CODE], cwd=root, env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.split("\n")[-2]


@pytest.mark.skipif(heap.libc() is None, reason="glibc's mallopt only")
def test_large_blocks_come_from_the_heap_after_the_setting_unless_the_environment_says():
    env = {k: v for k, v in os.environ.items() if k not in heap.ENV}
    assert _run(env) == "True False True True"
    assert _run({**env, "MALLOC_TOP_PAD_": str(2**20)}) == "False False False False"
