"""The shipped Slurm script, run for real (extended tier): a Slurm controller and one node on
this machine (tests/slurm_cluster.py) run `examples/slurm_llama3_70b.sh` in its CPU form (the
script's comments say what differs: sbatch options for one CPU node, MEGARL_CONFIG empty for the
embedded default, one rank per node).

USR1 before the time limit -> the script's trap writes the stop file -> megarl checkpoints the
finished step and writes stopped.json -> the script runs `scontrol requeue` -> the requeued job
(same job id, restart 1) resumes in the same run directory and trains to the end, with metrics
equal to a straight run of the same script, step for step (timings aside).

The time limit is what makes Slurm send USR1 (`--signal=B:USR1@300`): once the run has done a
few steps the test shortens the job's limit to 2-3 minutes away, within the lead time, so
Slurm's next time check (it runs every 30 s) sends the signal then instead of after an hour.
While the requeued job waits (Slurm holds a requeued job for about two minutes), the test
gives it its hour back and lets it start now. Every process runs with one thread
(OMP_NUM_THREADS=1): the resumed run then adds in the same order as the straight one.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import pytest

from megarl.distributed.launch import free_port

pytestmark = [pytest.mark.slow, pytest.mark.extended, pytest.mark.timeout(3000)]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "slurm_llama3_70b.sh")
ONE_CPU_NODE = ["--nodes=1", "--gpus-per-node=0", f"--cpus-per-task={os.cpu_count()}"]
STEPS = 40
TRAIN = ["--set", f"trainer.steps={STEPS}", "--set", "logging.wandb=false",
         "--set", "logging.progress=false", "--set", "trainer.save_every=1000"]  # fmt: skip
LEAD_S = 300
TIMINGS = {"time_s", "tokens_per_s"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("starting slurmctld, slurmd and munged needs root")
    install = subprocess.run(["bash", os.path.join(ROOT, "tests", "install_slurm.sh")],
                             capture_output=True, text=True)  # fmt: skip
    if install.returncode == 3:
        pytest.skip(install.stdout.strip())
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-2000:]
    from tests.slurm_cluster import SlurmCluster

    with SlurmCluster(tmp_path_factory.mktemp("slurm")) as c:
        yield c


def _env(runs, name: str) -> dict:
    venv_bin = os.path.dirname(sys.executable)
    return {
        "MEGARL_CONFIG": "",  # the embedded default
        "NPROC_PER_NODE": "1",
        "RUN_ROOT": str(runs),
        "RUN_NAME": name,
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
        "PATH": f"{venv_bin}:{os.environ['PATH']}",
        "PYTHONPATH": ROOT,
    }


def _seconds(hms: str) -> int:
    days, _, hms = hms.rpartition("-")
    h, m, s = (int(x) for x in hms.split(":"))
    return int(days or 0) * 86400 + h * 3600 + m * 60 + s


def _metrics(run) -> list[dict]:
    path = os.path.join(run, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [{k: v for k, v in json.loads(ln).items() if k not in TIMINGS} for ln in f if ln]


def _done(fields: dict) -> bool:
    return fields.get("JobState") in ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "NODE_FAIL")


def test_the_slurm_script_stops_requeues_and_resumes_to_a_straight_runs_metrics(cluster, tmp_path):
    runs = tmp_path / "runs"
    log = tmp_path / "slurm-%j.out"
    common = [*ONE_CPU_NODE, f"--output={log}", "--time=60"]
    # the straight run: the same script, the same steps, nothing stops it
    straight = cluster.sbatch(SCRIPT, *common, args=TRAIN, env=_env(runs, "straight"), cwd=ROOT)
    fields = cluster.wait(straight, _done, timeout=1500)
    out = (tmp_path / f"slurm-{straight}.out").read_text()
    assert fields["JobState"] == "COMPLETED", out[-4000:]
    want = _metrics(runs / "straight")
    assert [r["step"] for r in want] == list(range(1, STEPS + 1)), out[-4000:]

    job = cluster.sbatch(SCRIPT, *common, f"--signal=B:USR1@{LEAD_S}", args=TRAIN,
                         env=_env(runs, "stopped"), cwd=ROOT)  # fmt: skip
    run = runs / "stopped"
    deadline = time.monotonic() + 900
    while len(_metrics(run)) < 3:  # training is under way
        assert time.monotonic() < deadline and not _done(cluster.job(job)), cluster.job(job)
        time.sleep(1)
    elapsed = _seconds(cluster.job(job)["RunTime"])
    limit_min = math.ceil((elapsed + 150) / 60)  # 2.5 to 3.5 minutes left: inside the lead time
    cluster.scontrol("update", f"JobId={job}", f"TimeLimit={limit_min}")

    # Slurm's USR1 -> stop file -> checkpoint -> stopped.json -> `scontrol requeue`
    fields = cluster.wait(job, lambda f: f.get("Restarts") == "1" or _done(f), timeout=600)
    assert fields.get("Restarts") == "1", (fields, (tmp_path / f"slurm-{job}.out").read_text())
    stopped = json.loads((run / "stopped.json").read_text())
    assert 3 <= stopped["step"] < STEPS and stopped["checkpoint_written"], stopped
    cluster.scontrol("update", f"JobId={job}", "TimeLimit=60", "StartTime=now")
    fields = cluster.wait(job, _done, timeout=1500)
    out = (tmp_path / f"slurm-{job}.out").read_text()  # --open-mode=append: both attempts
    assert fields["JobState"] == "COMPLETED", out[-4000:]
    assert "USR1: asking megarl to stop after the current step" in out
    assert f'megarl stopped after a checkpoint: {{ "step": {stopped["step"]},' in out
    assert f"requeueing job {job}" in out and "restart 1)" in out
    assert f"resumed from {stopped['checkpoint']} at step {stopped['step']}" in out
    got = _metrics(run)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert got == want
