"""Multi-turn training end to end through `megarl train` (the embedded copy task with the
`CopyAgain` environment of tests/envs_for_tests.py): PPO (GAE over sampled tokens only) runs,
logs the trajectory metrics and whole conversations, and evaluates held-out prompts with the
environment (`eval/...`, `eval_samples.jsonl`); `megarl eval` of its config gives the run's step-0
evaluation; a run on separate engines (`rollout.placement.mode: separate`: the environments run on
the engine rank), stopped after its first step and resumed, equals the straight colocated run bit
for bit, evaluations included (the environments' seeds come from the step seed and the sample's
place, nothing to save). Those run with one thread per process, so that all add in the same
order. An agent (`env.agent`) whose reward is the run's only one trains through the endpoint a
step ahead on a separate engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.test_trainer_e2e import ROOT, _metrics, _same_metrics, _train

ENV = [
    "env.name=tests.envs_for_tests:CopyAgain",
    "env.kwargs={again: ' copy {answer}='}",
    "env.max_turns=3",
    "env.max_tokens=24",
    "rollout.sampling.max_tokens=6",
    "rollout.sampling.n=4",
    "data.prompts_per_step=8",
    "algorithm.micro_batch_size=32",
    "optim.decay_steps=64",
    "logging.samples_per_step=4",
]
EVAL = ["eval.every=2", "eval.fraction=0.05", "eval.max_prompts=4"]  # steps 0 and 2
TRAJECTORIES = 8 * 4  # data.prompts_per_step x rollout.sampling.n


PPO, ONE = "examples/ppo_tiny_cpu.yaml", {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The colocated PPO run at one rank, 2 steps, evaluated at steps 0 and 2."""
    out = tmp_path_factory.mktemp("multi_turn") / "straight"
    _train(out, *ENV, *EVAL, "trainer.steps=2", config=PPO, env=ONE)
    return out


@pytest.mark.slow
def test_multi_turn_ppo_on_separate_engines_resumes_exactly_and_logs_conversations(
    straight, tmp_path
):
    halves = tmp_path / "halves"
    ppo, one = PPO, ONE
    separate = [*ENV, *EVAL, "rollout.placement.mode=separate", "rollout.placement.ranks=1"]
    _train(halves, *separate, "trainer.steps=1", config=ppo, env=one, nproc=2)
    _train(halves, *separate, "trainer.steps=2", config=ppo, env=one, nproc=2)
    rows, other = _metrics(straight), _metrics(halves)
    _same_metrics(*(_training(r) for r in (rows, other)))
    # the same held-out figures at steps 0 and 2 (the first half also evaluated its last step)
    straight_evals, halves_evals = _evals(rows), _evals(other)
    assert sorted(straight_evals) == [0, 2] and sorted(halves_evals) == [0, 1, 2]
    for step in (0, 2):
        assert straight_evals[step] == halves_evals[step], step
    steps = _training(rows)
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        _check_trajectory_metrics(r, "rollout")
        assert "value_loss" in r and r["logprob_mismatch_max"] <= 1e-4
    # held-out evaluation runs the environment too: the same figures under eval/
    evals = [r for r in rows if "eval/reward_mean" in r]
    assert [r["step"] for r in evals] == [0, 2]
    for r in evals:
        _check_trajectory_metrics(r, "eval")
    with open(os.path.join(straight, "eval_samples.jsonl")) as f:
        held_out = [json.loads(line) for line in f]
    assert held_out and all(s["conversation"][0]["role"] == "user" for s in held_out)
    for s in held_out:  # a reward after every turn but one cut at its max_tokens
        cut = s["finish_reason"] == "length"
        assert s["turns"] - cut <= len(s["turn_rewards"]) <= s["turns"], s
        assert (s["env_reward"] is None) == (s["turn_rewards"] == []), s
    # megarl eval of the run's config (the untrained policy, the same environment) is step 0's
    out = tmp_path / "eval"
    cmd = [sys.executable, "-m", "megarl", "eval", str(straight / "config.yaml"), "--out",
           str(out), "--set", "logging.wandb=false", "--set", "logging.progress=false"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **one})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    (rec,) = _metrics(out)
    assert rec["step"] == 0
    figures = {k for k in evals[0] if k.startswith("eval/") and "time_s" not in k}
    assert {k: rec[k] for k in figures} == {k: evals[0][k] for k in figures}
    assert rec["eval/turns"] >= 1 and "eval/env" in rec
    with open(os.path.join(straight, "samples.jsonl")) as f:
        samples = [json.loads(line) for line in f]
    multi = [s for s in samples if s["turns"] > 1]
    assert multi, "no sample went past its first turn"
    roles = [m["role"] for m in multi[0]["conversation"]]
    assert roles[:3] == ["user", "assistant", "user"] and roles[-1] == "assistant"
    assert multi[0]["conversation"][2]["content"].startswith(" copy ")
    for s in samples:  # a reward after every turn but one cut at its max_tokens
        cut = s["finish_reason"] == "length"
        assert s["turns"] - cut <= len(s["turn_rewards"]) <= s["turns"], s


