# Two entry points: `make run` (set up, then a real job on the tiny CPU default) and
# `make test` (set up, then the suite). Both work on a fresh machine with Python 3.11.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CONFIG ?= configs/tiny.toml

.PHONY: run test lint bench clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU torch wheel first: any other torch spec asked for first pulls a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/pivot run $(CONFIG)

test: $(STAMP)
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check pivot bus actors cli tests

bench: $(STAMP)
	$(BIN)/pivot bench bus

clean:
	rm -rf $(VENV) runs .pytest_cache
