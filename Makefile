# rollserve: `make demo` runs the examples end to end; `make test` runs lint, types and tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test lint typecheck unit bench bench-quick install system-deps clean

install: $(STAMP)

# torch is installed first and pinned: pip then never reaches for a CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[model,dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/rollserve demo

lint: $(STAMP)
	$(VENV)/bin/ruff check --no-cache .
	$(VENV)/bin/ruff format --no-cache --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

unit: $(STAMP)
	$(VENV)/bin/pytest -q -p no:cacheprovider

test: lint typecheck unit

bench: $(STAMP)
	for b in bench/*.py; do $(PY) $$b || exit 1; done

bench-quick: $(STAMP)
	for b in bench/*.py; do $(PY) $$b --quick || exit 1; done

clean:
	rm -rf $(VENV) .rollserve results .mypy_cache .ruff_cache
