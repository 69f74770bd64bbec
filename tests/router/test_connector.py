"""The upstream pool hands out the most recently released connection first."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from misat_router.connector import RecentFirstConnector


@pytest.fixture
async def gated_server() -> AsyncIterator[tuple[str, dict[str, asyncio.Event]]]:
    """A server whose ``/hold/{name}`` answers, once the test sets ``gates[name]``, with the
    client's port: which pooled connection carried the request."""
    gates: dict[str, asyncio.Event] = {}

    async def hold(request: web.Request) -> web.Response:
        await gates.setdefault(request.match_info["name"], asyncio.Event()).wait()
        assert request.transport is not None
        return web.Response(text=str(request.transport.get_extra_info("peername")[1]))

    app = web.Application()
    app.router.add_get("/hold/{name}", hold)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}", gates
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(("connector_class", "reused"), [(RecentFirstConnector, "c"), (aiohttp.TCPConnector, "a")])
async def test_the_newest_idle_connection_is_reused_first(
    gated_server: tuple[str, dict[str, asyncio.Event]], connector_class: type[aiohttp.TCPConnector], reused: str
) -> None:
    # The stock connector is run too: the day aiohttp changes its order, this says so.
    url, gates = gated_server
    names = ("a", "b", "c")
    for name in names:
        gates[name] = asyncio.Event()
    async with aiohttp.ClientSession(connector=connector_class(keepalive_timeout=60)) as http:
        pending = [asyncio.create_task(http.get(f"{url}/hold/{name}")) for name in names]
        ports: dict[str, int] = {}
        # Three connections open at once; released in the order a, b, c.
        for name, task in zip(names, pending, strict=True):
            gates[name].set()
            async with await task as resp:  # read to the end: the connection goes back to the pool
                ports[name] = int(await resp.text())
        assert len(set(ports.values())) == 3
        gates["d"] = asyncio.Event()
        gates["d"].set()
        async with http.get(f"{url}/hold/d") as resp:
            assert int(await resp.text()) == ports[reused]
