# Two commands: `make demo` and `make test`. Each sets up .venv when missing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-dev

.PHONY: demo test lint bench microbench e2e clean

$(PY):
	$(PYTHON) -P -m venv $(VENV)
	$(PY) -P -m pip install --quiet --upgrade pip

# Reinstall when the project's metadata changes.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -P -m pip install --quiet -e '.[dev,bench]'
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: $(STAMP) lint
	$(VENV)/bin/pytest

demo: $(STAMP)
	$(VENV)/bin/misat demo

bench: $(STAMP)
	$(VENV)/bin/misat bench

microbench: $(STAMP)
	$(PY) bench/policy_microbench.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis

# Real vLLM (CPU build) end to end: its own environment, a tiny model built locally.
e2e:
	bash scripts/e2e.sh
