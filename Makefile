# Two commands are the contract: `make demo` and `make test` (see README.md).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck unit venv clean
.PHONY: real-engines compiled peer-routers

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python scripts/build_compiled.py --install
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m kiloserve.demo

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/lint-imports --no-cache

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	bash scripts/ensure_tools.sh
	$(BIN)/pytest -q

# Real vLLM (CPU) + llama.cpp for tests/integration/real, cached under ~/.cache/kiloserve (or
# $KILOSERVE_CACHE); never fails: what cannot be installed is skipped, with the reason.
real-engines:
	bash scripts/real_engines.sh

# SGLang's and vLLM's Rust routers, the in-run references of benchmarks/gateway_overhead.py,
# in their own venv under ~/.cache/kiloserve/peer-routers; never fails (they are then skipped).
peer-routers:
	bash scripts/peer_routers.sh

test: lint typecheck real-engines peer-routers unit

# The simulator's hot modules compiled with mypyc (also built at install; a no-op when
# up to date), into ~/.cache/kiloserve/compiled/<source hash>. See docs/simulator.md.
compiled: $(STAMP)
	$(BIN)/python scripts/build_compiled.py

clean:
	rm -rf $(VENV) build build-compiled *.egg-info src/*.egg-info