# what step 1 draws and scores, before any update: the same at every trainer layout
ROLLOUT_FIGURES = ("reward_mean", "response_len", "rollout/", "reward/")


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(
            ["parallel.tensor_parallel=2", "parallel.sequence_parallel=true"], id="tp2-sp"
        ),
        pytest.param(["parallel.pipeline_parallel=2"], id="pp2", marks=pytest.mark.extended),
    ],
)
def test_multi_turn_ppo_at_tp2_and_pp2_starts_as_the_one_rank_run(straight, tmp_path, layout):
    """Two trainer ranks at TP2 with sequence parallelism (extended: PP2), colocated: the
    held-out evaluation at step 0 and step 1's
    trajectories and rewards are the one-rank run's exactly (the same weights and seeds at any
    layout), its losses and values within fp32 reordering; GAE, the trainer's logprobs of the
    trajectories and a second step run at that layout."""
    out = tmp_path / "run"
    _train(out, *ENV, *EVAL, "trainer.steps=2", *layout, config=PPO, env=ONE, nproc=2)
    ref, rows = _metrics(straight), _metrics(out)
    assert _evals(rows)[0] == _evals(ref)[0]
    one, two = _training(ref)[0], _training(rows)[0]
    drawn = {k for k in one if k.startswith(ROLLOUT_FIGURES) and "time_s" not in k}
    assert {k: two[k] for k in drawn} == {k: one[k] for k in drawn}
    assert one["rollout/turns"] > 1  # trajectories went on after a wrong copy
    for key in ("loss", "pg_loss", "value_loss", "value_mean", "entropy"):
        assert two[key] == pytest.approx(one[key], abs=1e-5), key
    for r in _training(rows):
        _check_trajectory_metrics(r, "rollout")
        assert r["logprob_mismatch_max"] <= 1e-4  # the engine samples the trainer's weights


def _training(rows: list[dict]) -> list[dict]:
    """The steps' records without their evaluation figures."""
    return [{k: v for k, v in r.items() if not k.startswith("eval/")} for r in rows
            if "reward_mean" in r]  # fmt: skip


def _evals(rows: list[dict]) -> dict[int, dict]:
    """step -> its evaluation's figures (timings left out)."""
    return {
        r["step"]: {k: v for k, v in r.items() if k.startswith("eval/") and "time_s" not in k}
        for r in rows
        if "eval/reward_mean" in r
    }


