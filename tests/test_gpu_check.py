"""tools/gpu_check.sh without a GPU: it runs to its end, every GPU check is a SKIP with its reason,
exit 0, JSON lines written; and with --cpu, the logic of steps 2 (trainer path, parity) and 3
(weight-sync writer, bitwise) runs on CPU in fp32 with tiny shapes, importing nothing the GPU
machine lacks (the packages it does not have are blocked in these runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# on a GPU machine without network: no vLLM, TE, apex, wandb, math-verify (nor what only they
# pull in)
ABSENT_THERE = ("vllm", "transformer_engine", "apex", "flash_attn", "wandb", "math_verify",
                "pydantic", "opentelemetry", "platformdirs", "dill")  # fmt: skip

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the machine-without-GPU path"
)


def _run(tmp_path, *args, **env) -> tuple[int, list[dict], str]:
    block = tmp_path / "block"
    block.mkdir()
    (block / "sitecustomize.py").write_text(
        "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in ABSENT_THERE)
    )
    out = tmp_path / "out"
    full_env = {
        **os.environ,
        "OUT": str(out),
        "PYTHONPATH": str(block),
        "TMPDIR": str(tmp_path),
        **env,
    }
    log = tmp_path / "console.txt"
    with open(log, "w") as f:  # a file, not a pipe: no orphan can hold it open
        proc = subprocess.run(["bash", "tools/gpu_check.sh", *args], cwd=ROOT, env=full_env,
                              stdout=f, stderr=subprocess.STDOUT, timeout=600)  # fmt: skip
    console = log.read_text()
    with open(out / "gpu_check.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert (out / "gpu_check.log").exists() and (out / "gpu_check_table.txt").exists(), console
    return proc.returncode, records, console


def _by_check(records) -> dict:
    return {(r["step"], r["check"]): r for r in records}


def test_without_gpu_every_gpu_check_skips(tmp_path):
    # the venv path of a GPU image: a venv made from another venv's Python (as from
    # /opt/torch/.venv) must still see that venv's torch; no wheels needed here
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    venv = str(tmp_path / "venv")
    rc, records, console = _run(tmp_path, GPU_CHECK_BASE_PYTHON=sys.executable,
                                GPU_CHECK_WHEELS=str(wheels), GPU_CHECK_VENV=venv)  # fmt: skip
    assert rc == 0, console
    by = _by_check(records)
    assert by[("setup", "python")]["status"] == "PASS", console
    assert venv in by[("setup", "python")]["figures"]["python"]
    versions = by[("env", "versions")]
    assert versions["status"] == "PASS" and versions["figures"]["megatron_core"], console
    gpu_checks = [
        ("env", "collectives"), ("env", "matmul"), ("env", "d2d_copy"),
        ("train", "build"), ("train", "forward"), ("train", "grpo_update"),
        ("train", "ppo_update"), ("train", "cpu_parity"), ("sync", "plan"), ("sync", "writer"),
        ("throughput", "llama_1b"), ("throughput", "llama_7b"),
        ("train", "optimizer_state"), ("optional", "transformer_engine"), ("optional", "fp8"),
        ("optional", "fp8_param_masters"), ("optional", "vllm_engine"),
    ]  # fmt: skip
    for key in gpu_checks:
        assert by[key]["status"] == "SKIP", (key, by[key])
        assert "CUDA" in by[key]["reason"], by[key]
    assert not [r for r in records if r["status"] == "FAIL"], console
    assert "megarl GPU check:" in console and "0 FAIL" in console


@pytest.mark.slow
def test_cpu_mode_runs_trainer_and_sync_steps(tmp_path):
    rc, records, console = _run(tmp_path, "--cpu", "--only", "train,sync",
                                GPU_CHECK_PYTHON=sys.executable)  # fmt: skip
    assert rc == 0, console
    by = _by_check(records)
    for check in ("build", "forward", "grpo_update", "ppo_update", "optimizer_state", "cpu_parity"):
        assert by[("train", check)]["status"] == "PASS", (check, by[("train", check)], console)
    state = by[("train", "optimizer_state")]["figures"]  # Adam's moments before any step
    assert state["with_state"] == state["optimizer_params"] > 0 and state["steps"] == [0.0]
    assert state["moment_bytes"] == 2 * 4 * state["params"]  # fp32: the masters are views
    parity = by[("train", "cpu_parity")]["figures"]
    assert parity["logprob_abs_diff_mean"] <= 1e-4 and parity["loss_abs_diff"] <= parity["loss_tol"]
    for check in ("plan", "writer"):
        assert by[("sync", check)]["status"] == "PASS", (check, by[("sync", check)], console)
    writer = by[("sync", "writer")]["figures"]
    assert writer["bitwise_equal"] == writer["tensors"] > 0
    # every element written, bitwise as the reference, whose vocab 250 -> 256 padding is zeros
    assert writer["nan_left"] == 0 and writer["padding_elements"] > 0
    assert {r["step"] for r in records} == {"setup", "train", "sync"}
