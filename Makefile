# loraserve: `make serve` runs the platform on embedded defaults; `make test` runs the suite.
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test lint bench serve system-deps clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e ".[dev]"
	@touch $(STAMP)

setup: $(STAMP)

# PostgreSQL server binaries and Chromium come from Debian packages when missing.
system-deps:
	@bash scripts/system_deps.sh

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: setup system-deps lint
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -m "not gpu" --timeout=900

bench: setup
	$(BIN)/python benchmarks/throughput.py --suite base --json
	$(BIN)/python benchmarks/sgmv.py --json

serve: setup
	$(BIN)/loraserve serve

clean:
	rm -rf $(VENV) loraserve-data
