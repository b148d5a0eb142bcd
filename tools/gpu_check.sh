#!/usr/bin/env bash
# megarl GPU check: everything megarl can check on a GPU machine without network access.
#
#   bash tools/gpu_check.sh [--cpu] [--only STEP,STEP] [--budget SECONDS]
#
# Steps (tools/gpu_check/*.py, each in its own process under `timeout`, in priority order):
#   env         versions, GPU, megarl's process-group init + CPU/CUDA collectives, matmul, d2d copy
#   train       actor/reference/critic, logprobs, GRPO + PPO updates, Adam state before the
#               free-memory check, bf16 GPU vs fp32 CPU parity
#   sync        weight-sync writer into vLLM-layout device tensors at 7B shapes, bitwise
#   throughput  tokens/s and MFU of a training step (1B, then 7B if it fits)
#   optional    Transformer-Engine, FP8, FP8-parameter masters, vLLM engine, sleep/wake,
#               prefix cache (SKIP, naming the package, where one is absent)
# Results: ${OUT:-gpu_check_out}/gpu_check.jsonl (one JSON object per check), gpu_check.log
# (every step's output), gpu_check_table.txt. Never stops at a failure; exit 1 if a check FAILed.
# Without a GPU every GPU check is a SKIP (exit 0); --cpu runs the steps on CPU, fp32, tiny.
# The whole run stays within --budget (default 450 s): each step's timeout is cut to what is left.
#
# Python: GPU_CHECK_PYTHON is used as is. Otherwise a venv (--system-site-packages) is made from
# GPU_CHECK_BASE_PYTHON, /opt/torch/.venv/bin/python3 (the GPU image), or python3, and the wheels
# in GPU_CHECK_WHEELS (default .gpu_wheels/, from `make gpu-wheels`) go into it with --no-index;
# where there is no /opt/torch and the checkout's .venv has megatron-core, that .venv is used.
set -u -o pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2

MODE=auto
ONLY=""
BUDGET=${GPU_CHECK_BUDGET_S:-450}
while [ $# -gt 0 ]; do
  case $1 in
    --cpu) MODE=cpu ;;
    --only) ONLY=${2:-}; shift ;;
    --budget) BUDGET=${2:-450}; shift ;;
    -h | --help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (accepted: --cpu, --only STEPS, --budget S)" >&2
       exit 2 ;;
  esac
  shift
done

OUT_DIR=${OUT:-gpu_check_out}
mkdir -p "$OUT_DIR" || exit 2
JSONL=$OUT_DIR/gpu_check.jsonl
LOG=$OUT_DIR/gpu_check.log
TABLE=$OUT_DIR/gpu_check_table.txt
: >"$JSONL"
: >"$LOG"
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/megarl_gpu_check.XXXXXX") || exit 2
trap 'rm -rf "$SCRATCH"' EXIT
START=$(date +%s)
WHEELS=${GPU_CHECK_WHEELS:-.gpu_wheels}
DEVICE_LABEL=none
PY=""

# a fresh one-rank process group per step (megarl.trainer.run.init_distributed); no network
for v in RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT; do unset "$v"; done
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if [ -e /sys/class/net/lo ]; then
  export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo} NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}
fi

if command -v timeout >/dev/null 2>&1; then
  tmo() { local t=$1; shift; timeout -k 15 "$t" "$@"; }
else
  tmo() { shift; "$@"; }
fi

say() { printf '%s\n' "$*" | tee -a "$LOG"; }

