# GPU image: megarl with vLLM, megatron-core and Transformer-Engine built against ONE torch.
#   docker build -t megarl .
#   then prepare the data, convert and train with the model, data and runs on mounted volumes
#   (docs/install.md, "Docker", shows the three `docker run` lines)
#
# Why the order below: vLLM pins an exact PyPI torch. NGC's torch is a different build, so
# installing vLLM on top of it replaces torch and leaves the image's Transformer-Engine (and
# apex) compiled against a torch that is gone ("undefined symbol" at `import
# transformer_engine`). So the NGC torch stack is removed first, vLLM brings its torch, and TE is
# then compiled against that torch (the NGC image supplies CUDA, cuDNN and the compilers).
# NGC images from 25.03 on also pin every package of their own build in
# /etc/pip/constraint.txt (PIP_CONSTRAINT points pip at it); uninstalling torch leaves its pin
# there, so `pip install vllm` cannot resolve vLLM's `torch==2.13.0`. Those pins describe the
# stack removed here, so the constraint files are emptied before vLLM is installed.
# vLLM 0.32.0's wheel pins torch==2.13.0, whose Linux wheel is built with CUDA 13.0
# (cuda-toolkit 13.0.3); TE's torch extension is compiled with this image's nvcc against it, and
# torch's extension builder refuses a different CUDA major, so the build checks that the two
# majors agree before compiling TE, and names the CUDA a BASE_IMAGE needs when they do not.
# Status: NOT built by megarl's CI (no Docker engine on its machines); the pins are the versions
# megarl's code targets (vLLM 0.32's reload_weights / processed logprobs, megatron-core's public
# API), and the last RUN line fails the build if any of the four does not import.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.10-py3
FROM ${BASE_IMAGE}
ARG VLLM_VERSION=0.32.0
ARG TE_VERSION=2.9
ARG MCORE_VERSION=0.16.1
WORKDIR /opt/megarl

RUN pip uninstall -y torch torchvision torchaudio pytorch-triton transformer_engine \
        transformer-engine transformer-engine-cu12 apex flash_attn megatron-core || true
RUN for f in ${PIP_CONSTRAINT:-} /etc/pip/constraint.txt; do \
        if [ -f "$f" ]; then : > "$f"; echo "emptied pip constraints $f"; fi; \
    done
RUN pip install --no-cache-dir "vllm==${VLLM_VERSION}"
RUN python -c "import re, subprocess, torch; \
out = subprocess.run(['nvcc', '--version'], capture_output=True, text=True).stdout; \
nvcc = re.search(r'release (\d+)', out).group(1); ours = torch.version.cuda.split('.')[0]; \
assert nvcc == ours, f'nvcc is CUDA {nvcc}, vLLM torch is CUDA {ours}: use a BASE_IMAGE with CUDA {ours}'; \
print('torch', torch.__version__, 'CUDA', torch.version.cuda, '= nvcc major', nvcc)"
RUN NVTE_FRAMEWORK=pytorch MAX_JOBS=16 pip install --no-cache-dir --no-build-isolation \
        "transformer_engine[pytorch]==${TE_VERSION}"
COPY setup.py pyproject.toml README.md ./
COPY megarl ./megarl
COPY tools ./tools
COPY examples ./examples
# the [gpu] extra's vLLM / TE are already satisfied above, so pip keeps this torch
RUN pip install --no-cache-dir "megatron-core==${MCORE_VERSION}" -e '.[gpu]' \
    && python -c "import torch, megarl, megatron.core, vllm, transformer_engine.pytorch; \
print('torch', torch.__version__, 'vllm', vllm.__version__)"
ENV CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_MODE=offline
ENTRYPOINT []
