#!/usr/bin/env bash
# Slurm launch for examples/grpo_llama3_70b_fp8.yaml: 4 nodes x 8 GPUs, srun + torchrun, with
# preemption-safe checkpoints and requeue (docs/preemption.md).
# needs: /models/Meta-Llama-3-70B-Instruct /ckpt/llama3-70b /data/math_train.jsonl (downloaded,
#   converted and prepared by the commands in the first lines of examples/grpo_llama3_70b_fp8.yaml)
#   sbatch examples/slurm_llama3_70b.sh                             # --set key=value ... overrides
#   RUN_NAME=llama3-70b-1234 sbatch examples/slurm_llama3_70b.sh   # continue an earlier job's run
# The run directory (--out) must be on a filesystem every node sees: megatron's distributed
# checkpoints are written by all ranks into one directory, a resume reads them back from any
# node, and rank 0 reads the stop file there. (vLLM's model config is written per node.)
#
# Stopping in time: 10 minutes before the time limit Slurm sends USR1 to this script only
# (--signal=B:...); the trap writes RUN/STOP; at the next step boundary every rank sees it,
# megarl writes a checkpoint of the finished step and RUN/stopped.json and exits; this script
# then requeues the job, which resumes from that checkpoint in the same run directory. Choose
# the lead time from the "checkpoint written in ... s (longest step so far ... s)" log lines:
# it must cover one step plus one save. A requeued job keeps its SLURM_JOB_ID, so the run
# directory below stays the same; a new sbatch names it with RUN_NAME.
#
# Network: megarl sends object collectives, barriers, metrics and the separate placement's
# weights over gloo, which finds each rank's address by resolving the host's own name; on hosts
# whose name resolves to 127.0.1.1 (Debian / Ubuntu's /etc/hosts) the first cross-node gloo
# collective times out. The script therefore names an interface for gloo and for NCCL's
# bootstrap: the one that carries this node's default route, unless you export
# GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME yourself (e.g. ib0, or the interface `ip -o route get
# <another node's address>` names). srun passes the values to every node: the interface name
# must be the same on all of them (docs/troubleshooting.md).
#
# The same script on one CPU node (tests/test_slurm.py runs it under a real Slurm controller):
# options given to sbatch on its command line override the #SBATCH lines (--nodes=1
# --gpus-per-node=0 --cpus-per-task=2, and --time / --signal for a short lead), and three
# variables, whose defaults are the 70B run, choose what runs: MEGARL_CONFIG (the config file;
# empty: megarl's embedded default, the tiny CPU task), NPROC_PER_NODE (ranks per node, 8) and
# RUN_ROOT (runs). Nothing else differs.
#SBATCH --job-name=megarl-70b
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1          # one torchrun per node; it starts the 8 ranks of the node
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=96
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --signal=B:USR1@600          # USR1 to the batch shell 600 s before the time limit
#SBATCH --requeue                    # this job may be requeued (by the script or by preemption)
#SBATCH --open-mode=append           # a requeued job appends to its log instead of truncating it
set -euo pipefail

CONFIG=${MEGARL_CONFIG-examples/grpo_llama3_70b_fp8.yaml}
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
RUN_NAME=${RUN_NAME:-llama3-70b-${SLURM_JOB_ID}}
RUN_DIR=${RUN_ROOT:-runs}/$RUN_NAME
mkdir -p "$RUN_DIR"
# a stop request belongs to the attempt that made it
rm -f "$RUN_DIR/STOP" "$RUN_DIR/stopped.json"
echo "megarl run directory $RUN_DIR (job $SLURM_JOB_ID, restart ${SLURM_RESTART_COUNT:-0})"

# rendezvous: the first node of the allocation hosts torchrun's c10d store (sed, not head:
# head would close the pipe early, and with pipefail scontrol's SIGPIPE would end the script)
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
export MASTER_ADDR=$head_node MASTER_PORT=${MASTER_PORT:-29500}
# gloo and NCCL's bootstrap on a named interface (see "Network" above)
default_if=$(ip -o route show default 2>/dev/null | sed -n 's/.* dev \([^ ]*\).*/\1/p' || true)
default_if=${default_if%%$'\n'*}  # the first default route's
if [[ -n ${GLOO_SOCKET_IFNAME:-$default_if} ]]; then
  export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$default_if}
  export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$GLOO_SOCKET_IFNAME}
  echo "gloo sockets on $GLOO_SOCKET_IFNAME, NCCL's bootstrap on $NCCL_SOCKET_IFNAME"
fi

# megatron-core overlaps TP communication with compute only with a single CUDA work queue
export CUDA_DEVICE_MAX_CONNECTIONS=1
# NVLink SHARP (NVLS) buffers take GPU memory that colocated vLLM + trainer cannot spare
export NCCL_NVLS_ENABLE=0
# fail a rank that waits on a dead peer instead of hanging until the Slurm time limit; megarl
# sets the collective timeout a few minutes above trainer.step_timeout_minutes, whose watchdog
# writes RUN/hang-rank{R}.txt first
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
# offline unless you set WANDB_MODE=online (and a key) in the environment you sbatch from
export WANDB_MODE=${WANDB_MODE:-offline}

trap 'echo "USR1: asking megarl to stop after the current step"; touch "$RUN_DIR/STOP"' USR1

# --kill-on-bad-exit: one failed node ends the job; rdzv_id scopes the rendezvous to this job.
# --max-restarts: a rank that dies (or hangs: exit 5) restarts the node's workers, which resume
# from the newest checkpoint. --shutdown-timeout: after a SIGTERM (Slurm's preemption or the
# time limit), torchrun passes it on and kills the workers this many seconds later; megarl
# saves at the next step boundary, so give it a step plus a save when Slurm's KillWait allows.
# Run in the background: bash runs a trap only between commands, and `wait` is one.
srun --kill-on-bad-exit=1 torchrun \
  --nnodes "$SLURM_NNODES" --nproc_per_node "$NPROC_PER_NODE" \
  --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "$SLURM_JOB_ID" \
  --max-restarts 2 --shutdown-timeout 120 \
  -m megarl train ${CONFIG:+"$CONFIG"} --out "$RUN_DIR" "$@" &
step=$!
status=0
while :; do
  wait "$step" && status=0 || status=$?
  kill -0 "$step" 2>/dev/null || break  # ended (not just a trap that interrupted the wait)
done

# torchrun reports any worker status but 0 as its own 1, so megarl's "stopped after a
# checkpoint" (status 4) is read from the file it writes
if [[ -f "$RUN_DIR/stopped.json" ]]; then
  echo "megarl stopped after a checkpoint: $(tr -d '\n' < "$RUN_DIR/stopped.json")"
  echo "requeueing job $SLURM_JOB_ID (it resumes in $RUN_DIR)"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
exit "$status"
