"""A two-node launch on one machine (extended tier): two torchrun agents joined by c10d
rendezvous (`--nnodes 2 --nproc_per_node 1 --rdzv_backend c10d --rdzv_endpoint
127.0.0.1:PORT --rdzv_id ID`, the same command in two processes, as `srun` starts one per node)
train the default task with the same metrics, step for step (timings aside), as one agent with
two ranks (`--nnodes 1 --nproc_per_node 2`):

- colocated: each node holds one trainer rank (DP2) and its engine;
- separate (`rollout.placement.ranks=1`): the node of rank 0 holds every trainer rank, the other
  node the engine rank, so prompts, samples and weights cross between the agents over the link.

Every process runs with one thread (OMP_NUM_THREADS=1), so both launches add in the same order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from megarl.distributed.launch import free_port

pytestmark = [pytest.mark.slow, pytest.mark.extended, pytest.mark.timeout(1800)]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = ["logging.wandb=false", "logging.progress=false", "trainer.steps=3",
       "data.prompts_per_step=8", "rollout.sampling.n=4"]  # fmt: skip
SEPARATE = ["rollout.placement.mode=separate", "rollout.placement.ranks=1"]
TIMINGS = {"time_s", "tokens_per_s"}


def _launch(out, overrides: list[str], *, nnodes: int) -> list[str]:
    """`torchrun --nnodes N --nproc_per_node 2/N` with c10d rendezvous, one agent per node,
    all on this machine; the agents' logs (each fails the test unless its status is 0)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
           "--nproc_per_node", str(2 // nnodes), "--rdzv_backend", "c10d",
           "--rdzv_endpoint", f"127.0.0.1:{free_port()}", "--rdzv_id", uuid.uuid4().hex,
           "-m", "megarl", "train", "--out", str(out)]  # fmt: skip
    for o in (*RUN, *overrides):
        cmd += ["--set", o]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    logs = [f"{out}.node{i}.log" for i in range(nnodes)]
    files = [open(p, "w") for p in logs]  # noqa: SIM115 (files, not pipes: nothing blocks)
    try:
        agents = [subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env)
                  for f in files]  # fmt: skip
        codes = [a.wait(timeout=900) for a in agents]
    finally:
        for f in files:
            f.close()
    texts = [open(p).read() for p in logs]
    for code, text in zip(codes, texts, strict=True):
        assert code == 0, text[-4000:]
    return texts


def _metrics(out) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(ln).items() if k not in TIMINGS} for ln in f]


@pytest.mark.parametrize("placement", ["colocated", "separate"])
def test_two_torchrun_nodes_train_as_one_node_with_two_ranks(tmp_path, placement):
    overrides = SEPARATE if placement == "separate" else []
    _launch(tmp_path / "one", overrides, nnodes=1)
    logs = _launch(tmp_path / "two", overrides, nnodes=2)
    one, two = _metrics(tmp_path / "one"), _metrics(tmp_path / "two")
    assert [r["step"] for r in two] == [1, 2, 3]
    assert two == one
    # rank 0 (trainer rank 0, which reports the run) ran under one agent, the other rank under
    # the other: the run really spanned both "nodes"
    assert sum("megarl: run directory" in text for text in logs) == 1, [t[-800:] for t in logs]
