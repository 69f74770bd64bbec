"""``misat router``: run the router service until SIGINT/SIGTERM.

``main(argv)`` returns an exit code instead of raising, so a bad config or a
taken port is one clear line on stderr and a non-zero exit, never a traceback.
The event loop is uvloop (a dependency wherever it builds; without it, a warning
and the stdlib loop). The config file given with ``--config`` is also watched
for changes (a mounted ConfigMap reloads in place).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

from .app import create_app
from .config import ConfigError, RouterConfig, load_config
from .memory import DEFAULT_MMAP_THRESHOLD_BYTES, pin_mmap_threshold
from .service import RouterService
from .sharding import index_from_hostname
from .state import shard_problem

log = logging.getLogger("misat_router")

DEFAULT_HOST = "0.0.0.0"
DEFAULT_PORT = 8080
EXIT_OK = 0
EXIT_CONFIG = 2
EXIT_RUNTIME = 1
LISTEN_BACKLOG = 2048
"""Pending connections the listening socket queues (uvicorn's default, so vLLM's API server's
too; the kernel caps it at ``net.core.somaxconn``). aiohttp's own 128 overflowed when 1,000
rollout workers connected at once in the soak: dropped SYNs, resets, seconds-long connects."""


class JsonFormatter(logging.Formatter):
    """One JSON object a line, for log collectors."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def _setup_logging(as_json: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter() if as_json else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


EVENT_LOOPS = ("uvloop", "asyncio")
"""``--event-loop`` choices; uvloop is the default (less CPU per request, and no heap growth)."""


def event_loop_factory(loop: str = "uvloop") -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop factory for ``asyncio.Runner``; None (the stdlib loop) when ``loop`` is
    ``asyncio``, or with a warning where uvloop is not installed (a dependency wherever it builds)."""
    if loop == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        log.warning("uvloop is not installed: running on the standard asyncio loop, whose "
                    "RSS grows under many connections (docs/reliability.md)")
        return None
    return uvloop.new_event_loop


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="misat router", description="Run the MISA-T router.")
    p.add_argument("--config", required=True, type=Path, help="RouterConfig YAML/JSON file (watched).")
    p.add_argument("--host", default=DEFAULT_HOST, help=f"Listen address (default {DEFAULT_HOST}).")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"Listen port (default {DEFAULT_PORT}).")
    p.add_argument(
        "--admin-token-file", type=Path, default=None,
        help="File holding the admin bearer token; without it the admin API answers 403.",
    )
    p.add_argument(
        "--backlog", type=int, default=LISTEN_BACKLOG,
        help=f"Listen queue length (default {LISTEN_BACKLOG}; capped by net.core.somaxconn).",
    )
    p.add_argument(
        "--malloc-mmap-threshold", type=int, default=DEFAULT_MMAP_THRESHOLD_BYTES, metavar="BYTES",
        help="Pin glibc's mmap threshold so large transient blocks never fragment the heap "
        f"(default {DEFAULT_MMAP_THRESHOLD_BYTES}; 0: glibc's drifting default; see docs/reliability.md).",
    )
    p.add_argument(
        "--shard-index", type=int, default=None,
        help="This router's index among config shards.peers (default: the ordinal ending the "
        "hostname, as a StatefulSet pod 'pool-router-2' has). Ignored without shards.",
    )
    p.add_argument(
        "--event-loop", choices=EVENT_LOOPS, default=EVENT_LOOPS[0],
        help="uvloop (default) or the standard library's asyncio loop.",
    )
    p.add_argument("--log-json", action="store_true", help="Log one JSON object per line.")
    return p


def read_token(path: Path) -> str:
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read admin token file {str(path)!r}: {exc.strerror}") from None
    if not token:
        raise ConfigError(f"admin token file {str(path)!r} is empty")
    return token


async def serve(
    config: RouterConfig, *, host: str, port: int, admin_token: str | None, config_path: Path,
    backlog: int = LISTEN_BACKLOG, shard_index: int | None = None,
) -> None:
    """Serve until a stop signal; raises ``OSError`` when the port cannot be bound."""
    app = create_app(config, admin_token=admin_token, config_path=config_path, shard_index=shard_index)
    service = RouterService(app)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await service.start(host, port, backlog=backlog)
    try:
        log.info("router listening on %s:%d (generation %d)", host, service.port, config.generation)
        await stop.wait()
        log.info("stopping: draining in-flight requests")
    finally:
        await service.stop()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.log_json)
    pin_mmap_threshold(args.malloc_mmap_threshold)
    try:
        config = load_config(args.config)
        token = read_token(args.admin_token_file) if args.admin_token_file else None
        shard_index = args.shard_index
        if shard_index is None and config.shards is not None:
            shard_index = index_from_hostname(socket.gethostname())
        problem = shard_problem(config, shard_index)
        if problem:
            raise ConfigError(problem)
    except ConfigError as exc:
        print(f"misat router: invalid config: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        with asyncio.Runner(loop_factory=event_loop_factory(args.event_loop)) as r:
            r.run(
                serve(config, host=args.host, port=args.port, admin_token=token,
                      config_path=args.config, backlog=args.backlog, shard_index=shard_index)
            )
    except OSError as exc:
        print(f"misat router: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}",
              file=sys.stderr)
        return EXIT_RUNTIME
    except KeyboardInterrupt:
        pass
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
