"""The router's own endpoints: liveness, readiness, the ``/status`` snapshot, ``/metrics``.

- ``GET /health``: 200 while the process serves (liveness);
- ``GET /ready``: 200 once an engine is healthy and the router is not draining,
  else 503; the body carries the applied generation (the operator waits on it);
- ``GET /status``: ``RouterStatus`` as JSON (``status.py``): this router's view;
  ``?scope=pool`` on a router shard: the whole pool's, combined from every live
  shard's (``shard_status.py``), with ``shards`` saying which answered (a shard's
  view is the default, so the operator and a peer asking stay cheap);
- ``GET /metrics``: Prometheus text (``metrics.py``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp import web
from pydantic import ValidationError

from .errors import InvalidRequest
from .metrics import CONTENT_TYPE
from .shard_status import ShardReading, combine_shards
from .state import STATE, RouterState
from .status import RouterStatus

SCOPES = ("shard", "pool")
"""``GET /status?scope=``: this router's view (the default) or, on a shard, the pool's."""


async def handle_health(request: web.Request) -> web.Response:
    return web.json_response({"status": "alive"})


async def handle_ready(request: web.Request) -> web.Response:
    s = request.app[STATE]
    body = {
        "ready": s.ready,
        "generation": s.config.generation,
        "healthy_engines": s.registry.healthy_count(),
        "draining": s.dispatcher.draining,
    }
    return web.json_response(body, status=200 if s.ready else 503)


async def handle_status(request: web.Request) -> web.Response:
    s = request.app[STATE]
    scope = request.query.get("scope", SCOPES[0])
    if scope not in SCOPES:
        raise InvalidRequest(f"scope must be one of {list(SCOPES)}, got {scope!r}", param="scope")
    if scope == "pool" and s.peers is not None and s.config.shards is not None:
        return web.json_response(await pool_status(s))
    return web.json_response(text=s.status().model_dump_json())


async def _peer_status(s: RouterState, index: int, url: str) -> ShardReading:
    shards = s.config.shards
    assert shards is not None
    timeout = aiohttp.ClientTimeout(total=shards.peer_status_timeout_s)
    try:
        async with s.session().get(f"{url}/status", params={"scope": "shard"}, timeout=timeout) as resp:
            text = await resp.text(errors="replace")
            if resp.status != 200:
                return ShardReading(index, url, None, f"answered {resp.status}: {text[:200]}")
        return ShardReading(index, url, RouterStatus.model_validate_json(text))
    except (aiohttp.ClientError, TimeoutError) as exc:
        return ShardReading(index, url, None, f"unreachable: {type(exc).__name__}: {exc}".rstrip(": "))
    except ValidationError as exc:
        return ShardReading(index, url, None, f"not a router status: {str(exc)[:200]}")


async def pool_status(s: RouterState) -> dict[str, Any]:
    """The pool's ``/status`` from this shard's and every live peer's, read at once; ``shards``:
    per shard index, ``ok``, down (its engines are in the live shards' views), or why it did not
    answer (then the view lacks its engines and sessions, and ``ready`` is false)."""
    assert s.peers is not None and s.config.shards is not None and s.shard_index is not None
    urls = s.config.shards.peer_urls()
    readings = [ShardReading(s.shard_index, urls[s.shard_index], s.status()),
                *await asyncio.gather(*(_peer_status(s, i, urls[i]) for i in s.peers.live_peers()))]
    readings.sort(key=lambda r: r.index)
    combined = combine_shards(readings)
    assert combined is not None  # this shard's own reading is always there
    body = combined.model_dump(mode="json")
    body["shards"] = s.peers.detail(
        {r.index: "ok" if r.status is not None else (r.error or "no answer") for r in readings})
    return body


async def handle_metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def add_routes(app: web.Application) -> None:
    app.router.add_get("/health", handle_health)
    app.router.add_get("/ready", handle_ready)
    app.router.add_get("/status", handle_status)
    app.router.add_get("/metrics", handle_metrics)
