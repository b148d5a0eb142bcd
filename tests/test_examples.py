"""Every example config resolves and lays out at the world size it is written for: a dry run
(meta device, no GPU, weights or data) through `megarl train --dry-run`, with the GPU examples'
models given by the shapes shipped in examples/models/. A new example must be added here."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

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
    "grpo_qwen2.5_7b_gsm8k.yaml": (8, "qwen2.5-7b-instruct"),
    "grpo_qwen3_30b_a3b_ep8.yaml": (8, "qwen3-30b-a3b"),
    "grpo_llama3_70b_fp8.yaml": (32, "llama3-70b-instruct"),
}

# a stage scored by an earlier stage's reward model: the dry run has no such run to read, so it
# lays the example out without it (the reward model's layout is the actor's: same shape here)
WITHOUT_EARLIER_RUNS = {
    "ppo_rm_copy_cpu.yaml": ["reward.model=null", "model.critic_init=actor"],
}


def test_every_example_is_covered():
    shipped = sorted(p.name for p in (ROOT / "examples").glob("*.yaml"))
    assert shipped == sorted(EXAMPLES), "add the new example to EXAMPLES with its world size"
    for _, model in EXAMPLES.values():
        shipped_shape = ROOT / "examples" / "models" / str(model) / "config.json"
        assert model in (None, DEFAULT) or shipped_shape.is_file()


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_dry_run_at_its_world_size(name):
    world, model = EXAMPLES[name]
    args = [f"examples/{name}", "--dry-run", f"--world-size={world}", f"--rank={world - 1}"]
    if model == DEFAULT:
        import json

        from megarl.config import load_config, to_dict

        shape = json.dumps(to_dict(load_config(None).model)["config"])
        args += ["--set", "model.mcore_ckpt=null", "--set", "model.hf=null"]
        args += ["--set", f"model.config={shape}"]
        args += [a for kv in WITHOUT_EARLIER_RUNS.get(name, []) for a in ("--set", kv)]
    elif model is not None:
        args += ["--set", "model.mcore_ckpt=null", "--set", f"model.hf=examples/models/{model}"]
    proc = subprocess.run(
        [sys.executable, "-m", "megarl", "train", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert f"= {world} rank{'s' if world > 1 else ''}" in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stderr
