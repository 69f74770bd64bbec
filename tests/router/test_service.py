"""The two halves on one port (``misat_router.service``): what the data plane answers itself,
what it relays to the control app, and that both look the same to a client."""

from __future__ import annotations

import asyncio

import aiohttp

from misat_router.sharding import SHARD_HEADER
from tests.router.conftest import WAIT_S, RouterHarness
from tests.support.fake_engine import FakeEngine
from tests.support.router_config import MODEL


async def post(http: aiohttp.ClientSession, url: str, prompt: list[int]) -> tuple[int, bytes, dict[str, str]]:
    async with http.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1},
                         headers={"X-Rollout-Class": "rlvr"}) as r:
        return r.status, await r.read(), dict(r.headers)


async def test_other_methods_on_generation_paths_are_405_with_allow(engines: list[FakeEngine], make_router) -> None:
    h: RouterHarness = await make_router(engines)
    async with aiohttp.ClientSession() as http:
        for path in ("/v1/completions", "/v1/chat/completions"):
            async with http.get(h.url + path) as resp:
                assert resp.status == 405 and resp.headers["Allow"] == "POST"
                assert (await resp.json())["error"]["code"] == "method_not_allowed"
    assert all(e.generations == 0 for e in engines)


async def test_control_paths_are_relayed_with_their_status_headers_and_bodies(
    engines: list[FakeEngine], make_router
) -> None:
    h: RouterHarness = await make_router(engines, admin_token="t")
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as http:
        async with http.get(h.url + "/status") as resp:
            assert resp.status == 200 and (await resp.json())["healthy_engines"] == 2
        async with http.get(h.url + "/metrics") as resp:
            assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
            assert "misat_config_generation" in await resp.text()
        async with http.head(h.url + "/health") as resp:
            assert resp.status == 200 and await resp.read() == b""
        async with http.get(h.url + "/no/such/path") as resp:
            assert resp.status == 404 and (await resp.json())["error"]["type"] == "not_found_error"
        async with http.post(h.url + "/admin/pause") as resp:  # the control app's own refusal, relayed
            assert resp.status == 401 and resp.headers["WWW-Authenticate"] == "Bearer"
        # One keep-alive connection for every call above and a generation after them.
        status, _, headers = await post(http, h.url, [1, 2])
        assert status == 200 and headers["X-Misat-Engine"] in {e.url for e in engines}
        assert h.server.server is not None and len(h.server.server.connections) == 1


async def test_a_shard_names_itself_on_both_halves(engines: list[FakeEngine], make_router) -> None:
    h: RouterHarness = await make_router(engines[:1], shards={"peers": ["http://127.0.0.1:1", "http://127.0.0.1:2"]},
                                         shard_index=0)
    async with aiohttp.ClientSession() as http:
        async with http.get(h.url + "/health") as resp:
            assert resp.headers[SHARD_HEADER] == "0"
        async with http.post(h.url + "/v1/completions", json={"model": MODEL, "prompt": [1], "max_tokens": 1},
                             headers={"X-Rollout-Class": "rlvr"}) as resp:
            assert resp.status == 200 and resp.headers[SHARD_HEADER] == "0"


async def test_stop_drains_then_refuses_new_connections(engines: list[FakeEngine], make_router) -> None:
    eng = engines[0]
    eng.gate = asyncio.Event()
    h: RouterHarness = await make_router([eng], drain_timeout_s=WAIT_S)
    async with aiohttp.ClientSession() as http:
        first = asyncio.create_task(post(http, h.url, [1]))
        await eng.wait_arrivals(1)
        stopping = asyncio.create_task(h.server.stop())
        await h.wait(lambda: h.state.dispatcher.draining)
        eng.gate.set()
        assert (await first)[0] == 200  # in flight when the drain began: it finished
        await stopping
    async with aiohttp.ClientSession() as http:
        try:
            async with http.get(h.url + "/health") as resp:
                raise AssertionError(f"answered {resp.status} after stop")
        except aiohttp.ClientConnectionError:
            pass
