"""``misat``: one command for every part of the project.

Subcommands import their implementation lazily, so ``misat router`` never
imports the simulator and a missing optional extra only matters to the
subcommand that needs it.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast


@dataclass(frozen=True, slots=True)
class Subcommand:
    module: str
    func: str
    help: str
    extra: str | None
    """The distribution extra that brings its dependencies (None: the core install)."""


SUBCOMMANDS: dict[str, Subcommand] = {
    "router": Subcommand("misat_router.server", "main", "run the MISA-T router (OpenAI-compatible proxy)", None),
    "sim-engine": Subcommand("misat_sim.server", "main", "run one simulated vLLM engine", None),
    "replay": Subcommand("misat_cli.replay", "main", "replay a seeded synthetic trace through a policy", "cli"),
    "demo": Subcommand(
        "misat_bench.demo", "main", "the main job: this router against the vLLM Router, side by side", "cli"
    ),
    "up": Subcommand(
        "misat_cli.up", "main", "run a RolloutPool manifest locally (simulated or given engines)", "cli"
    ),
    "render": Subcommand(
        "misat_cli.render", "main", "the Kubernetes objects the operator makes of a RolloutPool, offline", None
    ),
    "status": Subcommand("misat_cli.status", "main", "a running router's /status, as tables", "cli"),
    "bench": Subcommand("misat_bench.main", "main", "side-by-side benchmark against the vLLM Router", "bench"),
    "operator": Subcommand("misat_operator.main", "main", "run the RolloutPool operator (kopf)", "operator"),
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("misa-t")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _resolve(name: str) -> Callable[[list[str]], int]:
    cmd = SUBCOMMANDS[name]
    try:
        module = importlib.import_module(cmd.module)
    except ModuleNotFoundError as exc:
        missing = exc.name or cmd.module
        if missing.startswith("misat_"):
            raise SystemExit(f"misat {name}: not available in this build ({missing} is missing)") from exc
        install = f"pip install 'misa-t[{cmd.extra}]'" if cmd.extra else "pip install misa-t"
        raise SystemExit(
            f"misat {name}: the Python package {missing!r} is missing; install it with {install}"
        ) from exc
    return cast(Callable[[list[str]], int], getattr(module, cmd.func))


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="misat",
        description="MISA-T: mix-aware session admission for RL rollouts on vLLM engines.",
    )
    parser.add_argument("--version", action="version", version=f"misat {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, cmd in SUBCOMMANDS.items():
        sub.add_parser(name, help=cmd.help, add_help=False)
    if args[:1] == ["--version"]:
        parser.parse_args(args[:1])  # prints the version and exits
    if not args or args[0] in ("-h", "--help") or args[0] not in SUBCOMMANDS:
        if args and args[0] not in ("-h", "--help"):
            parser.print_usage(sys.stderr)
            print(f"misat: unknown command {args[0]!r}", file=sys.stderr)
            return 2
        parser.print_help()
        return 0
    return int(_resolve(args[0])(args[1:]) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
