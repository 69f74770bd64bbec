"""Router shards, the I/O half: ``/health`` checks of the peer shards (``sharding.py`` decides).

``peers_ctx`` (a ``cleanup_ctx`` after the sessions) checks every peer each
``shards.peer_probe_interval_s`` over the probe session and hands each result
to ``RouterState.peer_checked``, which re-homes engines when the live set
changes. The interval is read from the current config on every tick.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from .scrape import wait_event
from .sharding import SHARD_HEADER
from .state import STATE, RouterState


async def check_peer(s: RouterState, session: aiohttp.ClientSession, peer: int, url: str) -> None:
    shards = s.config.shards
    if shards is None:
        return
    ok, error = False, None
    try:
        timeout = aiohttp.ClientTimeout(total=shards.peer_probe_timeout_s)
        async with session.get(f"{url}/health", timeout=timeout) as resp:
            ok = resp.status == 200
            if not ok:
                error = f"/health answered {resp.status}"
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        error = f"/health failed: {type(exc).__name__}: {exc}"
    s.peer_checked(peer, ok, error)


async def probe_peers(s: RouterState, session: aiohttp.ClientSession, stop: asyncio.Event) -> None:
    while not stop.is_set():
        shards = s.config.shards
        if shards is None or s.peers is None:
            return  # a reload never adds or removes `shards` (RouterState.apply_config)
        urls = shards.peer_urls()
        await asyncio.gather(*(check_peer(s, session, i, urls[i]) for i in s.peers.peers() if i < len(urls)))
        await wait_event(stop, shards.peer_probe_interval_s)


async def peers_ctx(app: web.Application) -> AsyncIterator[None]:
    s = app[STATE]
    if s.peers is None:
        yield
        return
    stop = asyncio.Event()
    async with aiohttp.ClientSession() as session:  # its own: peer checks never queue behind engine probes
        task = asyncio.create_task(probe_peers(s, session, stop))
        yield
        stop.set()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def shard_header(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: every answer of a shard names it (``X-Misat-Shard``)."""
    index = request.app[STATE].shard_index
    if index is not None:
        response.headers[SHARD_HEADER] = str(index)
