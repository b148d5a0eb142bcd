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
RUN pip install --no-cache-dir "vllm==${VLLM_VERSION}"
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
