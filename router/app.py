"""The router app factory: ``create_app(config, admin_token=...)`` wires everything once.

What lives where (docs/architecture.md has the whole map):

- ``state.py``: ``RouterState`` and its transitions, stored under ``STATE``;
- ``dispatcher.py``: admission glue between handlers and the ``PolicyRunner``;
- ``proxy.py``: the OpenAI endpoints; ``admin.py``: the admin API;
  ``ops_endpoints.py``: health, readiness, status, metrics;
- ``lifecycle.py``: upstream sessions, background loops, drain on shutdown;
- ``http_errors.py``: domain errors become HTTP answers only there.
"""

from __future__ import annotations

import time
from pathlib import Path

from aiohttp import web

from . import admin, lifecycle, ops_endpoints, passthrough, shard_peers
from .config import RouterConfig
from .http_errors import error_middleware
from .state import STATE, Clock, RouterState


def create_app(
    config: RouterConfig,
    *,
    admin_token: str | None,
    config_path: str | Path | None = None,
    clock: Clock = time.monotonic,
    shard_index: int | None = None,
) -> web.Application:
    """Build the router app; ``config_path`` (optional) is a file watched for reloads;
    ``shard_index``: this router's index when ``config.shards`` is set (raises ConfigError if unusable)."""
    state = RouterState(
        config,
        admin_token=admin_token,
        config_path=Path(config_path) if config_path is not None else None,
        clock=clock,
        shard_index=shard_index,
    )
    app = web.Application(middlewares=[error_middleware(state.metrics.invalid.inc)])
    app[STATE] = state
    ops_endpoints.add_routes(app)
    passthrough.add_routes(app)
    admin.add_routes(app)
    app.cleanup_ctx.append(lifecycle.sessions_ctx)
    app.cleanup_ctx.append(lifecycle.background_ctx)
    app.cleanup_ctx.append(shard_peers.peers_ctx)
    app.on_response_prepare.append(shard_peers.shard_header)
    app.on_shutdown.append(lifecycle.drain)
    return app
