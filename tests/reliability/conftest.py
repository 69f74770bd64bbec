"""Harness of the reliability tests: simulated engines that can be killed, fakes that misbehave,
the real router app on loopback, and the "everything returned to zero" check.

- ``SimEngine``: a ``misat_sim`` engine served here (``misat_sim.server.create_app``) so that
  it can be killed abruptly (every connection aborted, listener closed: what a crashed pod
  looks like to the router) and restarted on the same port.
- ``misbehaving``: fake engines (``tests.support.fake_engine.FakeEngine``) whose ``/metrics``
  can be slow, empty or garbage, and whose generation, ``/v1/models`` and
  ``/reset_prefix_cache`` can stall.
- ``RouterUnderTest``: ``misat_router.app.create_app`` on a loopback port.
- ``assert_drained``: no request, hold, session or KV charge left anywhere: dispatcher,
  runner, policy books, ``/status`` and the ``/metrics`` gauges.

Every wait is bounded and waits on a condition (``RouterState.wait_until`` or an event).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from misat_router.app import create_app
from misat_router.config import RouterConfig
from misat_router.service import RouterService, start_service
from misat_router.state import STATE, RouterState
from misat_sim.config import SimEngineConfig
from misat_sim.server import create_app as create_sim_app
from tests.support.fake_engine import FakeEngine
from tests.support.router_config import router_config as shared_router_config

MODEL = "sim-tiny"
WAIT_S = 10.0
"""Bound of every wait; a healthy run takes a fraction of it."""


router_config = functools.partial(
    shared_router_config, policy="misa-t", fast=False, model=MODEL, hold_deadline_s=10.0, drain_timeout_s=1.0
)
"""MISA-T in front of ``urls`` with fast epochs; probe settings are the documented defaults."""


# ---- engines --------------------------------------------------------------------------


class SimEngine:
    """A simulated vLLM engine on loopback that can crash and come back on the same port."""

    def __init__(self, config: SimEngineConfig) -> None:
        self.config = config
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        runner = web.AppRunner(
            create_sim_app(self.config), handler_cancellation=True, access_log=None, shutdown_timeout=0.5
        )
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._runner = runner

    async def kill(self) -> None:
        """Crash: abort every open connection (mid-stream included), stop listening."""
        runner, self._runner = self._runner, None
        assert runner is not None and runner.server is not None
        for proto in runner.server.connections:
            if proto.transport is not None:
                proto.transport.abort()
        await runner.cleanup()

    async def stop(self) -> None:
        if self._runner is not None:
            await self.kill()


def sim_config(seed: int, **overrides: Any) -> SimEngineConfig:
    fields: dict[str, Any] = {
        "profile": "tiny-cpu", "served_model_name": MODEL, "seed": seed, "time_scale": 20.0,
    }
    fields.update(overrides)
    return SimEngineConfig.model_validate(fields)


@pytest.fixture
async def sim_engines() -> AsyncIterator[Callable[..., Any]]:
    started: list[SimEngine] = []

    async def make(n: int, **overrides: Any) -> list[SimEngine]:
        out = [SimEngine(sim_config(i, **overrides)) for i in range(n)]
        for e in out:
            await e.start()
        started.extend(out)
        return out

    yield make
    for e in started:
        await e.stop()


def misbehaving_engine(name: str) -> FakeEngine:
    """A fake engine with a steady reported load (3 running, KV 25 % used) and 16,000 KV tokens."""
    return FakeEngine(name, model=MODEL, num_gpu_blocks=1000, running=3, kv_usage=0.25, wait_s=WAIT_S)


@pytest.fixture
async def misbehaving() -> AsyncIterator[Callable[..., Any]]:
    started: list[FakeEngine] = []

    async def make(n: int = 1) -> list[FakeEngine]:
        out = [misbehaving_engine(chr(ord("a") + i)) for i in range(n)]
        for e in out:
            await e.start()
        started.extend(out)
        return out

    yield make
    for e in started:
        await e.close()


# ---- the router -----------------------------------------------------------------------


class RouterUnderTest:
    """The real router app on a loopback port."""

    def __init__(self, server: RouterService) -> None:
        self.server = server

    @property
    def state(self) -> RouterState:
        return self.server.app[STATE]

    @property
    def url(self) -> str:
        return self.server.url

    async def wait(self, predicate: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
        await self.state.wait_until(predicate, timeout_s)

    async def wait_healthy(self, n: int) -> None:
        await self.wait(lambda: self.state.registry.healthy_count() == n)

    async def close(self) -> None:
        await self.server.stop()


async def start_router(
    config: RouterConfig, *, admin_token: str | None = None, config_path: Any = None, healthy: int | None = None,
    port: int = 0,
) -> RouterUnderTest:
    app = create_app(config, admin_token=admin_token, config_path=config_path)
    server = await start_service(app, port=port)
    r = RouterUnderTest(server)
    n = len(config.engines.urls or ()) if healthy is None else healthy
    if n:
        await r.wait_healthy(n)
    return r


@pytest.fixture
async def make_router() -> AsyncIterator[Callable[..., Any]]:
    started: list[RouterUnderTest] = []

    async def make(config: RouterConfig, **kw: Any) -> RouterUnderTest:
        r = await start_router(config, **kw)
        started.append(r)
        return r

    yield make
    for r in started:
        await r.close()


# ---- checks ---------------------------------------------------------------------------


def is_openai_error(body: object) -> bool:
    """``{"error": {"message": str, "type": str, "param": str|None, "code": str|int|None}}``."""
    if not isinstance(body, dict) or set(body) != {"error"}:
        return False
    err = body["error"]
    return (
        isinstance(err, dict)
        and set(err) == {"message", "type", "param", "code"}
        and isinstance(err["message"], str) and bool(err["message"])
        and isinstance(err["type"], str) and bool(err["type"])
        and (err["param"] is None or isinstance(err["param"], str))
        and (err["code"] is None or isinstance(err["code"], str | int))
    )


def gauges(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def policy_books(state: RouterState) -> dict[str, object]:
    """Every per-engine and per-class count the policy keeps (what must return to zero)."""
    p = state.runner.policy
    books: dict[str, object] = {
        "load_total": p.load.total,
        "load": {e: n for e, n in p.load.items() if n},
    }
    for name in ("engine_sessions", "class_sessions", "class_known_tokens", "held_per_class"):
        d = getattr(p, name, None)
        if d is not None:
            books[name] = {k: v for k, v in d.items() if v}
    per = getattr(p, "engine_class_sessions", None)
    if per is not None:
        books["engine_class_sessions"] = {e: {c: n for c, n in cs.items() if n} for e, cs in per.items()
                                          if any(cs.values())}
    for name in ("sessions", "held_ids"):
        v = getattr(p, name, None)
        if v is not None:
            books[name] = len(v)
    return books


ZERO_BOOKS_KEYS = ("load", "engine_sessions", "class_sessions", "class_known_tokens", "held_per_class",
                   "engine_class_sessions")


async def end_all_sessions(r: RouterUnderTest, http: aiohttp.ClientSession) -> None:
    for key in list(r.state.runner.sessions):
        async with http.post(f"{r.url}/v1/sessions/{key}/end") as resp:
            assert resp.status in (200, 404)


async def assert_drained(r: RouterUnderTest, http: aiohttp.ClientSession) -> None:
    """Nothing is held, in flight, live or charged anywhere (call after ending sessions)."""
    s = r.state
    await r.wait(lambda: not s.dispatcher.in_flight and s.runner.held_count() == 0)
    assert s.dispatcher.held_waiters() == 0
    assert s.runner.sessions == {}, s.runner.sessions
    books = policy_books(s)
    assert books["load_total"] == 0, books
    for key in ZERO_BOOKS_KEYS:
        assert books.get(key, {}) == {}, (key, books)
    assert books.get("sessions", 0) == 0 and books.get("held_ids", 0) == 0, books

    async with http.get(r.url + "/status") as resp:
        status = await resp.json()
    assert status["requests_in_flight"] == 0 and status["held_requests"] == 0
    for c in status["classes"]:
        assert (c["active_sessions"], c["held_requests"], c["kv_used_tokens"] or 0) == (0, 0, 0), c
    for e in status["engines"]:
        assert e["in_flight"] == 0, e
    for k in status["kv"]:
        assert (k["sessions"], k["used_tokens"]) == (0, 0), k

    async with http.get(r.url + "/metrics") as resp:
        g = gauges(await resp.text())
    for name in ("misat_requests_in_flight", "misat_held_requests", "misat_active_sessions",
                 "misat_engine_in_flight", "misat_kv_used_tokens"):
        nonzero = [(labels, v) for labels, v in g.get(name, []) if v != 0]
        assert nonzero == [], (name, nonzero)
