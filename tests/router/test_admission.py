"""HOLD, release, deadlines, disconnects and engine failures through the live service."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from tests.support.fake_engine import FakeEngine
from tests.support.router_config import MODEL

from .conftest import WAIT_S, open_parked_stream

LIMIT_ONE = {"concurrency_limit": 1}


async def post(http: aiohttp.ClientSession, url: str, prompt: list[int], cls: str = "rlvr",
               **body: object) -> tuple[int, bytes, dict[str, str]]:
    async with http.post(url + "/v1/completions",
                         json={"model": MODEL, "prompt": prompt, "max_tokens": 1, **body},
                         headers={"X-Rollout-Class": cls}) as r:
        return r.status, await r.read(), dict(r.headers)


async def test_held_requests_are_released_in_arrival_order(
    engines: list[FakeEngine], make_router
) -> None:
    eng = engines[0]
    eng.gate = asyncio.Event()
    h = await make_router([eng], policy_settings=LIMIT_ONE)
    async with aiohttp.ClientSession() as http:
        first = asyncio.create_task(post(http, h.url, [0]))
        await eng.wait_arrivals(1)
        held = []
        for i in range(1, 4):
            held.append(asyncio.create_task(post(http, h.url, [i])))
            await h.wait(lambda i=i: h.state.runner.held_count() == i)
        assert [e.reason.value for e in h.state.runner.held()] == [
            "concurrency_limit", "queued_behind", "queued_behind"]
        async with http.get(h.url + "/status") as r:
            status = await r.json()
        # /status says why work is held and for how long the oldest has waited.
        assert status["held_by_reason"] == {"concurrency_limit": 1, "queued_behind": 2}
        assert status["oldest_hold_s"] is not None and status["oldest_hold_s"] >= 0
        assert len(eng.requests) == 1  # nothing held reached the engine
        eng.gate.set()
        results = await asyncio.gather(first, *held)
    assert [status for status, _, _ in results] == [200] * 4
    assert [r["prompt"] for r in eng.requests] == [[0], [1], [2], [3]]
    assert h.state.runner.held_count() == 0
    metrics = h.state.metrics.render().decode()
    assert 'misat_requests_held_total{class="rlvr",reason="concurrency_limit"} 1.0' in metrics
    assert 'misat_hold_wait_seconds_count{class="rlvr",outcome="placed"} 3.0' in metrics


async def test_hold_deadline_gives_503_with_retry_after(
    engines: list[FakeEngine], make_router
) -> None:
    eng = engines[0]
    eng.gate = asyncio.Event()
    h = await make_router([eng], policy_settings=LIMIT_ONE, hold_deadline_s=0.2, hold_retry_after_s=7)
    async with aiohttp.ClientSession() as http:
        first = asyncio.create_task(post(http, h.url, [0]))
        await eng.wait_arrivals(1)
        status, body, headers = await post(http, h.url, [1])
        assert status == 503
        assert headers["Retry-After"] == "7"
        import json

        err = json.loads(body)["error"]
        assert err["code"] == "hold_deadline_exceeded" and err["message"]
        assert h.state.runner.held_count() == 0
        eng.gate.set()
        assert (await first)[0] == 200
    assert [r["prompt"] for r in eng.requests] == [[0]]
    metrics = h.state.metrics.render().decode()
    assert 'misat_requests_total{class="rlvr",outcome="hold_deadline"} 1.0' in metrics


async def test_client_disconnect_while_held_frees_the_slot(
    engines: list[FakeEngine], make_router
) -> None:
    eng = engines[0]
    eng.gate = asyncio.Event()
    h = await make_router([eng], policy_settings=LIMIT_ONE)
    async with aiohttp.ClientSession() as http:
        first = asyncio.create_task(post(http, h.url, [0]))
        await eng.wait_arrivals(1)
        async with aiohttp.ClientSession() as impatient:
            gone = asyncio.create_task(post(impatient, h.url, [1]))
            await h.wait(lambda: h.state.runner.held_count() == 1)
            gone.cancel()
        await h.wait(lambda: h.state.runner.held_count() == 0)
        # The class queue is free again: the next request is not stuck behind a ghost.
        nxt = asyncio.create_task(post(http, h.url, [2]))
        await h.wait(lambda: h.state.runner.held_count() == 1)
        assert h.state.runner.held()[0].reason.value == "concurrency_limit"
        eng.gate.set()
        assert (await first)[0] == 200 and (await nxt)[0] == 200
    assert [r["prompt"] for r in eng.requests] == [[0], [2]]
    metrics = h.state.metrics.render().decode()
    assert 'misat_requests_total{class="rlvr",outcome="client_disconnect"} 1.0' in metrics


async def test_client_disconnect_mid_stream_releases_the_placement(
    engines: list[FakeEngine], make_router
) -> None:
    eng = engines[0]
    eng.mid_stream_gate = asyncio.Event()
    h = await make_router([eng], policy_settings=LIMIT_ONE)
    async with aiohttp.ClientSession() as http:
        resp, first = await open_parked_stream(http, h.url)
        assert first.startswith(b"data: ")
        assert len(h.state.dispatcher.in_flight) == 1
        resp.close()  # the client goes away mid-stream
        await h.wait(lambda: not h.state.dispatcher.in_flight)
        await eng.wait_cancelled(1)  # the router closed its upstream: the engine aborts
        # The one slot is free for the next request.
        assert (await post(http, h.url, [2]))[0] == 200
    eng.mid_stream_gate.set()


async def test_engine_death_is_retried_elsewhere_and_leaves_rotation(
    engines: list[FakeEngine], make_router
) -> None:
    a, b = engines
    # Slow health checks: only the proxy path can notice the death here.
    h = await make_router(engines, health_interval_s=30.0)
    await a.die()
    async with aiohttp.ClientSession() as http:
        results = [await post(http, h.url, [i]) for i in range(3)]
    assert [status for status, _, _ in results] == [200] * 3
    assert {hdrs["X-Misat-Engine"] for _, _, hdrs in results} == {b.url}
    assert len(b.requests) == 3
    assert h.state.registry.get(a.url).healthy is False  # type: ignore[union-attr]
    assert h.state.dispatcher.in_flight == {}
    metrics = h.state.metrics.render().decode()
    assert f'misat_engine_connection_failures_total{{engine="{a.url}"}} 1.0' in metrics
    assert 'misat_requests_total{class="rlvr",outcome="retried"} 1.0' in metrics


async def test_a_connect_timeout_is_retried_elsewhere_and_counts_as_a_failed_check(
    engines: list[FakeEngine], make_router
) -> None:
    a, b = engines
    # Slow health checks: only the proxy path counts here.
    h = await make_router(engines, health_interval_s=30.0, unhealthy_after_failures=2,
                          upstream_connect_timeout_s=0.1)
    pool = h.state.engine_pool()
    connect = pool._connector

    async def a_never_accepts(origin, factory):  # type: ignore[no-untyped-def]
        if origin.key == a.url:
            await asyncio.Event().wait()  # SYNs dropped: the connect times out
        return await connect(origin, factory)

    pool._connector = a_never_accepts
    registry = h.state.registry

    def a_failures() -> int:
        return registry.get(a.url).consecutive_failures  # type: ignore[union-attr]

    results = []
    async with aiohttp.ClientSession() as http:
        # Round-robin: within two requests one is placed on a first.
        for i in range(2):
            if a_failures() < 1:
                results.append(await post(http, h.url, [i]))
        assert a_failures() == 1
        assert registry.get(a.url).healthy  # type: ignore[union-attr]  # slow is not gone
        assert "timed out" in (registry.get(a.url).last_error or "")  # type: ignore[union-attr]
        for i in range(2, 4):
            if a_failures() < 2:
                results.append(await post(http, h.url, [i]))
    assert a_failures() == 2
    assert registry.get(a.url).healthy is False  # type: ignore[union-attr]  # the second in a row
    assert [status for status, _, _ in results] == [200] * len(results)
    assert {hdrs["X-Misat-Engine"] for _, _, hdrs in results} == {b.url}
    assert a.requests == [] and h.state.dispatcher.in_flight == {}
    metrics = h.state.metrics.render().decode()
    assert f'misat_engine_connection_failures_total{{engine="{a.url}"}} 2.0' in metrics
    assert 'misat_requests_total{class="rlvr",outcome="retried"} 2.0' in metrics


async def test_failing_health_leaves_rotation_within_two_seconds_and_returns(
    engines: list[FakeEngine], make_router
) -> None:
    a, b = engines
    # Production defaults for health checking.
    h = await make_router(engines, health_interval_s=0.5, health_timeout_s=0.4,
                          unhealthy_after_failures=2)
    a.healthy = False
    t0 = time.monotonic()
    await h.wait(lambda: not h.state.registry.get(a.url).healthy)  # type: ignore[union-attr]
    assert time.monotonic() - t0 < 2.0
    async with aiohttp.ClientSession() as http:
        for i in range(2):
            assert (await post(http, h.url, [i]))[2]["X-Misat-Engine"] == b.url
        a.healthy = True
        await h.wait(lambda: h.state.registry.get(a.url).healthy)  # type: ignore[union-attr]
        served = {(await post(http, h.url, [i]))[2]["X-Misat-Engine"] for i in range(2)}
    assert served == {a.url, b.url}


async def test_engine_breaking_mid_stream_ends_stream_with_error_event(
    engines: list[FakeEngine], make_router
) -> None:
    eng = engines[0]
    eng.break_stream_after = 1
    h = await make_router([eng])
    async with aiohttp.ClientSession() as http, http.post(h.url + "/v1/completions",
                         json={"model": MODEL, "prompt": [1], "max_tokens": 3, "stream": True},
                         headers={"X-Rollout-Class": "rlvr"}) as r:
        assert r.status == 200
        body = await asyncio.wait_for(r.read(), WAIT_S)
    events = [e for e in body.split(b"\n\n") if e.strip()]
    assert events[0].startswith(b'data: {"id"')
    assert b'"type": "upstream_error"' in events[-2]
    assert events[-1] == b"data: [DONE]"
    assert h.state.dispatcher.in_flight == {}
    metrics = h.state.metrics.render().decode()
    assert 'misat_requests_total{class="rlvr",outcome="upstream_failed"} 1.0' in metrics


async def test_no_healthy_engine_holds_until_one_appears(
    engines: list[FakeEngine], make_router
) -> None:
    eng = engines[0]
    h = await make_router([eng])
    eng.healthy = False
    await h.wait(lambda: h.state.registry.healthy_count() == 0)
    async with aiohttp.ClientSession() as http:
        async with http.get(h.url + "/ready") as r:
            assert r.status == 503
        task = asyncio.create_task(post(http, h.url, [1]))
        await h.wait(lambda: h.state.runner.held_count() == 1)
        assert h.state.runner.held()[0].reason.value == "no_healthy_engine"
        eng.healthy = True
        assert (await task)[0] == 200


async def test_shutdown_drains_in_flight_and_refuses_held(
    engines: list[FakeEngine], make_router
) -> None:
    eng = engines[0]
    eng.gate = asyncio.Event()
    h = await make_router([eng], policy_settings=LIMIT_ONE, drain_timeout_s=WAIT_S)
    async with aiohttp.ClientSession() as http:
        first = asyncio.create_task(post(http, h.url, [0]))
        await eng.wait_arrivals(1)
        second = asyncio.create_task(post(http, h.url, [1]))
        await h.wait(lambda: h.state.runner.held_count() == 1)
        closing = asyncio.create_task(h.server.stop())
        await h.wait(lambda: h.state.dispatcher.draining)
        status, body, _ = await second
        assert status == 503 and b"shutting down" in body
        assert h.state.runner.held_count() == 0
        eng.gate.set()  # the in-flight request may finish during the drain
        assert (await first)[0] == 200
        await closing


async def test_engines_from_service_dns(engines: list[FakeEngine], make_router) -> None:
    eng = engines[0]
    port = int(eng.url.rsplit(":", 1)[1])
    h = await make_router(
        [], engines={"service": {"name": "127.0.0.1", "port": port}, "resolve_interval_s": 0.05})
    await h.wait(lambda: h.state.registry.healthy_count() == 1)
    async with aiohttp.ClientSession() as http:
        assert (await post(http, h.url, [1]))[2]["X-Misat-Engine"] == f"http://127.0.0.1:{port}"


async def test_no_healthy_engine_fails_fast_with_each_engines_reason(
    engines: list[FakeEngine], make_router
) -> None:
    import json

    h = await make_router(engines, hold_deadline_s=60.0, no_healthy_engine_wait_s=0.2, hold_retry_after_s=3)
    for e in engines:
        e.healthy = False
    await h.wait(lambda: h.state.registry.healthy_count() == 0)
    async with aiohttp.ClientSession() as http:
        t0 = time.monotonic()
        status, body, headers = await post(http, h.url, [1])
        waited = time.monotonic() - t0
    assert status == 503 and headers["Retry-After"] == "3"
    err = json.loads(body)["error"]
    assert err["code"] == "no_healthy_engine" and err["type"] == "service_unavailable_error"
    assert all(e.url in err["message"] for e in engines)
    # Failed after the short wait, not the 60 s hold deadline.
    assert waited < 30.0
    assert h.state.runner.held_count() == 0 and not h.state.dispatcher.in_flight
    assert not any(e.requests for e in engines)
    # Counted apart from the hold deadline: engines down, not too little capacity.
    metrics = h.state.metrics.render().decode()
    assert 'misat_requests_total{class="rlvr",outcome="no_healthy_engine"} 1.0' in metrics
    assert 'outcome="hold_deadline"' not in metrics


async def test_an_engine_back_within_the_wait_serves_the_request(
    engines: list[FakeEngine], make_router
) -> None:
    eng = engines[0]
    h = await make_router([eng], no_healthy_engine_wait_s=30.0)
    eng.healthy = False
    await h.wait(lambda: h.state.registry.healthy_count() == 0)
    async with aiohttp.ClientSession() as http:
        req = asyncio.create_task(post(http, h.url, [4]))
        await h.wait(lambda: h.state.runner.held_count() == 1)
        eng.healthy = True
        status, _, _ = await req
    assert status == 200 and [r["prompt"] for r in eng.requests] == [[4]]


async def test_the_prefix_index_takes_a_prompt_while_its_request_is_at_the_engine(
    engines: list[FakeEngine], make_router
) -> None:
    # The insert a placement puts off runs once the request is sent: before the engine has
    # it, with nothing having read the index in between.
    eng = engines[0]
    eng.gate = asyncio.Event()
    h = await make_router([eng], policy=None)  # the default: session admission over the prefix index
    index = h.state.runner.policy.index
    async with aiohttp.ClientSession() as http:
        task = asyncio.create_task(post(http, h.url, list(range(64))))
        await eng.wait_arrivals(1)
        assert index._pending == []
        assert sum(index.sizes().values()) == 64 // h.state.config.policy.prefix.block_size
        eng.gate.set()
        status, _, _ = await task
    assert status == 200
