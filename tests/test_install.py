"""`make install` gets the CPU build of torch from any index: PyTorch's CPU index is an extra index
of every torch install in the Makefile, and `tools/check_cpu_torch.py` refuses a CUDA build with
the fix in its message. Nothing is installed here."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _check_module():
    path = os.path.join(ROOT, "tools", "check_cpu_torch.py")
    spec = importlib.util.spec_from_file_location("check_cpu_torch", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_cuda_build_is_refused_with_the_fix():
    check = _check_module()
    assert check.problem("2.13.0+cpu", ["filelock", "sympy>=1.13"]) is None
    cuda = check.problem("2.13.0", ["nvidia-cublas-cu12==12.8.4.1; platform_system == 'Linux'"])
    assert "torch 2.13.0, a CUDA build" in cuda
    assert "rm -rf .venv && make install TORCH_INDEX=URL" in cuda
    assert check.CPU_INDEX in cuda
    assert "a CUDA build" in check.problem("2.13.0+cu128", [])
    assert "not the CPU build" in check.problem("2.13.0", [])


def test_the_installed_torch_passes_the_check():
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "check_cpu_torch.py")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "the CPU build" in proc.stdout


def test_every_torch_install_in_the_makefile_has_the_cpu_index_and_the_check():
    with open(os.path.join(ROOT, "Makefile")) as f:
        text = f.read()
    assert re.search(r"^TORCH_INDEX \?= https://download\.pytorch\.org/whl/cpu$", text, re.M)
    lines = text.splitlines()
    installs = [i for i, line in enumerate(lines) if re.search(r"pip install .*torch==", line)]
    assert len(installs) == 2  # make install and make wheel-check
    for i in installs:
        assert "$(TORCH_EXTRA)" in lines[i], lines[i]
        assert "tools/check_cpu_torch.py" in lines[i + 1], lines[i + 1]
    # `make train` names its run directory, so running it again resumes an interrupted run
    train = text.split("\ntrain:", 1)[1].split("\n\n", 1)[0]
    assert "megarl train --out runs/default" in train
