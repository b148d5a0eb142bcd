#!/usr/bin/env bash
# Debian's Slurm (controller, node daemon, clients: 22.05 on bookworm) and munge, for
# tests/test_slurm.py. Nothing to do when they are installed. Exit status 3 (with the reason on
# stdout) when they cannot be installed here: not root, or no apt-get.
set -euo pipefail

have=1
for cmd in slurmctld slurmd sbatch scontrol munged; do
  command -v "$cmd" >/dev/null 2>&1 || [[ -x /usr/sbin/$cmd ]] || have=0
done
[[ $have == 1 ]] && exit 0
if [[ $(id -u) != 0 ]]; then
  echo "installing slurm and munge needs root"
  exit 3
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "slurm / munge are not installed and there is no apt-get to install them"
  exit 3
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q slurmctld slurmd slurm-client munge
