"""Input errors, tried as a new user would, through the command lines.

Each must end with exit status 2 and exactly one `megarl: error:` line naming the file / key /
value, with no traceback, before any model or engine is built (no `config.yaml` in the run
directory: `build_run` writes it just before it builds the models; no `rollout_model/`, no
"vLLM engine up"), and the converter must leave no output directory (nor its
hidden temporary sibling). `--debug` brings the traceback back.

A few run as a user's process (`python -m megarl`, `tools/convert.py`, torchrun): what the
interpreter prints at exit and the exit status it returns. The rest are the same command lines
run one after the other in one child interpreter (`tests.docs_worker`, `megarl.cli.run_command`
as the console script calls it, logging captured per command), so the imports are paid once.
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys

import pytest

from tests.docs_worker import in_one_process
from tests.tiny import TINY_LLAMA

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUIET = ["--set", "logging.wandb=false", "--set", "logging.progress=false"]


def _run(args: list[str], *, cwd: str = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def _train(tmp_path, *args: str) -> subprocess.CompletedProcess:
    out = tmp_path / "run"
    return _run(["-m", "megarl", "train", *args, *QUIET, "--out", str(out)])


def _assert_user_error(proc, *needles: str, out_dir=None) -> str:
    text = proc.stdout + proc.stderr
    return _assert_error_text(proc.returncode, text, *needles, out_dir=out_dir)


def _assert_error_text(code: int, text: str, *needles: str, out_dir=None) -> str:
    lines = [ln for ln in text.splitlines() if ln.startswith("megarl: error:")]
    assert code == 2, text[-3000:]
    assert len(lines) == 1, text[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert "Traceback" not in text, text[-3000:]
    assert "vLLM engine up" not in text and "nanobind" not in text, text[-3000:]
    if out_dir is not None:
        assert not os.path.exists(os.path.join(out_dir, "rollout_model")), "the engine started"
        # build_run writes config.yaml just before it builds the models
        assert not os.path.exists(os.path.join(out_dir, "config.yaml")), "models were built"
    return lines[0]


# ---------------------------------------------------------------- the common mistakes
def test_missing_data_file(tmp_path):
    proc = _train(tmp_path, "--set", f"data.path={tmp_path}/nope.jsonl")
    run = tmp_path / "run"
    _assert_user_error(proc, "data.path=", "nope.jsonl", "does not exist", out_dir=run)


def _corrupt_json(d) -> list[str]:
    (d / "prompts.jsonl").write_text('{"prompt": "1+2="}\n{"prompt": "2+2=", oops}\n')
    return ["--set", f"data.path={d / 'prompts.jsonl'}"]


def _binary_data(d) -> list[str]:
    (d / "binary.jsonl").write_bytes(b"\x00\xff\xfe garbage \x80\x81")
    return ["--set", f"data.path={d / 'binary.jsonl'}"]


def _garbage_weights(d) -> list[str]:
    hf = _hf_dir(d / "hf", safetensors=GARBAGE)
    return ["--set", "model.config=null", "--set", f"model.hf={hf}", "--set", "model.tokenizer=toy"]


def _tampered_checkpoint(d) -> list[str]:
    from tests.test_checkpoint_safety import write_payload_pickle

    step = d / "run" / "checkpoints" / "step_000001"
    step.mkdir(parents=True)
    write_payload_pickle(step / "trainer_state.pt", d / "pwned")
    return []


def _bad_yaml(d) -> list[str]:
    (d / "run.yaml").write_text("trainer:\n  steps: 3\n   seed: 1\n")
    return [str(d / "run.yaml")]


def _args(*args: str):
    return lambda d: list(args)


# case -> (what it writes into its directory, returning the train arguments; what the one
# error line must name)
BATCH = {
    "corrupt-json": (_corrupt_json, ["prompts.jsonl:2: invalid JSON"]),
    "binary-data": (_binary_data, ["binary.jsonl", "not UTF-8"]),
    "misspelt-reward": (_args("--set", "reward.functions=[toy, mathverify]"),
                        ["reward.functions[1]", "'mathverify'", "'math_verify'", "'toy'"]),
    "unimportable-reward": (_args("--set", "reward.functions=[no_such_pkg.rewards:fn]", "--set",
                                  "reward.weights=null"), ["cannot import 'no_such_pkg.rewards'"]),
    "missing-hf": (lambda d: ["--set", "model.config=null", "--set", f"model.hf={d}/Llama-3-8B"],
                   ["model.hf=", "Llama-3-8B", "does not exist", "config.json"]),
    "tp-over-world": (_args("--set", "parallel.tensor_parallel=4"),
                      ["parallel", "world size 1", "TP x PP x CP = 4 x 1 x 1"]),
    "unknown-key": (_args("--set", "trainer.stepz=3"),
                    ["--set trainer.stepz=3", "unknown config key", "steps"]),
    "override-syntax": (_args("--set", "trainer.steps"), ["'trainer.steps'", "expected key=value"]),
    "override-yaml": (_args("--set", "reward.functions=[toy"),
                      ["not valid YAML", "line 1, column 5"]),
    "wrong-type": (_args("--set", "rollout.sampling.temperature=hot"),
                   ["rollout.sampling.temperature='hot'", "a number"]),
    "bad-value": (_args("--set", "algorithm.name=kto"),
                  ["algorithm.name='kto'", "'grpo', 'ppo', 'distill', 'sft'"]),
    "missing-config": (_args("/no/such/config.yaml"), ["/no/such/config.yaml does not exist"]),
    "missing-tokenizer": (_args("--set", "model.tokenizer=/no/tok"),
                          ["model.tokenizer='/no/tok' does not exist"]),
    "too-few-prompts": (_args("--set", "data.prompts_per_step=2000"),
                        ["data.prompts_per_step=2000 > 1080 prompts"]),
    "too-long": (_args("--set", "rollout.sampling.max_tokens=60"),
                 ["rollout.sampling.max_tokens (60)", "max_position_embed"]),
    "bad-yaml-file": (_bad_yaml, ["run.yaml: invalid YAML", "line 3"]),
    "garbage-weights": (_garbage_weights, ["model.safetensors", "not a safetensors file"]),
    "tampered-checkpoint": (_tampered_checkpoint,
                            ["trainer_state.pt", "refusing to load", "trainer.resume=false"]),
}


@pytest.fixture(scope="module")
def batch(tmp_path_factory) -> dict:
    """case -> (exit status, everything it printed, its run directory)."""
    root = tmp_path_factory.mktemp("user_errors")
    jobs = []
    for name, (prepare, _) in BATCH.items():
        d = root / name
        d.mkdir()
        argv = ["train", *prepare(d), *QUIET, "--out", str(d / "run")]
        jobs.append({"id": name, "kind": "cli", "status": 2, "argv": argv})
    results = in_one_process(jobs, root)
    out = {}
    for name in BATCH:
        _, text, _ = results[name]
        code = int(re.search(r"\[exit status (-?\d+)\]$", text).group(1))
        out[name] = (code, text, root / name / "run")
    return out


def _check(batch, name: str) -> None:
    code, text, run = batch[name]
    _assert_error_text(code, text, *BATCH[name][1], out_dir=run)


def test_corrupt_data_file(batch):
    _check(batch, "corrupt-json")
    _check(batch, "binary-data")


def test_unknown_reward_function(batch):
    _check(batch, "misspelt-reward")
    _check(batch, "unimportable-reward")


def test_missing_hf_dir(batch):
    _check(batch, "missing-hf")


def test_tp_larger_than_world_size(batch):
    _check(batch, "tp-over-world")


def _hf_dir(path, *, safetensors: bytes | None) -> str:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    if safetensors is not None:
        (path / "model.safetensors").write_bytes(safetensors)
    return str(path)


GARBAGE = struct.pack("<Q", 24) + b"this is not json at all!" + b"\0" * 64


def _assert_no_output(out) -> None:
    parent, base = os.path.split(str(out))
    assert not os.path.exists(out)
    assert [n for n in os.listdir(parent) if n.startswith(f".{base}")] == []


def test_convert_garbage_safetensors_header(tmp_path):
    hf = _hf_dir(tmp_path / "hf", safetensors=GARBAGE)
    out = tmp_path / "ckpt"
    proc = _run([os.path.join("tools", "convert.py"), "hf-to-mcore", "--hf", hf, "--out",
                 str(out), "--no-progress"])
    _assert_user_error(proc, "model.safetensors", "not a safetensors file", "not JSON")
    _assert_no_output(out)


def test_convert_tp3(tmp_path):
    hf = _hf_dir(tmp_path / "hf", safetensors=None)
    out = tmp_path / "ckpt"
    proc = _run([os.path.join("tools", "convert.py"), "hf-to-mcore", "--hf", hf, "--out",
                 str(out), "--tp", "3", "--no-progress"])
    _assert_user_error(proc, "tp=3 pp=1", "num_attention_heads=4 is not divisible by TP=3")
    _assert_no_output(out)


# ---------------------------------------------------------------- more ways to go wrong
CONFIG_MISTAKES = ["unknown-key", "override-syntax", "override-yaml", "wrong-type", "bad-value",
                   "missing-config", "missing-tokenizer", "too-few-prompts", "too-long"]


@pytest.mark.parametrize("name", CONFIG_MISTAKES)
def test_config_mistakes(batch, name):
    _check(batch, name)


def test_bad_yaml_file(batch):
    _check(batch, "bad-yaml-file")


def test_hf_dir_with_garbage_weights_fails_before_the_model_is_built(batch):
    _check(batch, "garbage-weights")


def test_tampered_checkpoint_is_refused_before_anything_runs(batch):
    _check(batch, "tampered-checkpoint")
    _, _, run = batch["tampered-checkpoint"]
    assert not (run.parent / "pwned").exists()


def test_debug_shows_the_traceback(tmp_path):
    proc = _train(tmp_path, "--set", "reward.functions=[nosuch]", "--set", "reward.weights=null",
                     "--debug")
    assert proc.returncode == 2
    assert "Traceback" in proc.stderr and "RewardFunctionError" in proc.stderr
    assert proc.stderr.rstrip().splitlines()[-1].startswith("megarl: error: reward.functions[0]")


@pytest.mark.slow
def test_torchrun_prints_the_error_once_and_last(tmp_path):
    from megarl.distributed.launch import free_port

    proc = _run(["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                 str(free_port()), "-m", "megarl", "train", "--set",
                 "parallel.tensor_parallel=3", *QUIET, "--out", str(tmp_path / "run")])
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text[-3000:]  # torchrun: a child failed (each exits with 2)
    assert "exitcode  : 2" in text
    message = "megarl: error: parallel: world size 2 is not divisible by TP x PP x CP = 3"
    assert sum(ln.startswith(message) for ln in text.splitlines()) <= 1  # rank 0 only
    # torchrun's closing report ends with the message (from the ranks' error files)
    tail = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("=")][-1]
    assert tail.strip().startswith(f"traceback : {message}"), text[-3000:]
