"""The Dockerfile builds the image the renderer and the chart name, with the entry points they call.

No image is built here (no container daemon runs on these machines, and the build downloads
packages): the Dockerfile is read as text. Checked: the entry point is a console script of
pyproject.toml; the router command the operator renders starts with a console script; the chart's
operator command is `python -m misat_operator`, a module with a ``__main__``, with the operator
extra installed; the image runs as the uid the router pods use; the pinned router image, the
chart's repository and appVersion, `make image`'s tag and the package version agree.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import subprocess
import tomllib
from pathlib import Path

import yaml

from misat_operator.models import ROUTER_IMAGE, ROUTER_UID, parse_spec
from misat_operator.render import PoolRef, render
from tests.support.helm import CHART, one
from tests.support.helm import render as render_chart

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def instructions(name: str) -> list[str]:
    """Arguments of every ``NAME`` instruction (continuation lines joined)."""
    text = DOCKERFILE.replace("\\\n", " ")
    return [m.group(1).strip() for m in re.finditer(rf"^{name}\s+(.*)$", text, re.MULTILINE)]


def final_stage() -> str:
    return DOCKERFILE.rsplit("\nFROM ", 1)[1]


def test_entrypoint_is_a_console_script() -> None:
    (entrypoint,) = instructions("ENTRYPOINT")
    command = json.loads(entrypoint)
    scripts = PYPROJECT["project"]["scripts"]
    assert command[0] in scripts
    module, _, func = scripts[command[0]].partition(":")
    assert hasattr(importlib.import_module(module), func)


def test_rendered_router_command_exists_in_the_image() -> None:
    spec = parse_spec(yaml.safe_load((ROOT / "examples" / "mixed-pool.yaml").read_text())["spec"])
    router = render(spec, PoolRef("p", "ns", "u", 1), "t").router_deployment
    (container,) = router["spec"]["template"]["spec"]["containers"]
    assert container["image"] == ROUTER_IMAGE
    command = container["command"]
    assert command[0] in PYPROJECT["project"]["scripts"] and command[1] == "router"


def test_chart_operator_command_exists_in_the_image() -> None:
    (container,) = one(render_chart(), "Deployment")["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["python", "-m", "misat_operator"]
    assert importlib.util.find_spec("misat_operator.__main__") is not None
    installs = " ".join(instructions("RUN"))
    assert "[operator]" in installs, "the operator extra (kopf, kubernetes) must be installed"
    assert any("PATH=/opt/misat/bin" in env for env in instructions("ENV")), "`python` must be the venv's"


def test_image_runs_as_the_rendered_non_root_user() -> None:
    users = re.findall(r"^USER\s+(\S+)", final_stage(), re.MULTILINE)
    assert users == [f"{ROUTER_UID}:{ROUTER_UID}"]
    workdir = re.findall(r"^WORKDIR\s+(\S+)", final_stage(), re.MULTILINE)
    assert workdir and workdir[-1] != "/src", "no source tree in the working directory (operator/ shadows a stdlib module)"


def test_image_name_and_tag_agree_everywhere() -> None:
    version = PYPROJECT["project"]["version"]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    repository, _, tag = ROUTER_IMAGE.rpartition(":")
    assert repository == values["image"]["repository"]
    assert tag == version == chart["appVersion"]
    made = subprocess.run(["make", "-s", "-n", "image", "CONTAINER_BUILDER=docker"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout
    assert f"docker build -t {repository}:{version} ." in made


def test_build_context_leaves_out_what_the_image_does_not_need() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "tests"} <= set(ignored)
    assert "README.md" not in ignored, "pyproject.toml's readme is read by the build"
