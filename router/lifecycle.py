"""What runs beside the handlers, and how it starts and stops.

- ``sessions_ctx`` (a ``cleanup_ctx``) owns the data plane's engine connections
  (``upstream.UpstreamPool``), the control plane's ``ClientSession`` (admin
  fan-out, pass-through) and a small probe session;
- ``background_ctx`` runs the loops: engine resolution (static URLs or a
  headless Service's DNS), health checks, scrapes, the dispatcher's epochs,
  and the config-file watcher when a path was given;
- ``drain`` (``on_shutdown``): held requests get 503, in-flight ones may
  finish within ``drain_timeout_s``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from .engines import resolve_service
from .reload import watch_config_file
from .scrape import EngineProbes, cancel_all, wait_event
from .state import STATE, RouterState
from .upstream import UpstreamPool

log = logging.getLogger(__name__)

PROBE_CONNECTIONS_PER_ENGINE = 2
"""Probe-session connections per engine: one health check and one scrape at a time."""



async def sessions_ctx(app: web.Application) -> AsyncIterator[None]:
    s = app[STATE]
    cfg = s.config
    s.upstream_pool = UpstreamPool(
        keepalive_s=cfg.upstream_keepalive_s, connect_timeout_s=cfg.upstream_connect_timeout_s,
        read_timeout_s=cfg.upstream_timeout_s, max_connections=cfg.upstream_max_connections,
    )
    s.upstream = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=cfg.upstream_keepalive_s),
        auto_decompress=False,
        timeout=aiohttp.ClientTimeout(total=None),
    )
    s.probe_session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit_per_host=PROBE_CONNECTIONS_PER_ENGINE, limit=0),
    )
    yield
    await s.upstream_pool.close()
    await s.upstream.close()
    await s.probe_session.close()
    s.upstream = None
    s.upstream_pool = None


async def resolve_engines_loop(s: RouterState) -> None:
    """Keep the registry in step with the config: static URLs, or DNS of a headless Service."""
    while True:
        s.engines_changed.clear()
        engines = s.config.engines
        if engines.service is not None:
            try:
                s.registry.set_engines(await resolve_service(engines.service))
            except OSError as exc:  # keep the last good set
                log.warning("cannot resolve %s: %s", engines.service.name, exc)
        else:
            s.registry.set_engines(engines.static_urls() or ())
        await wait_event(s.engines_changed, engines.resolve_interval_s)


async def background_ctx(app: web.Application) -> AsyncIterator[None]:
    s = app[STATE]
    assert s.probe_session is not None
    stop = asyncio.Event()
    probes = EngineProbes(s.registry, s.probe_session, lambda: s.config, s.clock, s.on_scraped)
    coros = [
        resolve_engines_loop(s),
        probes.run_health(stop),
        probes.run_scrape(stop),
        s.dispatcher.run(),
    ]
    if s.config_path is not None:
        coros.append(watch_config_file(
            s.config_path, lambda data: s.reload(data, "file"), lambda: s.config.config_poll_interval_s
        ))
    tasks = [asyncio.create_task(c) for c in coros]
    yield
    stop.set()
    await cancel_all(tasks)


async def drain(app: web.Application) -> None:
    s = app[STATE]
    d = s.dispatcher
    s.begin_drain()
    if d.in_flight:
        log.info("draining %d in-flight requests", len(d.in_flight))
        if not await d.wait_idle(s.config.drain_timeout_s):
            log.warning("drain timeout: %d requests still in flight", len(d.in_flight))
