"""Admin endpoints: config reload, pause/resume around a weight update.

- ``PUT /admin/config``: a new RouterConfig (JSON or YAML body), applied
  atomically (``RouterState.reload``; the rules in ``reload.py``); 400 with the reason when invalid, 409 when stale.
- ``GET /admin/config``: the applied config.
- ``POST /admin/pause``: new work is held (``RouterState.pause``); requests in
  flight continue. ``?reset_prefix_cache=true`` also resets every engine's
  prefix cache (default: ``pause_resets_prefix_cache``).
- ``POST /admin/resume``: held work is re-checked at once;
  ``?reset_prefix_cache=true`` resets first (after a weight update, old KV
  must not be reused).

Auth: ``Authorization: Bearer <token>``, compared with ``hmac.compare_digest``;
401 without a valid token, 403 for every admin call when the router runs
without a token. The token is never logged.
"""

from __future__ import annotations

import asyncio
import hmac
import logging

import aiohttp
from aiohttp import web

from .errors import AdminDisabled, InvalidRequest, Unauthorized
from .proxy import read_body
from .state import STATE, RouterState

log = logging.getLogger(__name__)

RESET_PREFIX_CACHE_PATH = "/reset_prefix_cache"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def require_admin(request: web.Request) -> RouterState:
    state = request.app[STATE]
    if state.admin_token is None:
        raise AdminDisabled("admin API disabled: the router runs without an admin token")
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    # surrogateescape: a header with invalid UTF-8 is a wrong token, not a server error.
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        given.strip().encode("utf-8", "surrogateescape"), state.admin_token.encode()
    ):
        raise Unauthorized("missing or invalid bearer token")
    return state


def _query_flag(request: web.Request, name: str, default: bool) -> bool:
    raw = request.query.get(name)
    if raw is None:
        return default
    if raw.lower() in _TRUE | _FALSE:
        return raw.lower() in _TRUE
    raise InvalidRequest(f"{name} must be true or false", param=name)


async def reset_prefix_caches(state: RouterState) -> dict[str, str]:
    """POST /reset_prefix_cache on every healthy engine; returns a result per engine."""
    cfg = state.config
    # A control call, bounded like a scrape: a stalled engine must not hang pause/resume
    # for upstream_timeout_s (an hour by default, sized for long generations).
    timeout = aiohttp.ClientTimeout(
        total=cfg.scrape_timeout_s, connect=cfg.upstream_connect_timeout_s
    )

    async def one(engine: str) -> str:
        try:
            async with state.session().post(engine + RESET_PREFIX_CACHE_PATH, timeout=timeout) as r:
                return "ok" if r.status == 200 else f"status {r.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            return f"failed: {type(exc).__name__}"

    engines = [e for e, snap in state.registry.snapshots().items() if snap.healthy]
    results = await asyncio.gather(*(one(e) for e in engines))
    state.prefix_caches_reset()
    return dict(zip(engines, results, strict=True))


async def handle_put_config(request: web.Request) -> web.Response:
    state = require_admin(request)
    data = await read_body(request, state.config.max_body_bytes)
    result = state.reload(data, "admin")
    return web.json_response(result.as_dict())


async def handle_get_config(request: web.Request) -> web.Response:
    state = require_admin(request)
    body = {"config_hash": state.config_hash, "config": state.config.model_dump(mode="json")}
    return web.json_response(body)


async def _set_paused(request: web.Request, paused: bool, default_reset: bool) -> web.Response:
    state = require_admin(request)
    reset = _query_flag(request, "reset_prefix_cache", default_reset)
    # Pause before the reset (nothing new lands on a cache being cleared); resume after it.
    if paused:
        state.pause()
    reset_results = await reset_prefix_caches(state) if reset else None
    if not paused:
        state.resume()
    log.info("router %s (prefix cache reset: %s)", "paused" if paused else "resumed", reset)
    return web.json_response(
        {
            "paused": state.runner.paused,
            "requests_in_flight": len(state.dispatcher.in_flight),
            "held_requests": state.runner.held_count(),
            "prefix_cache_reset": reset_results,
        }
    )


async def handle_pause(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return await _set_paused(request, True, state.config.pause_resets_prefix_cache)


async def handle_resume(request: web.Request) -> web.Response:
    return await _set_paused(request, False, False)


def add_routes(app: web.Application) -> None:
    app.router.add_put("/admin/config", handle_put_config)
    app.router.add_get("/admin/config", handle_get_config)
    app.router.add_post("/admin/pause", handle_pause)
    app.router.add_post("/admin/resume", handle_resume)
