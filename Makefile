# Two entry points a new machine needs: `make demo` (the main job) and `make test`.
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	@command -v $(PY) >/dev/null 2>&1 || { echo "need $(PY) on PATH"; exit 1; }
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --no-cache-dir -e '.[dev,peers,cluster]'  # no second copy of every wheel in pip's cache: less disk on the CI machine
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/hetforge demo

test: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/python -m pytest -p no:cacheprovider -rs tests
	$(BIN)/python -m pytest -p no:cacheprovider -rs -m "slow and not scale" tests

.PHONY: install demo test
