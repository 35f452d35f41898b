# Two entry points: `make demo` (the main job) and `make test` (the whole suite).
# Each sets up what it needs on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TORCH_PIN ?= torch==2.13.0
# test processes side by side (pytest-xdist); tests/conftest.py groups what must not overlap
TEST_WORKERS ?= 2
STAMP := $(VENV)/.thinwire-installed
FASHION_DIR := /usr/share/datasets/fashion-mnist

.PHONY: setup test lint demo bench clean

$(STAMP): pyproject.toml
	@missing=""; \
	[ -f $(FASHION_DIR)/train-images-idx3-ubyte.gz ] || missing="$$missing dataset-fashion-mnist"; \
	command -v tc >/dev/null 2>&1 || missing="$$missing iproute2"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    export DEBIAN_FRONTEND=noninteractive; \
	    apt-get update -qq && apt-get install -y -qq $$missing; \
	  else \
	    echo "note: missing Debian packages:$$missing; their tests are skipped (as root: apt-get install$$missing)"; \
	  fi; \
	fi
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_PIN)"
	$(PIP) install -q -e ".[dev,integrations]"
	@touch $(STAMP)

setup: $(STAMP)

lint: setup
	$(VENV)/bin/ruff check .

test: setup lint
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder --durations=25

demo: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/thinwire demo

bench: setup
	OMP_NUM_THREADS=1 $(PY) bench/compressors.py --out docs/results/compressors.json

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache
