# `make train` and `make test` set up .venv themselves: the engine, every plugin in
# algorithms/ and callbacks/ (editable) and the test tools. Python 3.10+ and pip are all they need.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PLUGINS := $(sort $(wildcard algorithms/*/pyproject.toml callbacks/*/pyproject.toml datasets/*/pyproject.toml))
STAMP := $(VENV)/.installed
BACKENDS := "pip>=25" "setuptools>=70.1" "flit_core>=3.4,<5"
# setuptools says "Editable installation." once per editable install (a page each, with
# nothing to act on); pip passes this filter on to the build back-ends it starts.
QUIET_PIP := PYTHONWARNINGS="ignore:Editable installation"
# A pip configuration that names index folders which do not exist (some managed machines
# have one) makes pip warn once per package and folder: over a hundred lines with nothing
# to act on. Only that line is dropped; pip's exit status still ends the set-up (pipefail).
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
PIP_FILTER := 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
# `make test` runs the suite on this many pytest-xdist workers, a test file per
# worker (module fixtures run once); `make test TEST_WORKERS=0` runs it in one process.
TEST_WORKERS ?= 2

.PHONY: setup train test lint bench clean gpu-wheels gpu-check

setup: $(STAMP)

# Set-up time (docs/results/2026-11-29-first-contact.md): the build back-ends go into the
# venv once and every editable install uses them (--no-build-isolation), instead of pip
# making an isolated build environment per package; the plugins build with flit_core
# (about 0.2 s each against setuptools' 1.7 s). The venv is made without pip and the
# machine's pip puts a current one in (ensurepip's old pip, replaced at once, cost 6 s);
# where that pip cannot (older than 22.3, or none), the venv is made with its own.
# pip does not byte-compile what it installs (--no-compile): that was a third of the
# set-up, some 16,000 files, most never imported. Instead every command here writes
# the bytecode of what it imports, once, also where PYTHONDONTWRITEBYTECODE is set (as
# on this project's machines and CI), where nothing else would and every process would
# compile torch again (the suite ran 1.45x longer); the set-up ends by importing what a
# training run does (11 s), so that .venv/bin/slipstream starts as fast right after it.
export PYTHONDONTWRITEBYTECODE :=

$(STAMP): Makefile pyproject.toml setup.cfg $(PLUGINS)
	$(PYTHON) -m venv --without-pip $(VENV)
	$(QUIET_PIP) $(PYTHON) -m pip --python $(BIN)/python install --quiet $(BACKENDS) $(PIP_FILTER) 2>/dev/null \
		|| { $(PYTHON) -m venv $(VENV) && $(QUIET_PIP) $(BIN)/python -m pip install --quiet $(BACKENDS) $(PIP_FILTER); }
	$(QUIET_PIP) $(BIN)/python -m pip install --quiet --no-build-isolation --no-compile \
		-e ".[dev,sweep,onnx]" $(foreach p,$(PLUGINS),-e $(dir $(p))) $(PIP_FILTER)
	$(BIN)/python -c "import torch, torchvision, timm, kornia, slipstream.cli.main, slipstream.run.build"
	touch $(STAMP)

train: $(STAMP)
	$(BIN)/slipstream train $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/test_layout.py

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py $(ARGS)

# The wheels the bare, offline GPU machine lacks (omegaconf, kornia, ...), for its
# Python 3.12 on manylinux x86-64, into .gpu-wheels/ (git-ignored; carry it). docs/gpu.md.
gpu-wheels: $(STAMP)
	$(BIN)/python tools/gpu_wheels.py $(ARGS)

# On the GPU machine: bash tools/gpu_check.sh. Here: its dry run at toy size on the CPU.
gpu-check: $(STAMP)
	bash tools/gpu_check.sh --dry-run

clean:
	rm -rf $(VENV) runs .pytest_cache