json_str() {
  local s
  s=$(printf '%s' "$1" | tr -d '\000-\010\013\014\016-\037')
  s=${s//\\/\\\\}
  s=${s//\"/\\\"}
  s=${s//$'\n'/\\n}
  s=${s//$'\t'/ }
  s=${s//$'\r'/}
  printf '"%s"' "$s"
}

# record STEP CHECK STATUS REASON [SECONDS] [FIGURES_JSON]: one JSON line, printed as well
record() {
  local figs=${6:-}
  [ -n "$figs" ] || figs='{}'
  printf '{"step": %s, "check": %s, "status": %s, "seconds": %s, "device": %s, "reason": %s, "figures": %s, "time": %s}\n' \
    "$(json_str "$1")" "$(json_str "$2")" "$(json_str "$3")" "${5:-null}" \
    "$(json_str "$DEVICE_LABEL")" "$(json_str "$4")" "$figs" \
    "$(json_str "$(date +%Y-%m-%dT%H:%M:%S)")" >>"$JSONL"
  say "$3 $1.$2: $4"
}

# ------------------------------------------------------------------------------- the Python
install_wheels() { # install_wheels VENV_PYTHON SITE_DIR BASE_PYTHON
  local whls=()
  shopt -s nullglob
  whls=("$WHEELS"/*.whl)
  shopt -u nullglob
  WHEEL_NOTE="${#whls[@]} wheel(s) in $WHEELS"
  [ ${#whls[@]} -eq 0 ] && return 0
  local pipargs=(install --no-deps --no-index --ignore-installed --no-compile
    --disable-pip-version-check -q)
  tmo 180 "$1" -m pip "${pipargs[@]}" "${whls[@]}" >>"$LOG" 2>&1 && return 0
  # no pip importable from the venv: the base interpreter's pip, into the venv's site-packages
  tmo 180 "$3" -m pip "${pipargs[@]}" --target "$2" "${whls[@]}" >>"$LOG" 2>&1
}

make_venv() { # make_venv BASE_PYTHON: sets PY
  local base=$1 venv=${GPU_CHECK_VENV:-${TMPDIR:-/tmp}/megarl_gpu_check_venv} site
  rm -rf "$venv"
  tmo 120 "$base" -m venv --system-site-packages --without-pip "$venv" >>"$LOG" 2>&1 || return 1
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') ||
    return 1
  # A venv made from another venv (the image's /opt/torch/.venv) sees the *base* interpreter's
  # site-packages, not that venv's torch: add the given interpreter's own site dirs, .pth included
  "$base" -c 'import site; print("\n".join("import site; site.addsitedir(%r)" % p for p in site.getsitepackages()))' \
    >"$site/_megarl_gpu_check_base.pth" || return 1
  PY=$venv/bin/python
  install_wheels "$PY" "$site" "$base" || WHEEL_NOTE="$WHEEL_NOTE; pip install failed (see log)"
}

setup_python() {
  local t0 base="" how err
  t0=$(date +%s)
  WHEEL_NOTE="no wheels installed"
  if [ -n "${GPU_CHECK_PYTHON:-}" ]; then
    PY=$GPU_CHECK_PYTHON
    how="GPU_CHECK_PYTHON"
  else
    base=${GPU_CHECK_BASE_PYTHON:-}
    if [ -z "$base" ] && [ -x /opt/torch/.venv/bin/python3 ]; then
      base=/opt/torch/.venv/bin/python3
    elif [ -z "$base" ] && [ -x "$ROOT/.venv/bin/python" ] &&
      compgen -G "$ROOT/.venv/lib/python3*/site-packages/megatron/core" >/dev/null; then
      PY=$ROOT/.venv/bin/python
      how="the checkout's .venv"
    elif [ -z "$base" ]; then
      base=$(command -v python3 || echo python3)
    fi
    if [ -n "$base" ]; then
      if make_venv "$base"; then
        how="venv from $base"
      else
        PY=$base
        how="$base itself (venv creation failed, see log)"
        mkdir -p "$SCRATCH/site"
        install_wheels "$PY" "$SCRATCH/site" "$PY" || WHEEL_NOTE="$WHEEL_NOTE; pip failed"
        export PYTHONPATH="$SCRATCH/site:$PYTHONPATH"
      fi
    fi
  fi
  local figs
  figs="{\"python\": $(json_str "$PY"), \"how\": $(json_str "$how"), \"wheels\": $(json_str "$WHEEL_NOTE")}"
  local probe='import torch, megatron.core, megarl
print(torch.cuda.get_device_name() if torch.cuda.is_available() else "none")'
  if err=$(tmo 120 "$PY" -c "$probe" 2>&1); then
    DEVICE_LABEL=$(printf '%s' "$err" | tail -n 1)
    [ "$MODE" = cpu ] && DEVICE_LABEL=cpu
    record setup python PASS "$PY ($how; $WHEEL_NOTE)" "$(($(date +%s) - t0))" "$figs"
  else
    record setup python FAIL "cannot import torch, megatron.core, megarl with $PY ($how; $WHEEL_NOTE): $(printf '%s' "$err" | tail -n 1)" \
      "$(($(date +%s) - t0))" "$figs"
  fi
}

# ------------------------------------------------------------------------------- the steps
selected() { [ -z "$ONLY" ] || [[ ",$ONLY," == *",$1,"* ]]; }

run_step() { # run_step STEP LABEL CAP_SECONDS SCRIPT [ARGS...]
  local step=$1 label=$2 cap=$3 script=$4
  shift 4
  selected "$step" || return 0
  local check=${label:-process} left t rc t0 took sf
  left=$((BUDGET - ($(date +%s) - START) - 15))
  t=$cap
  [ "$left" -lt "$t" ] && t=$left
  if [ "$t" -lt 20 ]; then
    record "$step" "$check" SKIP "not started: ${left}s left of the ${BUDGET}s budget"
    return 0
  fi
  sf=$SCRATCH/records_${step}${label:+_$label}.jsonl
  : >"$sf"
  say "--- $step${label:+ $label} (timeout ${t}s): $script ${DEV_ARGS[*]} $*"
  echo "===== $step $label $(date +%H:%M:%S) =====" >>"$LOG"
  t0=$(date +%s)
  tmo "$t" "$PY" "tools/gpu_check/$script" "${DEV_ARGS[@]}" --records "$sf" --scratch "$SCRATCH" \
    --budget-s "$((t - 10))" "$@" >>"$LOG" 2>&1
  rc=$?
  took=$(($(date +%s) - t0))
  local tail_
  tail_=$(tail -n 4 "$LOG" | tr '\n' ' ' | cut -c1-400)
  cat "$sf" >>"$JSONL"
  "$PY" tools/gpu_check/summary.py --lines "$sf" 2>>"$LOG" | tee -a "$LOG" || cat "$sf"
  if [ $rc -eq 124 ] || { [ $rc -eq 137 ] && [ "$took" -ge "$t" ]; }; then
    record "$step" "$check" FAIL "timed out after ${t}s; checks not listed above did not run" "$took"
  elif [ $rc -eq 137 ]; then
    record "$step" "$check" FAIL "killed (SIGKILL: out of host memory?) after ${took}s" "$took"
  elif [ $rc -ne 0 ] && ! grep -q '"status": "FAIL"' "$sf"; then
    record "$step" "$check" FAIL "exited with status $rc without recording a FAIL; log ends: $tail_" "$took"
  elif [ ! -s "$sf" ]; then
    record "$step" "$check" FAIL "recorded nothing (exit $rc); log ends: $tail_" "$took"
  fi
}

say "megarl GPU check: mode=$MODE budget=${BUDGET}s out=$OUT_DIR root=$ROOT"
setup_python
say "python: $PY  device: $DEVICE_LABEL"
if [ "$MODE" = cpu ]; then
  DEV_ARGS=(--device cpu --tiny)
  export CUDA_VISIBLE_DEVICES=""  # megarl's CPU emulation assumes no CUDA device is visible
else
  DEV_ARGS=(--device auto)
fi
run_step env "" 90 step_env.py
run_step train "" 240 step_train.py
run_step sync "" 150 step_sync.py
if [ "$MODE" = cpu ]; then
  run_step throughput "" 120 step_throughput.py
else
  run_step throughput llama_1b 150 step_throughput.py --model llama_1b
  run_step throughput llama_7b 180 step_throughput.py --model llama_7b
fi
run_step optional "" 90 step_optional.py

SUMMARY_PY=$PY
"$SUMMARY_PY" -c '' 2>/dev/null || SUMMARY_PY=python3
"$SUMMARY_PY" tools/gpu_check/summary.py --table "$JSONL" >"$TABLE" 2>>"$LOG" || cp "$JSONL" "$TABLE"
echo
tee -a "$LOG" <"$TABLE"
say "total $(($(date +%s) - START)) s; results in $JSONL, log in $LOG"
if grep -q '"status": "FAIL"' "$JSONL"; then
  exit 1
fi
exit 0
