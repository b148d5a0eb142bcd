#!/usr/bin/env bash
# Slurm launch for examples/grpo_llama3_70b_fp8.yaml: 4 nodes x 8 GPUs, srun + torchrun.
#SBATCH --job-name=megarl-70b
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=96
#SBATCH --exclusive
#SBATCH --time=48:00:00
set -euo pipefail
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR=$head_node MASTER_PORT=29500
export CUDA_DEVICE_MAX_CONNECTIONS=1 NCCL_NVLS_ENABLE=0 WANDB_MODE=${WANDB_MODE:-offline}
srun --kill-on-bad-exit=1 torchrun \
  --nnodes "$SLURM_NNODES" --nproc_per_node 8 \
  --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "$SLURM_JOB_ID" \
  -m megarl train examples/grpo_llama3_70b_fp8.yaml --out "runs/llama3-70b-$SLURM_JOB_ID" "$@"
