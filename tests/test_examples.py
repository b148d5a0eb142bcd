"""Every example config resolves and lays out at the world size it is written for: a dry run
(meta device, no GPU, weights or data) through `megarl train --dry-run`, with the GPU examples'
models given by the shapes shipped in examples/models/. A new example must be added here."""

import json
from pathlib import Path

import pytest

from tests.docs_worker import in_one_process

ROOT = Path(__file__).resolve().parents[1]

# example -> (ranks of the run it is written for, shipped model shape, None for its own model, or
# DEFAULT for a stage that starts from an earlier stage's run: the embedded default's model)
DEFAULT = "the embedded default's model"
EXAMPLES = {
    "grpo_tiny_cpu.yaml": (1, None),
    "sft_copy_cpu.yaml": (1, None),
    "dpo_copy_cpu.yaml": (1, DEFAULT),
    "grpo_copy_from_dpo_cpu.yaml": (1, DEFAULT),
    "rm_copy_cpu.yaml": (1, DEFAULT),
    "ppo_rm_copy_cpu.yaml": (1, DEFAULT),
    "ppo_tiny_cpu.yaml": (1, None),
    "grpo_moe_tiny_cpu.yaml": (2, None),
    "grpo_smollm2_arith_cpu.yaml": (1, "smollm2-135m-instruct"),
    "grpo_smollm2_retry_cpu.yaml": (1, "smollm2-135m-instruct"),
    "grpo_smollm2_judge_cpu.yaml": (1, "smollm2-135m-instruct"),
    "sft_smollm2_tools_cpu.yaml": (1, "smollm2-135m-instruct"),
    "grpo_smollm2_tools_cpu.yaml": (1, "smollm2-135m-instruct"),
    "distill_smollm2_arith_cpu.yaml": (1, "smollm2-135m-instruct"),
    "grpo_qwen2.5_7b_gsm8k.yaml": (8, "qwen2.5-7b-instruct"),
    "grpo_qwen3_30b_a3b_ep8.yaml": (8, "qwen3-30b-a3b"),
    "grpo_moonlight_16b_a3b_h100.yaml": (8, "moonlight-16b-a3b-instruct"),
    "grpo_glm4.5_air_h100.yaml": (64, "glm-4.5-air"),
    "grpo_gpt_oss_20b_h100.yaml": (8, "gpt-oss-20b"),
    "grpo_llama3_70b_fp8.yaml": (32, "llama3-70b-instruct"),
    "grpo_llama3_70b_lora.yaml": (8, "llama3-70b-instruct"),
}

# a stage scored by an earlier stage's reward model: the dry run has no such run to read, so it
# lays the example out without it (the reward model's layout is the actor's: same shape here)
WITHOUT_EARLIER_RUNS = {
    "ppo_rm_copy_cpu.yaml": ["reward.model=null", "model.critic_init=actor"],
}
# a teacher from an earlier stage's run: the dry run reads the shipped shape of that model
TEACHERS = {"distill_smollm2_arith_cpu.yaml": "examples/models/smollm2-135m-instruct"}


def test_every_example_is_covered():
    shipped = sorted(p.name for p in (ROOT / "examples").glob("*.yaml"))
    assert shipped == sorted(EXAMPLES), "add the new example to EXAMPLES with its world size"
    for _, model in EXAMPLES.values():
        shipped_shape = ROOT / "examples" / "models" / str(model) / "config.json"
        assert model in (None, DEFAULT) or shipped_shape.is_file()


def _args(name: str) -> list[str]:
    world, model = EXAMPLES[name]
    args = [f"examples/{name}", "--dry-run", f"--world-size={world}", f"--rank={world - 1}"]
    if model == DEFAULT:
        from megarl.config import load_config, to_dict

        shape = json.dumps(to_dict(load_config(None).model)["config"])
        args += ["--set", "model.mcore_ckpt=null", "--set", "model.hf=null"]
        args += ["--set", f"model.config={shape}"]
        args += [a for kv in WITHOUT_EARLIER_RUNS.get(name, []) for a in ("--set", kv)]
    elif model is not None:
        args += ["--set", "model.mcore_ckpt=null", "--set", f"model.hf=examples/models/{model}"]
    if name in TEACHERS:
        args += ["--set", f"teacher.model={TEACHERS[name]}"]
    return ["train", *args]


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory) -> dict:
    """{example: [ok, output, seconds]}: every example's `megarl train ... --dry-run`, one after
    the other in one child interpreter (the imports paid once)."""
    jobs = [{"id": name, "kind": "cli", "argv": _args(name)} for name in EXAMPLES]
    return in_one_process(jobs, tmp_path_factory.mktemp("examples"))


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_dry_run_at_its_world_size(name, dry_runs):
    world = EXAMPLES[name][0]
    ok, text, _ = dry_runs[name]
    assert ok, text[-3000:]
    assert f"= {world} rank{'s' if world > 1 else ''}" in text, text
    assert "Traceback" not in text


def test_the_judge_example_names_its_judge_engine(dry_runs):
    ok, text, _ = dry_runs["grpo_smollm2_judge_cpu.yaml"]
    assert ok and "judge on a vLLM engine of its own (reward.judge.model=models/smollm2)" in text
