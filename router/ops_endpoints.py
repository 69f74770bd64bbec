"""The router's own endpoints: liveness, readiness, the ``/status`` snapshot, ``/metrics``.

- ``GET /health``: 200 while the process serves (liveness);
- ``GET /ready``: 200 once an engine is healthy and the router is not draining,
  else 503; the body carries the applied generation (the operator waits on it);
- ``GET /status``: ``RouterStatus`` as JSON (``status.py``);
- ``GET /metrics``: Prometheus text (``metrics.py``).
"""

from __future__ import annotations

from aiohttp import web

from .metrics import CONTENT_TYPE
from .state import STATE


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
    return web.json_response(text=request.app[STATE].status().model_dump_json())


async def handle_metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def add_routes(app: web.Application) -> None:
    app.router.add_get("/health", handle_health)
    app.router.add_get("/ready", handle_ready)
    app.router.add_get("/status", handle_status)
    app.router.add_get("/metrics", handle_metrics)
