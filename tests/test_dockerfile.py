"""The Dockerfile's torch swap, read and run piece by piece (there is no Docker engine here):

- NGC images (25.03 on) pin their own torch in /etc/pip/constraint.txt, which pip reads through
  `PIP_CONSTRAINT`; the pin outlives `pip uninstall torch`, and `pip install vllm` then cannot
  resolve vLLM's `torch==2.13.0`. The constraint files must be emptied before vLLM's install
  (the Dockerfile's own command runs here on scratch copies of them);
- Transformer-Engine is compiled with the image's nvcc against vLLM's torch: the CUDA majors
  must agree, checked before TE's build (the check runs here against a stand-in `nvcc`).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NGC_PINS = "torch==2.9.0a0+50eac811a6.nv25.10\ntransformer_engine==2.8.0+40c69e75\n"


def _instructions() -> list[tuple[str, str]]:
    """(keyword, arguments) of each Dockerfile instruction, continuation lines joined as Docker
    joins them (comment lines dropped)."""
    lines = [
        ln
        for ln in open(os.path.join(ROOT, "Dockerfile")).read().splitlines()
        if not ln.lstrip().startswith("#")
    ]
    text = re.sub(r"\\\n", "", "\n".join(lines))
    out = []
    for ln in text.splitlines():
        if ln.strip():
            keyword, _, args = ln.strip().partition(" ")
            out.append((keyword.upper(), args.strip()))
    return out


def _index(pred) -> int:
    return next(i for i, (k, a) in enumerate(_instructions()) if k == "RUN" and pred(a))


def _vllm_install() -> int:
    return _index(lambda a: re.search(r"pip install .*vllm==", a) is not None)


def test_the_ngc_constraint_is_lifted_before_vllm_is_installed(tmp_path):
    steps = _instructions()[: _vllm_install()]
    assert not [a for k, a in steps if k == "ENV" and "PIP_CONSTRAINT" in a]
    system = tmp_path / "etc_pip_constraint.txt"  # stands in for /etc/pip/constraint.txt
    other = tmp_path / "constraints.txt"  # a file PIP_CONSTRAINT names instead
    for constraints in (system, other):
        constraints.write_text(NGC_PINS)
    env = {**os.environ, "PIP_CONSTRAINT": str(other)}
    for _, run in [(k, a) for k, a in steps if k == "RUN" and "constraint" in a]:
        cmd = run.replace("/etc/pip/constraint.txt", str(system))
        subprocess.run(["sh", "-c", cmd], env=env, check=True, capture_output=True)
    for constraints in (system, other):
        assert "torch==" not in constraints.read_text(), f"{constraints.name} still pins torch"


def _cuda_check(tmp_path, nvcc_major: str, torch_cuda: str):
    """The Dockerfile's CUDA-major check with `nvcc` and `torch` answering as an image would."""
    i = _index(lambda a: "torch.version.cuda" in a and "nvcc" in a)
    run = _instructions()[i][1]
    assert _vllm_install() < i < _index(lambda a: "transformer_engine" in a and "pip install" in a)
    code = re.fullmatch(r'python -c "(.*)"', run, re.S).group(1)
    compile(code, "Dockerfile", "exec")
    (tmp_path / "nvcc").write_text(
        f"#!/bin/sh\necho 'Cuda compilation tools, release {nvcc_major}.2, V{nvcc_major}.2.1'\n"
    )
    (tmp_path / "nvcc").chmod(0o755)
    (tmp_path / "torch.py").write_text(
        f"__version__ = '2.13.0'\nclass version:\n    cuda = '{torch_cuda}'\n"
    )
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "PYTHONPATH": str(tmp_path)}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)


def test_the_cuda_majors_of_nvcc_and_vllms_torch_are_checked_before_te_builds(tmp_path):
    ok = _cuda_check(tmp_path, "13", "13.0")
    assert ok.returncode == 0 and "= nvcc major 13" in ok.stdout, ok.stderr
    bad = _cuda_check(tmp_path, "12", "13.0")
    assert bad.returncode != 0
    assert "nvcc is CUDA 12, vLLM torch is CUDA 13: use a BASE_IMAGE with CUDA 13" in bad.stderr
