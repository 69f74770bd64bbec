"""Shared fixtures of the operator tests (test modules cannot import each other here:
``tests/operator`` must not become a package, or it would shadow the stdlib ``operator``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from misat_operator.render import PoolRef

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def mixed_pool() -> dict[str, Any]:
    """examples/mixed-pool.yaml as a mapping (a fresh copy per test)."""
    return yaml.safe_load((ROOT / "examples" / "mixed-pool.yaml").read_text())


@pytest.fixture
def pool_ref() -> PoolRef:
    return PoolRef(name="mixed-pool", namespace="rl", uid="0c7f3e8a-1111-4222-8333-944455556666", generation=3)
