# trace-jax: `make run` runs the default experiment, `make test` the whole suite.
# Both create the virtual environment on first use; nothing else needs installing.
SHELL := /bin/bash
.ONESHELL:
# A recipe's lines run as one script: stop it at the first failing command.
.SHELLFLAGS := -ec

find_python = $(shell for p in $(1) $$HOME/.pyenv/versions/$(2)*/bin/$(1) /usr/local/bin/$(1) /usr/bin/$(1); do \
	if $$p --version >/dev/null 2>&1; then echo $$p; break; fi; done)
PYTHON312 ?= $(call find_python,python3.12,3.12)
PYTHON311 ?= $(call find_python,python3.11,3.11)
VENV := .venv
REF_VENV := .venv-ref
PY := $(VENV)/bin/python
# The independent reference implementations (torch, torchao, transformers, compressed-tensors) live
# in their own environment so that the package never depends on torch; the machine's local CPU
# build of torch is for Python 3.11.
REF_PACKAGES := torch==2.13.0 torchao==0.18.0 numpy==2.3.5 transformers==5.23.0 safetensors==0.8.0 \
	compressed-tensors==0.20.1

.PHONY: run test lint pytest ref-env clean

# --no-compile: modules are byte-compiled when first imported, not all of torch's and jax's at
# install (which took half of the reference environment's install). Python must be allowed to
# write those .pyc files: where PYTHONDONTWRITEBYTECODE is set (as in many container images) every
# process would compile every module it imports from source again (jax's stack: 8.4 s to import
# against 2.5 s from .pyc; torch and transformers: 14.2 s against 5.6 s), and the suite starts
# a dozen such processes (xdist workers, notebook kernels, multi-process and reference checks).
unexport PYTHONDONTWRITEBYTECODE
# What the suite's processes import, byte-compiled once at install (while the reference
# environment installs beside it).
WARM_IMPORTS := import jax, flax.nnx, optax, orbax.checkpoint, grain, tensorstore, safetensors, \
	tokenizers, matplotlib.pyplot, pytest, hypothesis, ipykernel.kernelapp, nbclient, nbmake, \
	trace_jax.rl.loop, experiments.runner

# (the reference scripts' imports: tests/fp4/reference_torchao.py, tests/model/hf_reference.py and
# reference_compressed_tensors.py, which run in three processes)
REF_WARM_IMPORTS := import torch, safetensors.torch, torchao.prototype.mx_formats.nvfp4_tensor, \
	torchao.prototype.mx_formats.mx_tensor, compressed_tensors.compressors, \
	compressed_tensors.quantization.lifecycle.forward, transformers.models.qwen3_moe.modeling_qwen3_moe, \
	transformers.models.qwen2_moe.modeling_qwen2_moe

$(VENV)/.installed: pyproject.toml
	@test -n "$(PYTHON312)" || { echo "python3.12 not found (set PYTHON312=/path/to/python3.12)"; exit 1; }
	test -x $(PY) || $(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile -e '.[dev]'
	JAX_PLATFORMS=cpu $(PY) -c "$(WARM_IMPORTS)"
	touch $@

$(REF_VENV)/.installed: Makefile
	@test -n "$(PYTHON311)" || { echo "python3.11 not found (set PYTHON311=/path/to/python3.11)"; exit 1; }
	test -x $(REF_VENV)/bin/python || $(PYTHON311) -m venv $(REF_VENV)
	$(REF_VENV)/bin/python -m pip install -q --no-compile $(REF_PACKAGES)
	$(REF_VENV)/bin/python -c "$(REF_WARM_IMPORTS)"
	touch $@

ref-env: $(REF_VENV)/.installed

run: $(VENV)/.installed
	$(PY) -m experiments run configs/quickstart.yaml $(ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Programs compiled again within the run (a resumed run, notebooks, subprocess checks) are loaded
# from JAX's persistent compilation cache.
# The suite is bound by XLA:CPU compiling many small programs: LLVM's backend optimisation off
# cuts that by about a quarter (the tiny models run as fast either way).
JAX_CACHE := JAX_COMPILATION_CACHE_DIR=$(CURDIR)/.pytest_cache/jax-cache \
	JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0.2 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0 \
	XLA_FLAGS="--xla_backend_optimization_level=0"

# Work stealing: each worker starts on half of the tests in collection order (where
# tests/conftest.py puts the modules with slow tests first) and takes queued tests from the other
# when it runs out, so both finish together (plain `load` sends chunks of consecutive tests, and a
# late chunk of slow ones could leave one worker idle for minutes).
pytest: $(VENV)/.installed $(REF_VENV)/.installed
	$(JAX_CACHE) TRACE_REF_PYTHON=$(REF_VENV)/bin/python $(VENV)/bin/pytest -q -n 2 \
		--dist worksteal --durations=25 tests notebooks --nbmake

# pip installs on one core: the two environments are built side by side (lint runs as soon as
# .venv is ready, while .venv-ref may still be installing).
test:
	$(MAKE) -j2 --output-sync=target lint ref-env
	$(MAKE) pytest

clean:
	rm -rf $(VENV) $(REF_VENV) .pytest_cache .ruff_cache .hypothesis
