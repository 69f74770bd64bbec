# Two commands: `make demo` and `make test`. Each sets up .venv when missing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-dev

.PHONY: install demo test lint typecheck bench microbench proxybench e2e clean

$(PY):
	$(PYTHON) -P -m venv $(VENV)
	$(PY) -P -m pip install --quiet --upgrade pip

# Reinstall when the project's metadata changes.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -P -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# Only the `misat` command (router, simulator, demo/up/status): no test or benchmark tools.
install: | $(PY)
	$(PY) -P -m pip install --quiet -e '.[cli]'
	@echo "installed: $(VENV)/bin/misat ($$($(VENV)/bin/misat --version))"

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# mypy resolves modules by folder name; the folders are mapped to import names in
# pyproject.toml, so mypy reads them through links named as they import.
TYPECHECK_LINKS := misat_router=router misat_sim=sim misat_operator=operator misat_cli=cli misat_bench=bench misat_client=client
typecheck: $(STAMP)
	@mkdir -p build/typecheck
	@for pair in $(TYPECHECK_LINKS); do ln -sfn ../../$${pair#*=} build/typecheck/$${pair%%=*}; done
	$(VENV)/bin/mypy

# The system packages the tests run for real (haproxy in front of router shards; prometheus and
# promtool for the monitoring files); idempotent.
test: $(STAMP) lint typecheck
	bash scripts/system-packages.sh haproxy prometheus promtool
	$(VENV)/bin/pytest

demo: $(STAMP)
	$(VENV)/bin/misat demo

bench: $(STAMP)
	$(VENV)/bin/misat bench

microbench: $(STAMP)
	$(PY) -P -m misat_bench.policy_microbench

# The router's data path against the vllm-router binary on instant nginx stubs (docs/scale.md);
# wrk, nginx (and haproxy, for router shards) come from Debian via scripts/system-packages.sh.
# PROXYBENCH_ARGS: extra flags, e.g. --rounds 5 --extra-router before=/tmp/before_pkgs --profile 10
proxybench: $(STAMP)
	bash scripts/system-packages.sh
	$(PY) -P -m misat_bench.proxy_bench $(PROXYBENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis

# Real vLLM (CPU build) end to end: its own environment, a tiny model built locally.
e2e:
	bash scripts/e2e.sh

# The router/operator image (Dockerfile); needs a container builder (docker or podman).
IMAGE_REPOSITORY ?= ghcr.io/misa-t/misa-t
IMAGE_TAG ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
CONTAINER_BUILDER ?= $(shell command -v docker || command -v podman)
.PHONY: image
image:
	@test -n "$(CONTAINER_BUILDER)" || { echo "make image: no docker or podman on PATH" >&2; exit 2; }
	$(CONTAINER_BUILDER) build -t $(IMAGE_REPOSITORY):$(IMAGE_TAG) .
