# GPU image: megarl on NVIDIA's PyTorch container (CUDA, NCCL, Transformer-Engine, Apex included).
# Users on clusters run newer megatron-core here; megarl keeps to its public API (see setup.py).
#   docker build -t megarl .
#   docker run --gpus all --ipc=host -v /models:/models megarl \
#     torchrun --nproc_per_node 8 -m megarl train examples/grpo_qwen2.5_7b_gsm8k.yaml
FROM nvcr.io/nvidia/pytorch:25.06-py3
WORKDIR /opt/megarl
COPY setup.py pyproject.toml README.md ./
COPY megarl ./megarl
COPY tools ./tools
COPY examples ./examples
# TE ships in the base image; vLLM brings its CUDA build; keep the image's torch
RUN pip install --no-cache-dir -e '.[gpu]' && python -c "import megarl, megatron.core, vllm"
ENV CUDA_DEVICE_MAX_CONNECTIONS=1 WANDB_MODE=offline
ENTRYPOINT []
