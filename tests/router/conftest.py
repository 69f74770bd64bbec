"""The router harness of the router tests: fake engines (``tests.support.fake_engine``) behind
the real router app on loopback.

The fake engine answers deterministically, so a routed answer can be compared byte for byte
with a direct one; ``router_config`` is the shared builder with its defaults (round-robin,
three classes, fast probes and epochs).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import aiohttp
import pytest

from misat_router.app import create_app
from misat_router.service import RouterService, start_service
from misat_router.state import STATE, RouterState
from misat_sim.config import SimEngineConfig
from misat_sim.server import RunningServer, start_server
from tests.support.fake_engine import FakeEngine
from tests.support.router_config import MODEL, router_config

WAIT_S = 5.0
"""Bound of every wait in these tests; a healthy run takes milliseconds."""


@pytest.fixture(autouse=True)
def root_logging() -> Iterator[None]:
    """``misat router``'s ``main`` points the root logger at the stderr of the moment (a test's
    captured one, closed after it): put the root logger back, so a later test in the same
    process that logs (``misat up`` in tests/cli) does not write to a closed stream."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


async def open_parked_stream(
    http: aiohttp.ClientSession, router_url: str, **body: Any
) -> tuple[aiohttp.ClientResponse, bytes]:
    """POST a streamed 3-token rlvr completion and read its first event. With the engine's
    ``mid_stream_gate`` set to an unset ``asyncio.Event``, the stream then stays open (in flight
    at the router) until the test sets the gate. Returns the response and that first event."""
    resp = await http.post(router_url + "/v1/completions",
                           json={"model": MODEL, "prompt": [1], "max_tokens": 3, "stream": True, **body},
                           headers={"X-Rollout-Class": "rlvr"})
    return resp, await resp.content.readuntil(b"\n\n")


class RouterHarness:
    """A running router app in front of fake engines."""

    def __init__(self, server: RouterService, engines: list[FakeEngine]) -> None:
        self.server = server
        self.engines = engines

    @property
    def state(self) -> RouterState:
        return self.server.app[STATE]

    @property
    def url(self) -> str:
        return self.server.url

    async def wait(self, predicate: Callable[[], bool]) -> None:
        await self.state.wait_until(predicate, WAIT_S)

    async def wait_healthy(self, n: int) -> None:
        await self.wait(lambda: self.state.registry.healthy_count() == n)


@pytest.fixture
async def engines() -> AsyncIterator[list[FakeEngine]]:
    fakes = [FakeEngine("a", wait_s=WAIT_S), FakeEngine("b", wait_s=WAIT_S)]
    for f in fakes:
        await f.start()
    yield fakes
    for f in fakes:
        await f.close()


async def start_router(
    engines: list[FakeEngine] | list[str], /, *, admin_token: str | None = None, config_path: str | None = None,
    shard_index: int | None = None, **overrides: Any,
) -> RouterHarness:
    """A router in front of fake engines or engine URLs, healthy on all of them; keyword overrides
    replace RouterConfig fields."""
    fakes = [e for e in engines if isinstance(e, FakeEngine)]
    urls = [e.url if isinstance(e, FakeEngine) else e for e in engines]
    cfg = router_config(urls, **overrides)
    app = create_app(cfg, admin_token=admin_token, config_path=config_path, shard_index=shard_index)
    server = await start_service(app)
    h = RouterHarness(server, fakes)
    if urls:
        await h.wait_healthy(len(urls))
    return h


@pytest.fixture
async def make_router() -> AsyncIterator[Callable[..., Any]]:
    started: list[RouterHarness] = []

    async def make(engines: list[FakeEngine] | list[str], /, **kw: Any) -> RouterHarness:
        h = await start_router(engines, **kw)
        started.append(h)
        return h

    yield make
    for h in started:
        await h.server.stop()


@pytest.fixture
async def make_sims() -> AsyncIterator[Callable[..., Any]]:
    """Start ``n`` simulated vLLM engines (tiny-cpu, seeds 0..n-1) at a time scale; stopped after the test."""
    started: list[RunningServer] = []

    async def make(n: int, *, time_scale: float) -> list[RunningServer]:
        out = []
        for i in range(n):
            cfg = SimEngineConfig(profile="tiny-cpu", served_model_name=MODEL, time_scale=time_scale, seed=i,
                                  engine_index=i)
            out.append(await start_server(cfg))
        started.extend(out)
        return out

    yield make
    for s in started:
        await s.stop()
