"""The one reader of trainer checkpoints, on a real one: a 1-step PPO run at TP=2 (two ranks,
actor and critic) is read at TP=1 by `megarl convert mcore-to-hf --ckpt RUN` (the newest
checkpoint of the run directory) and the exported HF directory gives transformers exactly
megatron's logits; the critic exports as a sequence-classification model whose per-position
values equal the trainer's; an absent role lists the roles present; and `model.mcore_ckpt: RUN`
starts a new run from the actor's weights (its export is bit-identical to the converter's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from megarl.convert.hf_io import LazyHFTensors
from megarl.distributed.launch import spawn
from tests.test_trainer_e2e import _train

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
SMALL = ["rollout.sampling.n=4", "data.prompts_per_step=8", "algorithm.mini_batches=2"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("reader") / "ppo"
    _train(
        out,
        "trainer.steps=1",
        "parallel.tensor_parallel=2",
        *SMALL,
        nproc=2,
        config="examples/ppo_tiny_cpu.yaml",
    )
    return out


@pytest.fixture(scope="module")
def actor_hf(run):
    out = run.parent / "actor_hf"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "convert.py"), "mcore-to-hf"]
        + ["--ckpt", str(run), "--out", str(out), "--verify", "--tol", "1e-4", "--no-progress"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.splitlines()[0])
    assert summary["role"] == "actor" and "step_000001 (step 1)" in summary["source"]
    assert "verify: max |delta logit|" in proc.stdout and ": OK" in proc.stdout, proc.stdout
    return out


def test_trainer_checkpoint_keeps_the_tokenizer(run):
    step = run / "checkpoints" / "step_000001"
    for name in TOKENIZER:
        assert (step / name).is_file(), name


def test_actor_export_is_complete_and_matches_megatron(actor_hf):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    for name in (*TOKENIZER, "config.json", "generation_config.json", "model.safetensors"):
        assert (actor_hf / name).is_file(), name
    cfg = json.load(open(actor_hf / "config.json"))
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["dtype"] == "float32"
    gen = GenerationConfig.from_pretrained(actor_hf)
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (1, 2, 0)
    tok = AutoTokenizer.from_pretrained(actor_hf)
    assert tok.chat_template is not None and tok.decode(tok("copy 37=")["input_ids"]) == "copy 37="
    _, info = AutoModelForCausalLM.from_pretrained(actor_hf, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def critic_worker(rank, world, run: str, out: str):
    """World 1: the critic of `run` -> HF, values compared; then a role the run does not have."""
    from megarl.checkpoint.files import CheckpointError
    from megarl.checkpoint.reader import open_checkpoint
    from megarl.convert.pipeline import mcore_to_hf
    from megarl.convert.verify import verify

    summary = mcore_to_hf(run, out, role="critic", progress=False)
    res = verify(out, run, role="critic", tol=1e-4)
    try:
        open_checkpoint(run, role="reward")
    except CheckpointError as e:
        absent = str(e)
    return summary, res, absent


def test_critic_export_and_an_absent_role(run):
    from transformers import AutoModelForSequenceClassification

    out = run.parent / "critic_hf"
    summary, res, absent = spawn(critic_worker, 1, str(run), str(out))[0]
    assert summary["role"] == "critic"
    assert res["ok"] and res["max_abs_delta"] <= 1e-4, res
    cfg = json.load(open(out / "config.json"))
    assert cfg["architectures"] == ["LlamaForSequenceClassification"] and cfg["num_labels"] == 1
    model, info = AutoModelForSequenceClassification.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.score.weight.abs().sum() > 0  # the trained value head, not a fresh init
    assert "holds no role 'reward'; roles in this checkpoint: ['actor', 'critic']" in absent


def test_mcore_ckpt_run_directory_starts_a_new_run(run, actor_hf):
    out = run.parent / "from_ckpt"
    # no step: the exported policy is the initial one, i.e. the checkpoint's actor
    _train(
        out,
        "trainer.steps=0",
        "trainer.export_hf=true",
        "model.config=null",
        "model.tokenizer=null",
        f"model.mcore_ckpt={run}",
    )
    log = open(str(out) + ".log").read()
    assert "actor weights of trainer checkpoint" in log and "(step 1)" in log, log[-3000:]
    a, b = LazyHFTensors(actor_hf), LazyHFTensors(out / "hf")
    assert sorted(a.names) == sorted(b.names)
    for name in a.names:
        assert torch.equal(a.get(name), b.get(name)), name
    for name in (*TOKENIZER, "generation_config.json"):  # trainer.export_hf is complete too
        assert (out / "hf" / name).is_file(), name
    import yaml

    assert yaml.safe_load(open(out / "config.yaml"))["model"]["mcore_ckpt"] == str(run)
