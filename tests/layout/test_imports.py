"""The package map holds (docs/architecture.md), read from the source's import statements.

Every import counts: module level, inside functions and under ``TYPE_CHECKING``,
since a cycle hidden behind a lazy import is still a knot for the reader.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "misat_router": "router",
    "misat_sim": "sim",
    "misat_operator": "operator",
    "misat_cli": "cli",
    "misat_bench": "bench",
    "misat_client": "client",
}
ALLOWED: dict[str, set[str]] = {
    # package -> the first-party packages it may import (one direction only)
    "misat_router": set(),
    "misat_client": set(),
    "misat_sim": {"misat_router"},
    "misat_operator": {"misat_router"},
    "misat_cli": {"misat_router", "misat_operator", "misat_sim", "misat_client"},
    "misat_bench": {"misat_router", "misat_sim", "misat_cli", "misat_operator", "misat_client"},
}


def module_name(path: Path) -> str:
    folder = path.relative_to(ROOT).parts[0]
    package = next(p for p, f in PACKAGES.items() if f == folder)
    rel = path.relative_to(ROOT / folder).with_suffix("")
    parts = [package, *rel.parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    found = {}
    for folder in PACKAGES.values():
        for path in sorted((ROOT / folder).rglob("*.py")):
            found[module_name(path)] = path
    return found


def imported(name: str, path: Path) -> Iterator[str]:
    """Absolute names of every module ``path`` imports (relative imports resolved)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            yield base
            # ``from . import admin``: the names may be modules themselves.
            yield from (f"{base}.{a.name}" for a in node.names)


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: {m for m in imported(name, path) if m in mods} - {name} for name, path in mods.items()}


def test_the_map_finds_every_package() -> None:
    names = modules()
    for package in ("misat_router", "misat_sim", "misat_operator", "misat_cli", "misat_bench"):
        assert package in names, f"{package} not found (is its folder mapped in PACKAGES?)"


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_packages_import_in_one_direction(package: str) -> None:
    bad = sorted(
        f"{mod} imports {dep}"
        for mod, deps in graph().items() if mod.split(".")[0] == package
        for dep in deps if dep.split(".")[0] not in {package, *ALLOWED[package]}
    )
    assert not bad, "\n".join(bad)


def test_the_simulator_imports_nothing_of_the_benchmark() -> None:
    bad = sorted(f"{m} imports {d}" for m, deps in graph().items() if m.startswith("misat_sim")
                 for d in deps if d.startswith("misat_bench"))
    assert not bad, "\n".join(bad)


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A cycle in ``edges`` as a path that returns to its start, or None."""
    WHITE, GREY, BLACK = 0, 1, 2
    colour = dict.fromkeys(edges, WHITE)
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        colour[node] = GREY
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if colour.get(nxt) == GREY:
                return [*stack[stack.index(nxt):], nxt]
            if colour.get(nxt) == WHITE and (found := visit(nxt)):
                return found
        stack.pop()
        colour[node] = BLACK
        return None

    for node in sorted(edges):
        if colour[node] == WHITE and (found := visit(node)):
            return found
    return None


def test_find_cycle_sees_a_cycle_and_no_false_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_no_import_cycle_inside_a_package(package: str) -> None:
    # A package imports its own __init__ implicitly; edges to it carry no knot.
    edges = {m: {d for d in deps if d.split(".")[0] == package and d != package}
             for m, deps in graph().items() if m.split(".")[0] == package}
    assert find_cycle(edges) is None, " -> ".join(find_cycle(edges) or [])
