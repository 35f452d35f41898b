# Two entry points: `make demo` (the main job) and `make test` (the whole suite).
# Each sets up what it needs on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.thinwire-installed

.PHONY: setup test lint demo bench clean

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_PIN)"
	$(PIP) install -q -e ".[dev]"
	@touch $(STAMP)

setup: $(STAMP)

lint: setup
	$(VENV)/bin/ruff check .

test: setup lint
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q

demo: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/thinwire demo

bench: setup
	OMP_NUM_THREADS=1 $(PY) bench/compressors.py --out results/compressors.json

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache
