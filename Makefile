# `make train` and `make test` set up .venv themselves: the engine, every plugin in
# algorithms/ and callbacks/ (editable) and the test tools. Python 3.10+ and pip are all they need.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PLUGINS := $(sort $(wildcard algorithms/*/pyproject.toml callbacks/*/pyproject.toml))
STAMP := $(VENV)/.installed

.PHONY: setup train test lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.cfg $(PLUGINS)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade --quiet "pip>=23" "setuptools>=64" wheel
	$(BIN)/python -m pip install --quiet -e ".[dev,sweep]" $(foreach p,$(PLUGINS),-e $(dir $(p)))
	touch $(STAMP)

train: $(STAMP)
	$(BIN)/slipstream train $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py $(ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
