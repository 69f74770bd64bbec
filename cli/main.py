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

# name -> (module, function taking argv, help)
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "router": ("misat_router.server", "main", "run the MISA-T router (OpenAI-compatible proxy)"),
    "sim-engine": ("misat_sim.server", "main", "run one simulated vLLM engine"),
    "replay": ("misat_cli.replay", "main", "replay a seeded synthetic trace through a policy"),
    "demo": ("misat_cli.demo", "main", "the main job: a local RolloutPool under a mixed workload"),
    "up": ("misat_cli.up", "main", "run a RolloutPool manifest locally (simulated or given engines)"),
    "bench": ("misat_sim.bench", "main", "side-by-side benchmark against the vLLM Router"),
    "operator": ("misat_operator.main", "main", "run the RolloutPool operator (kopf)"),
}


def _resolve(name: str) -> Callable[[list[str]], int]:
    module_name, func, _ = SUBCOMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or module_name
        if missing.startswith("misat_"):
            raise SystemExit(f"misat {name}: not available in this build ({missing} is missing)") from exc
        raise SystemExit(
            f"misat {name}: the Python package {missing!r} is missing; "
            "install the project with its extras (e.g. pip install -e '.[bench]')"
        ) from exc
    return getattr(module, func)  # type: ignore[no-any-return]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="misat",
        description="MISA-T: mix-aware session admission for RL rollouts on vLLM engines.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, _, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
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
