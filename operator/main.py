"""``python -m misat_operator`` / ``misat operator``: run the RolloutPool operator until stopped.

Standalone kopf (no peering CRD): run one replica (the chart uses the
Recreate strategy), cluster-wide or in the given namespaces. Settings come
from ``MISAT_OPERATOR_*`` environment variables (``settings.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

import kopf

from .handlers import register
from .settings import SettingsError, from_env

EXIT_CONFIG = 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="misat operator", description="Run the RolloutPool operator.")
    p.add_argument(
        "-n", "--namespace", action="append", default=[],
        help="Watch only this namespace (repeatable); default: all namespaces.",
    )
    p.add_argument("--verbose", action="store_true", help="Debug logging.")
    return p


async def run(namespaces: Sequence[str]) -> None:
    settings = from_env()
    registry = kopf.OperatorRegistry()
    register(registry, settings)
    await kopf.operator(
        registry=registry,
        standalone=True,
        clusterwide=not namespaces,
        namespaces=list(namespaces),
        liveness_endpoint=settings.liveness_endpoint,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        asyncio.run(run(args.namespace))
    except SettingsError as exc:
        print(f"misat operator: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        pass
    return 0
