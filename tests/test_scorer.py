"""`megarl.rewards.scorer.Scorer` composes a multi-turn trajectory's reward as docs/multi-turn.md
says: the weighted reward functions score the last assistant turn (`completions`) and receive
the whole conversation (`conversation`); `reward.model_weight` times the reward model's score of
the whole trajectory's tokens (a real megatron reward model, checked against transformers); and
`reward.env_weight` times the environment's reward, not applicable when the environment gave
none (no term, no share of `reward/env`); a trajectory whose environment failed scores 0.

The trajectories are built by hand (`_trajectories`, the one place that knows the rollout's
records); the scorer and the reward model are the run's own, in one gloo process.
"""

from __future__ import annotations

import math

import pytest
import torch

from megarl.distributed.launch import spawn
from tests import rm_worker as rw

PROMPT = [5, 6, 7]
WEIGHTS = (0.5, 2.0)  # last_turn_length, assistant_turns
MODEL_WEIGHT, ENV_WEIGHT = 3.0, 0.25


def _conversation(*turns: str) -> list[dict]:
    messages = [{"role": "user", "content": "copy 12"}]
    for i, t in enumerate(turns):
        if i:
            messages.append({"role": "user", "content": " copy 12="})
        messages.append({"role": "assistant", "content": t})
    return messages


# (turns' texts, response ids: sampled + environment + sampled ..., finish reason, env reward)
TRAJECTORIES = [
    (["1", "12"], [8, 2, 20, 21, 22, 8, 9, 2], "stop", 1.0),
    (["7"], [11, 2], "max_turns", None),  # the environment gave no reward
    (["3", "123"], [10, 2, 20, 21, 22, 8, 9, 10, 2], "env_error", 0.0),  # its step raised
    (["4", "5", "612"], [12, 2, 20, 21, 13, 2, 20, 21, 22, 14, 8, 9], "length", 0.5),
]


def _trajectories():
    """The rollout of one prompt's four trajectories, as the multi-turn rollout returns it."""
    from megarl.data.dataset import PromptBatch
    from megarl.rollout import Samples, Turns
    from megarl.rollout.multi_turn.trajectory import TrajectoryRecord

    records = [
        TrajectoryRecord(
            messages=_conversation(*turns),
            completion=turns[-1],
            turns=len(turns),
            finish_reason=finish,
            env_reward=env,
        )
        for turns, _, finish, env in TRAJECTORIES
    ]
    n = len(TRAJECTORIES)
    rollout = Samples(
        prompt_index=[0] * n,
        prompt_ids=[list(PROMPT)] * n,
        response_ids=[list(ids) for _, ids, _, _ in TRAJECTORIES],
        response_logprobs=[[0.0] * len(ids) for _, ids, _, _ in TRAJECTORIES],
        finish_reason=[finish for _, _, finish, _ in TRAJECTORIES],
        turns=Turns([[1] * len(ids) for _, ids, _, _ in TRAJECTORIES], records),
    )
    prompts = PromptBatch(indices=[0], prompt_ids=[PROMPT], prompts=["copy 12"], columns={})
    return prompts, rollout


def last_turn_length(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


def assistant_turns(prompts, completions, conversation, **kwargs):
    return [float(sum(m["role"] == "assistant" for m in c)) for c in conversation]


def score_with_a_reward_model(rank, world, rm_dir: str) -> dict:
    """The run's scorer (the two functions above, the reward model of `rm_dir` built frozen at
    one rank) on `_trajectories()`, with the completions the training loop passes."""
    from megarl.config import load_config
    from megarl.convert.sharded import load_hf_sharded
    from megarl.distributed import Topology
    from megarl.models import forward
    from megarl.models.builder import build_model
    from megarl.models.hf_config import arch_from_hf
    from megarl.rewards.config import RewardConfig
    from megarl.rewards.model import RewardModel
    from megarl.rewards.scorer import Scorer

    arch = arch_from_hf(rm_dir)
    base = load_config(None, ["algorithm.micro_batch_size=3"])
    groups = Topology.for_model(base.parallel, world, arch).initialize(seed=0)
    chunks = build_model(arch, base.parallel, base.precision, role="reward", frozen=True)
    load_hf_sharded(chunks, arch, rm_dir)
    pad_to = forward.sequence_multiple(groups.tp_size, False, None)
    rm = RewardModel(chunks, arch, None, reuse_ids=True, cfg=base, groups=groups, pad_to=pad_to)
    cfg = RewardConfig(
        functions=("last_turn_length", "assistant_turns"),
        weights=WEIGHTS,
        model=rm_dir,
        model_weight=MODEL_WEIGHT,
        env_weight=ENV_WEIGHT,
    )
    scorer = Scorer([last_turn_length, assistant_turns], cfg, reward_model=rm)
    prompts, rollout = _trajectories()
    scores = scorer.score(prompts, rollout, rollout.completions(None))
    return {
        "total": scores.total,
        "per_function": scores.per_function,
        "metrics": scores.metrics.reduce(),
        "read": rm.sequences(prompts, rollout, None),
    }


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    rm_dir = rw.write_models(str(tmp_path_factory.mktemp("scorer_rm")))["own_pad"]
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32)
    whole = [PROMPT + ids for _, ids, _, _ in TRAJECTORIES]
    with torch.no_grad():  # one sequence at a time: no padding, the score at its last token
        ref = torch.stack([model(input_ids=torch.tensor([s])).logits[0, 0] for s in whole])
    return spawn(score_with_a_reward_model, 1, rm_dir)[0], whole, ref


def test_the_reward_model_scores_the_whole_trajectory(scored):
    got, whole, ref = scored
    assert got["read"] == whole  # the prompt, every turn and every environment token
    assert (got["per_function"]["rm"] - ref).abs().max() <= 1e-4
    assert ref.std() > 1e-3  # the four trajectories score differently


def test_functions_score_the_last_turn_and_read_the_conversation(scored):
    got, _, _ = scored
    last = [float(len(turns[-1])) for turns, *_ in TRAJECTORIES]
    assert got["per_function"]["last_turn_length"].tolist() == last
    assert got["per_function"]["assistant_turns"].tolist() == [2.0, 1.0, 2.0, 3.0]


def test_the_total_composes_functions_model_and_environment(scored):
    """sum_f w_f r_f + model_weight x rm + env_weight x env; no env term where the environment
    gave none; 0 where it failed."""
    got, _, ref = scored
    want = []
    for i, (turns, _, finish, env) in enumerate(TRAJECTORIES):
        fns = WEIGHTS[0] * len(turns[-1]) + WEIGHTS[1] * len(turns)
        total = fns + MODEL_WEIGHT * float(ref[i]) + ENV_WEIGHT * (0.0 if env is None else env)
        want.append(0.0 if finish == "env_error" else total)
    assert got["total"].tolist() == pytest.approx(want, abs=1e-4)
    assert got["total"][2] == 0.0  # env_error, whatever the functions and the model said
    env = got["per_function"]["env"]
    assert math.isnan(env[1]) and env[[0, 2, 3]].tolist() == [1.0, 0.0, 0.5]
    # reward/env: the mean over the trajectories whose environment gave a reward
    assert got["metrics"]["reward/env"] == pytest.approx((1.0 + 0.0 + 0.5) / 3)
    assert got["metrics"]["reward/rm"] == pytest.approx(float(ref.mean()), abs=1e-4)
