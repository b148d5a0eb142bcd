#!/usr/bin/env bash
# Slurm launch for examples/grpo_llama3_70b_fp8.yaml: 4 nodes x 8 GPUs, srun + torchrun.
#   sbatch examples/slurm_llama3_70b.sh [--set key=value ...]
# The run directory (--out) and the checkpoint must be on a filesystem every node sees:
# megatron's distributed checkpoints are written by all ranks into one directory, and a resume
# reads them back from any node. (vLLM's model config is written per node, so that part is not.)
#SBATCH --job-name=megarl-70b
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1          # one torchrun per node; it starts the 8 ranks of the node
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=96
#SBATCH --exclusive
#SBATCH --time=48:00:00
set -euo pipefail

# rendezvous: the first node of the allocation hosts torchrun's c10d store
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR=$head_node MASTER_PORT=${MASTER_PORT:-29500}

# megatron-core overlaps TP communication with compute only with a single CUDA work queue
export CUDA_DEVICE_MAX_CONNECTIONS=1
# NVLink SHARP (NVLS) buffers take GPU memory that colocated vLLM + trainer cannot spare
export NCCL_NVLS_ENABLE=0
# fail a rank that waits on a dead peer instead of hanging until the Slurm time limit
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
# offline unless you set WANDB_MODE=online (and a key) in the environment you sbatch from
export WANDB_MODE=${WANDB_MODE:-offline}

# --kill-on-bad-exit: one failed node ends the job; rdzv_id scopes the rendezvous to this job
srun --kill-on-bad-exit=1 torchrun \
  --nnodes "$SLURM_NNODES" --nproc_per_node 8 \
  --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "$SLURM_JOB_ID" \
  -m megarl train examples/grpo_llama3_70b_fp8.yaml --out "runs/llama3-70b-$SLURM_JOB_ID" "$@"