def _check_trajectory_metrics(r: dict, p: str) -> None:
    """A step's (`p` = rollout) or an evaluation's (`p` = eval) multi-turn figures, against each
    other: CopyAgain's step counts a tool call, and a tool error for a wrong copy; a right copy
    gets reward 1 and ends the trajectory (stop). A turn cut at rollout.sampling.max_tokens ends it
    without a step (length)."""
    env = "reward/env" if p == "rollout" else "eval/env"
    assert 1 <= r[f"{p}/turns"] <= 3
    assert r[f"{p}/env_errors"] == 0 and r[f"{p}/malformed_tool_calls"] == 0
    assert sum(r[f"{p}/finish_{k}"] for k in ("stop", "length", "max_turns", "env_error")) == 1
    assert r[f"{p}/env_time_s"] > 0  # time in environment code was measured
    # per trajectory, summed from each step's info: a step after every turn but a cut one
    calls, turns = r[f"{p}/tool_calls"], r[f"{p}/turns"]
    assert turns - r[f"{p}/finish_length"] - 1e-9 <= calls <= turns + 1e-9
    assert r[f"{p}/tool_errors"] == pytest.approx(calls - r[f"{p}/finish_stop"])
    # the environment's reward: 1 for the stopped (right) ones, over those it answered
    assert r[env] >= r[f"{p}/finish_stop"] - 1e-9 and 0 <= r[env] <= 1
    if p == "rollout":  # a share of the step's trajectories (none failed: all were checked)
        k = r["rollout/retokenize_diff"] * TRAJECTORIES
        assert k == pytest.approx(round(k), abs=1e-9)


@pytest.mark.slow
def test_an_agent_trains_through_the_endpoint(tmp_path):
    """`env.agent`: an OpenAI client per trajectory drives the policy through megarl's endpoint; the
    run trains on its token-exact trajectories and logs them like an environment's. The agent's
    reward is the run's only one (`reward.functions: []`). Here the agents and the endpoint run on a
    separate engine rank that generates a step ahead (`rollout.placement.max_staleness=1`: step 2's
    samples are one update old) and takes the update between two waves of turns when it arrives
    during one (`rollout.placement.inflight_updates`). When the update reaches step 2's trajectories
    depends on timing (the agents start their clients first); no setting makes it deterministic
    here, so the test checks the age figures agree with each other whichever way it went
    (test_multi_turn checks in-flight updates between waves token by token)."""
    agent = ["env.agent=tests.envs_for_tests:copy_agent", *ENV[2:],
             "rollout.placement.mode=separate", "rollout.placement.ranks=1",
             "rollout.placement.max_staleness=1", "reward.functions=[]", "reward.weights=null",
             "algorithm.off_policy_correction=decoupled", "rollout.placement.inflight_updates=true"]
    _train(tmp_path, *agent, "trainer.steps=2", nproc=2)
    rows = _metrics(tmp_path)
    # step 1 has nothing generated ahead: on-policy. Step 2's trajectories were asked for while
    # step 1 trained; the update reaches them before their first wave (all tokens new), between
    # two waves (in flight: old tokens, then new) or after them (one update old), by timing.
    assert rows[0]["rollout/staleness_max"] == 0
    second = {k.removeprefix("rollout/"): v for k, v in rows[1].items()}
    assert second["staleness_max"] in (0, 1)
    assert second["staleness_share_0"] + second["staleness_share_1"] == 1
    assert second["staleness_mean"] == pytest.approx(second["staleness_share_1"])
    inflight = second["inflight_share"] > 0
    # an update that reached running trajectories made their later tokens newer than their first
    assert (second["token_staleness_mean"] < second["staleness_mean"]) == inflight
    assert second["staleness_max"] == 1 or not inflight
    for r in rows:
        assert 1 <= r["rollout/turns"] <= 3 and r["rollout/env_errors"] == 0
        # the agent's reward alone: the total is reward.env_weight (1) x the agent's
        assert r["reward_mean"] == pytest.approx(r["reward/env"])
        assert not [k for k in r if k.startswith("reward/") and k != "reward/env"]
        # untrained turns rarely re-tokenize to the sampled ids: a share of the trajectories
        k = r["rollout/retokenize_diff"] * TRAJECTORIES
        assert k == pytest.approx(round(k), abs=1e-9)
    # step 1 is on-policy: the engine's logprobs are the trainer's
    assert rows[0]["logprob_mismatch_max"] <= 1e-4
    with open(os.path.join(tmp_path, "samples.jsonl")) as f:
        samples = [json.loads(line) for line in f]
    multi = [s for s in samples if s["turns"] > 1]
    assert multi, "no agent asked twice"
    assert [m["role"] for m in multi[0]["conversation"]][:3] == ["user", "assistant", "user"]
