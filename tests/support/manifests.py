"""The example RolloutPool, cut down for tests that run it locally."""

from __future__ import annotations

from pathlib import Path

import yaml

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "mixed-pool.yaml"
"""The manifest `make demo` and `misat up` use."""


def one_engine_manifest(tmp_path: Path, **admission: object) -> Path:
    """``examples/mixed-pool.yaml`` with one engine replica (and ``admission`` fields set), written
    to ``tmp_path / "pool.yaml"``."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["engines"]["replicas"] = 1
    doc["spec"]["admission"].update(admission)
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path
