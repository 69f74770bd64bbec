"""Live pools for the client tests: the real router app on loopback in front of either fake
engines (``tests.support.fake_engine``: they record every header they get) or simulated vLLM
engines (``misat_sim.server``: vLLM's request and answer shapes, logprobs, control endpoints).

``Pool`` bundles what a test needs: the router's URL and admin token, its state (for waits on
conditions, never sleeps), the engines.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from misat_router.app import create_app
from misat_router.service import RouterService, start_service
from misat_router.state import STATE, RouterState
from misat_sim.config import SimEngineConfig
from misat_sim.server import RunningServer, start_server
from tests.support.fake_engine import FakeEngine
from tests.support.router_config import router_config

TOKEN = "client-tests-token"
WAIT_S = 5.0
"""Bound of every wait on the router's state; a healthy run takes milliseconds."""
SIM_MODEL = "policy"
SIM_TIME_SCALE = 2000.0
"""Simulated seconds per wall second: a tiny-cpu generation of a few tokens takes milliseconds."""


@dataclass
class Pool:
    server: RouterService
    engine_urls: list[str]
    fakes: list[FakeEngine]
    sims: list[RunningServer]
    model: str

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def state(self) -> RouterState:
        return self.server.app[STATE]

    async def wait(self, predicate: Callable[[], bool]) -> None:
        await self.state.wait_until(predicate, WAIT_S)

    def live_sessions(self, workload_class: str) -> int:
        return self.state.runner.active_sessions().get(workload_class, 0)


async def _start_router(urls: list[str], model: str, **overrides: Any) -> RouterService:
    cfg = router_config(urls, model=model, **overrides)
    server = await start_service(create_app(cfg, admin_token=TOKEN))
    state: RouterState = server.app[STATE]
    await state.wait_until(lambda: state.registry.healthy_count() == len(urls), WAIT_S)
    return server


PoolFactory = Callable[..., Awaitable[Pool]]


@pytest.fixture
async def fake_pool() -> AsyncIterator[PoolFactory]:
    """``await fake_pool(n=1, **router_overrides)``: fake engines behind the router."""
    started: list[Pool] = []

    async def make(n: int = 1, **overrides: Any) -> Pool:
        fakes = [FakeEngine(f"e{i}", wait_s=WAIT_S) for i in range(n)]
        for f in fakes:
            await f.start()
        server = await _start_router([f.url for f in fakes], fakes[0].model, **overrides)
        pool = Pool(server, [f.url for f in fakes], fakes, [], fakes[0].model)
        started.append(pool)
        return pool

    yield make
    for p in started:
        await p.server.stop()
        for f in p.fakes:
            await f.close()


@pytest.fixture
async def sim_pool() -> AsyncIterator[PoolFactory]:
    """``await sim_pool(n=2, time_scale=..., **router_overrides)``: simulated vLLM engines behind the
    router, admitted by MISA (sessions stay on their engine) unless ``policy`` says otherwise."""
    started: list[Pool] = []

    async def make(n: int = 2, time_scale: float = SIM_TIME_SCALE, **overrides: Any) -> Pool:
        sims = [await start_server(SimEngineConfig(profile="tiny-cpu", served_model_name=SIM_MODEL,
                                                   time_scale=time_scale, seed=i, engine_index=i))
                for i in range(n)]
        overrides.setdefault("policy", "misa")
        server = await _start_router([s.base_url for s in sims], SIM_MODEL, **overrides)
        pool = Pool(server, [s.base_url for s in sims], [], sims, SIM_MODEL)
        started.append(pool)
        return pool

    yield make
    for p in started:
        await p.server.stop()
        for s in p.sims:
            await s.stop()
