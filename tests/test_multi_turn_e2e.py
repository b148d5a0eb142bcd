"""Multi-turn training end to end through `megarl train` (the embedded copy task with the
`CopyAgain` environment of tests/envs_for_tests.py): PPO (GAE over sampled tokens only) runs,
logs the trajectory metrics and whole conversations; a run on separate engines
(`rollout.placement.mode: separate`: the environments run on the engine rank), stopped after its
first step and resumed, equals the straight colocated run bit for bit (the environments' seeds
come from the step seed and the sample's place, nothing to save). Those two run with one thread
per process, so that both add in the same order."""

from __future__ import annotations

import json
import os

import pytest

from tests.test_trainer_e2e import _metrics, _same_metrics, _train

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


@pytest.mark.slow
def test_multi_turn_ppo_on_separate_engines_resumes_exactly_and_logs_conversations(tmp_path):
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    ppo, one = "examples/ppo_tiny_cpu.yaml", {"OMP_NUM_THREADS": "1"}
    _train(straight, *ENV, "trainer.steps=2", config=ppo, env=one)
    separate = [*ENV, "rollout.placement.mode=separate", "rollout.placement.ranks=1"]
    _train(halves, *separate, "trainer.steps=1", config=ppo, env=one, nproc=2)
    _train(halves, *separate, "trainer.steps=2", config=ppo, env=one, nproc=2)
    rows = _metrics(straight)
    _same_metrics(rows, _metrics(halves))
    last = rows[-1]
    assert 1 <= last["rollout/turns"] <= 3
    assert last["rollout/env_errors"] == 0 and "rollout/retokenize_diff" in last
    assert "value_loss" in last and last["logprob_mismatch_max"] <= 1e-4
    assert sum(last[f"rollout/finish_{r}"] for r in ("stop", "length", "max_turns")) == 1
    with open(os.path.join(straight, "samples.jsonl")) as f:
        samples = [json.loads(line) for line in f]
    multi = [s for s in samples if s["turns"] > 1]
    assert multi, "no sample went past its first turn"
    roles = [m["role"] for m in multi[0]["conversation"]]
    assert roles[:3] == ["user", "assistant", "user"] and roles[-1] == "assistant"
    assert multi[0]["conversation"][2]["content"].startswith(" copy ")
    assert len(multi[0]["turn_rewards"]) == multi[0]["turns"]


@pytest.mark.slow
def test_an_agent_trains_through_the_endpoint(tmp_path):
    """`env.agent`: an OpenAI client per trajectory drives the policy through megarl's endpoint;
    the run trains on its token-exact trajectories and logs them like an environment's. Here
    the agents and the endpoint run on a separate engine rank that generates a step ahead
    (`rollout.placement.max_staleness=1`) and takes the update between two waves of turns when it
    arrives during one (`rollout.placement.inflight_updates`; whether it does depends on timing)."""
    agent = ["env.agent=tests.envs_for_tests:copy_agent", *ENV[2:],
             "rollout.placement.mode=separate", "rollout.placement.ranks=1",
             "rollout.placement.max_staleness=1",
             "algorithm.off_policy_correction=decoupled", "rollout.placement.inflight_updates=true"]
    _train(tmp_path, *agent, "trainer.steps=2", nproc=2)
    rows = _metrics(tmp_path)
    assert rows[0]["rollout/staleness_max"] == 0 and rows[1]["rollout/staleness_max"] <= 1
    assert rows[1]["rollout/token_staleness_mean"] <= rows[1]["rollout/staleness_mean"]
    last = rows[-1]
    assert 1 <= last["rollout/turns"] <= 3
    # an untrained policy's turns rarely re-tokenize to the sampled ids (truncated turns, odd
    # splits): the metric counts them; training uses the sampled ids
    assert last["rollout/env_errors"] == 0 and 0 <= last["rollout/retokenize_diff"] <= 1
    # step 1 is on-policy: the engine's logprobs are the trainer's
    assert rows[0]["logprob_mismatch_max"] <= 1e-4
    with open(os.path.join(tmp_path, "samples.jsonl")) as f:
        samples = [json.loads(line) for line in f]
    multi = [s for s in samples if s["turns"] > 1]
    assert multi, "no agent asked twice"
    assert [m["role"] for m in multi[0]["conversation"]][:3] == ["user", "assistant", "user"]
