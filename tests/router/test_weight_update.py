"""The weight-update admin API: pause wait vs abort (vLLM's abort answers, counters drain),
resume with prefix-cache reset and a weight version, engine fan-out, the control pass-through,
and each refusal in the OpenAI error shape."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from misat_router.state import RouterState
from misat_sim.server import STATE as SIM_STATE
from misat_sim.server import RunningServer
from tests.support.fake_engine import FakeEngine
from tests.support.router_config import MODEL

from .conftest import WAIT_S, open_parked_stream

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
RLVR = {"X-Rollout-Class": "rlvr"}
LONG = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 1500, "ignore_eos": True}
"""Runs for seconds on a real-time simulated engine: in flight while the test pauses."""
MEDIUM = {**LONG, "max_tokens": 600}
"""In flight while a test pauses too, and short enough to be awaited whole after the resume."""


@pytest.fixture
async def sims(make_sims) -> list[RunningServer]:  # type: ignore[no-untyped-def]
    return list(await make_sims(2, time_scale=1.0))


@pytest.fixture
def make(make_router):  # type: ignore[no-untyped-def]
    """A router with the admin token in front of engine URLs, healthy on all of them."""
    return lambda urls: make_router(urls, admin_token=TOKEN)


async def _generating(sim: RunningServer) -> None:
    """Wait (bounded) until the engine has emitted tokens for every live request."""
    st = sim.app[SIM_STATE]

    async def ready() -> None:
        while True:
            reqs = [st.engine.get_request(c) for c in list(st.live)]
            if reqs and all(r is not None and r.num_output_tokens > 0 for r in reqs):
                return
            await asyncio.sleep(0.01)

    await asyncio.wait_for(ready(), WAIT_S)


def _drained(state: RouterState) -> bool:
    return (not state.dispatcher.in_flight and state.runner.held_count() == 0
            and not state.runner.sessions and state.runner.policy.load.total == 0)


@dataclass
class Parked:
    """A router in front of one fake engine (no ``/pause``), with one stream in flight that the
    engine holds after its first chunk until ``release``."""

    router: Any
    engine: FakeEngine
    http: aiohttp.ClientSession
    stream: aiohttp.ClientResponse

    async def release(self) -> str:
        """Let the engine finish the stream; its whole body."""
        assert self.engine.mid_stream_gate is not None
        self.engine.mid_stream_gate.set()
        raw = (await asyncio.wait_for(self.stream.read(), WAIT_S)).decode()
        self.stream.release()
        return raw


@asynccontextmanager
async def parked_stream(make: Callable[[list[str]], Awaitable[Any]]) -> AsyncIterator[Parked]:
    fake = FakeEngine("a", wait_s=WAIT_S)
    await fake.start()
    try:
        r = await make([fake.url])
        fake.mid_stream_gate = asyncio.Event()
        async with aiohttp.ClientSession() as http:
            stream, _first = await open_parked_stream(http, r.url)
            await r.wait(lambda: len(r.state.dispatcher.in_flight) == 1)
            yield Parked(r, fake, http, stream)
    finally:
        if fake.mid_stream_gate is not None:
            fake.mid_stream_gate.set()  # the engine's parked handler ends, so it can close
        await fake.close()


async def test_pause_abort_returns_partial_output_then_resume_records_the_version(sims, make) -> None:
    r = await make([sims[0].base_url])
    async with aiohttp.ClientSession() as http:
        gen = asyncio.create_task(http.post(r.url + "/v1/completions", headers=RLVR,
                                            json={**LONG, "n": 2, "return_token_ids": True, "logprobs": 0}))
        await r.wait(lambda: len(r.state.dispatcher.in_flight) == 1)
        await _generating(sims[0])
        async with http.post(r.url + "/admin/pause", params={"mode": "abort"}, headers=AUTH) as resp:
            assert resp.status == 200
            body = await resp.json()
        assert body == {"paused": True, "mode": "abort", "requests_in_flight": 0, "held_requests": 0,
                        "aborted_requests": 1, "frozen_engines": [], "prefix_cache_reset": None}
        answer = await asyncio.wait_for(gen, WAIT_S)
        out = await answer.json()
        answer.release()
        assert [c["finish_reason"] for c in out["choices"]] == ["abort", "abort"]
        assert all(0 < len(c["token_ids"]) < 1500 for c in out["choices"])  # the partial rollout
        assert _drained(r.state)
        assert sims[0].app[SIM_STATE].paused  # the router paused the engine through vLLM's /pause
        metrics = await (await http.get(r.url + "/metrics")).text()
        assert 'misat_aborted_requests_total{by="engine",class="rlvr"} 1.0' in metrics
        # Held while paused; resume resets the caches, records the version, releases it.
        held = asyncio.create_task(http.post(r.url + "/v1/completions", headers=RLVR,
                                             json={"model": MODEL, "prompt": [5], "max_tokens": 2}))
        await r.wait(lambda: r.state.runner.held_count() == 1)
        async with http.post(r.url + "/admin/resume", headers=AUTH,
                             params={"reset_prefix_cache": "true", "weight_version": "step-7"}) as resp:
            body = await resp.json()
        assert body["paused"] is False and body["weight_version"] == "step-7" and body["mode"] == "abort"
        assert body["prefix_cache_reset"] == {sims[0].base_url: "ok"}
        done = await asyncio.wait_for(held, WAIT_S)
        assert done.status == 200
        done.release()
        assert not sims[0].app[SIM_STATE].paused
        status = await (await http.get(r.url + "/status")).json()
    assert status["paused"] is False and status["pause_mode"] is None
    assert [e["weight_version"] for e in status["engines"]] == ["step-7"]
    await r.wait(lambda: _drained(r.state))


async def test_pause_abort_ends_a_stream_with_an_abort_chunk(sims, make) -> None:
    r = await make([sims[0].base_url])
    async with aiohttp.ClientSession() as http:
        resp = await http.post(r.url + "/v1/completions", headers=RLVR,
                               json={**LONG, "stream": True, "stream_options": {"include_usage": True}})
        await r.wait(lambda: len(r.state.dispatcher.in_flight) == 1)
        await _generating(sims[0])
        async with http.post(r.url + "/admin/pause?mode=abort", headers=AUTH) as p:
            assert (await p.json())["aborted_requests"] == 1
        raw = (await asyncio.wait_for(resp.read(), WAIT_S)).decode()
        resp.release()
    events = [json.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {")]
    assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["abort"]
    assert events[-1]["usage"]["completion_tokens"] > 0 and raw.endswith("data: [DONE]\n\n")
    assert _drained(r.state)


async def test_an_engine_without_abort_is_aborted_by_the_router(make) -> None:
    fake = FakeEngine("a", wait_s=WAIT_S)
    await fake.start()
    try:
        r = await make([fake.url])
        fake.mid_stream_gate = asyncio.Event()  # streams pause after their first chunk
        async with aiohttp.ClientSession() as http:
            stream, _first = await open_parked_stream(http, r.url, stream_options={"include_usage": True})
            fake.gate = asyncio.Event()  # answers to later requests wait
            gen = asyncio.create_task(http.post(r.url + "/v1/completions", headers=RLVR,
                                                json={"model": MODEL, "prompt": [1], "max_tokens": 3, "n": 2}))
            await r.wait(lambda: len(r.state.dispatcher.in_flight) == 2)
            async with http.post(r.url + "/admin/pause", params={"mode": "abort"}, headers=AUTH) as p:
                body = await p.json()
            assert body["aborted_requests"] == 2 and body["requests_in_flight"] == 0
            answer = await asyncio.wait_for(gen, WAIT_S)
            assert answer.headers["X-Misat-Abort"] == "router"
            out = await answer.json()
            answer.release()
            assert [(c["index"], c["finish_reason"], c["text"]) for c in out["choices"]] == [
                (0, "abort", ""), (1, "abort", "")]
            raw = (await asyncio.wait_for(stream.read(), WAIT_S)).decode()
            stream.release()
            metrics = await (await http.get(r.url + "/metrics")).text()
        events = [json.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {")]
        assert events[-2]["choices"][0]["finish_reason"] == "abort"
        assert "usage" in events[-1] and raw.endswith("data: [DONE]\n\n")
        assert 'misat_aborted_requests_total{by="router",class="rlvr"} 2.0' in metrics
        assert 'misat_requests_total{class="rlvr",outcome="aborted"} 2.0' in metrics
        assert _drained(r.state)
    finally:
        for gate in (fake.gate, fake.mid_stream_gate):
            if gate is not None:
                gate.set()  # the engine's parked handlers end, so it can close
        await fake.close()


async def test_pause_wait_lets_in_flight_finish(make) -> None:
    async with parked_stream(make) as parked:
        r, http = parked.router, parked.http
        async with http.post(r.url + "/admin/pause", headers=AUTH) as p:
            body = await p.json()
        assert body["mode"] == "wait" and body["requests_in_flight"] == 1 and body["aborted_requests"] == 0
        status = await (await http.get(r.url + "/status")).json()
        assert status["paused"] is True and status["pause_mode"] == "wait"
        raw = await parked.release()
        assert '"finish_reason": "abort"' not in raw and raw.endswith("data: [DONE]\n\n")
        await r.wait(lambda: _drained(r.state))

def _stream_events(raw: str) -> list[dict]:
    return [json.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {")]


async def test_pause_keep_freezes_a_stream_in_place_and_the_resume_lets_it_finish(sims, make) -> None:
    r = await make([sims[0].base_url])
    sim = sims[0].app[SIM_STATE]
    async with aiohttp.ClientSession() as http:
        resp = await http.post(r.url + "/v1/completions", headers=RLVR,
                               json={**MEDIUM, "stream": True, "stream_options": {"include_usage": True}})
        await r.wait(lambda: len(r.state.dispatcher.in_flight) == 1)
        await _generating(sims[0])
        async with http.post(r.url + "/admin/pause", params={"mode": "keep"}, headers=AUTH) as p:
            assert p.status == 200
            body = await p.json()
        assert body == {"paused": True, "mode": "keep", "requests_in_flight": 1, "held_requests": 0,
                        "aborted_requests": 0, "frozen_engines": [sims[0].base_url], "prefix_cache_reset": None}
        assert sim.paused and sim.loop.frozen
        (child,) = sim.live.values()
        frozen_req = sim.engine.get_request(child.request_id)
        assert frozen_req is not None and 0 < frozen_req.num_output_tokens < MEDIUM["max_tokens"]
        status = await (await http.get(r.url + "/status")).json()
        assert status["paused"] is True and status["pause_mode"] == "keep"
        assert [e["frozen"] for e in status["engines"]] == [True]

        # The frozen engine's silence is expected: the sweep lets it be however long it lasts.
        pool = r.state.upstream_pool
        assert pool is not None
        (conn,) = pool._busy
        conn._last_io = pool.loop.time() - 10 * r.state.config.upstream_timeout_s
        pool._sweep()
        assert len(r.state.dispatcher.in_flight) == 1 and conn._error is None

        # New work is held at the router meanwhile.
        held = asyncio.create_task(http.post(r.url + "/v1/completions", headers=RLVR,
                                             json={"model": MODEL, "prompt": [9], "max_tokens": 2}))
        await r.wait(lambda: r.state.runner.held_count() == 1)

        async with http.post(r.url + "/admin/resume", headers=AUTH) as p:
            resumed = await p.json()
        assert resumed["paused"] is False and resumed["mode"] == "keep" and resumed["frozen_engines"] == []
        assert not sim.loop.frozen and not sim.paused
        status = await (await http.get(r.url + "/status")).json()
        assert [e["frozen"] for e in status["engines"]] == [False]
        # Thawed: its silence counts again, from the resume.
        assert pool.loop.time() - conn._last_io < r.state.config.upstream_timeout_s
        raw = (await asyncio.wait_for(resp.read(), WAIT_S)).decode()
        resp.release()
        answer = await asyncio.wait_for(held, WAIT_S)
        assert answer.status == 200
        answer.release()
    events = _stream_events(raw)
    # The whole generation, no abort: the frozen request went on where it stopped.
    assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["length"]
    assert events[-1]["usage"]["completion_tokens"] == MEDIUM["max_tokens"] and raw.endswith("data: [DONE]\n\n")
    assert sim.engine.counters.num_preemptions == 0
    await r.wait(lambda: _drained(r.state))


async def _frozen_generation(http: aiohttp.ClientSession, r: Any, sim: RunningServer) -> asyncio.Task:
    """A MEDIUM generation through router ``r``, frozen on ``sim`` by a keep pause; its answer's task."""
    gen = asyncio.create_task(http.post(r.url + "/v1/completions", headers=RLVR, json=MEDIUM))
    await r.wait(lambda: len(r.state.dispatcher.in_flight) == 1)
    await _generating(sim)
    async with http.post(r.url + "/admin/pause", params={"mode": "keep"}, headers=AUTH) as p:
        assert (await p.json())["frozen_engines"] == [sim.base_url]
    return gen


async def test_a_resume_that_resets_prefix_caches_after_a_keep_pause_resets_the_frozen_requests(sims, make) -> None:
    r = await make([sims[0].base_url])
    sim = sims[0].app[SIM_STATE]
    async with aiohttp.ClientSession() as http:
        gen = await _frozen_generation(http, r, sims[0])
        assert sim.engine.num_running == 1 and sim.engine.kv_cache_usage() > 0
        # The frozen request holds blocks of the old weights: a plain reset would be refused, so
        # the router asks vLLM to reset the running requests too; the request recomputes.
        async with http.post(r.url + "/admin/resume", params={"reset_prefix_cache": "true", "weight_version": "v2"},
                             headers=AUTH) as p:
            resumed = await p.json()
        assert resumed["prefix_cache_reset"] == {sims[0].base_url: "ok"}
        out = await (await asyncio.wait_for(gen, WAIT_S)).json()
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == MEDIUM["max_tokens"]
    assert sim.engine.counters.num_preemptions == 1  # the frozen request, reset and recomputed
    await r.wait(lambda: _drained(r.state))


async def test_a_router_restarted_during_a_keep_pause_resumes_what_its_predecessor_froze(sims, make) -> None:
    old = await make([sims[0].base_url])
    sim = sims[0].app[SIM_STATE]
    async with aiohttp.ClientSession() as http:
        gen = await _frozen_generation(http, old, sims[0])
        # The trainer's resume reaches a new router, which never paused anything.
        new = await make([sims[0].base_url])
        assert not new.state.engines_paused
        async with http.post(new.url + "/admin/resume", params={"reset_prefix_cache": "true"}, headers=AUTH) as p:
            resumed = await p.json()
        assert resumed["prefix_cache_reset"] == {sims[0].base_url: "ok"}  # not refused: the frozen request was reset
        assert not sim.paused and not sim.loop.frozen
        out = await (await asyncio.wait_for(gen, WAIT_S)).json()
    assert out["usage"]["completion_tokens"] == MEDIUM["max_tokens"]
    assert sim.engine.counters.num_preemptions == 1


async def test_a_reset_the_engine_refuses_is_reported_as_refused(sims, make) -> None:
    r = await make([sims[0].base_url])
    async with aiohttp.ClientSession() as http:
        gen = asyncio.create_task(http.post(r.url + "/v1/completions", headers=RLVR, json=MEDIUM))
        await r.wait(lambda: len(r.state.dispatcher.in_flight) == 1)
        await _generating(sims[0])
        # A wait pause leaves the request running: its blocks are in use, and vLLM refuses the
        # reset while answering 200 ({"success": false}).
        async with http.post(r.url + "/admin/pause", params={"mode": "wait", "reset_prefix_cache": "true"},
                             headers=AUTH) as p:
            body = await p.json()
        assert body["prefix_cache_reset"] == {sims[0].base_url: "refused"}
        async with http.post(r.url + "/admin/resume", headers=AUTH) as p:
            assert p.status == 200
        (await asyncio.wait_for(gen, WAIT_S)).release()
    await r.wait(lambda: _drained(r.state))


async def test_a_keep_pause_an_engine_cannot_take_is_undone_and_named(make) -> None:
    async with parked_stream(make) as parked:  # the fake has no /pause: vLLM without dev mode answers 404
        r, http = parked.router, parked.http
        async with http.post(r.url + "/admin/pause", params={"mode": "keep"}, headers=AUTH) as p:
            assert p.status == 502
            err = (await p.json())["error"]
        assert err["code"] == "engines_not_frozen" and parked.engine.url in err["message"]
        assert "status 404" in err["message"] and "Nothing was paused" in err["message"]
        status = await (await http.get(r.url + "/status")).json()
        assert status["paused"] is False and status["pause_mode"] is None
        assert not r.state.engines_frozen and not r.state.engines_paused
        # New work is admitted as before, and the request in flight was left alone.
        async with http.post(r.url + "/v1/completions", headers=RLVR,
                             json={"model": MODEL, "prompt": [9], "max_tokens": 2}) as ok:
            assert ok.status == 200
        raw = await parked.release()
        assert '"finish_reason": "abort"' not in raw and raw.endswith("data: [DONE]\n\n")
        await r.wait(lambda: _drained(r.state))

async def test_an_earlier_pause_stays_when_a_keep_pause_is_undone(make) -> None:
    async with parked_stream(make) as parked:
        r, http = parked.router, parked.http
        async with http.post(r.url + "/admin/pause", params={"mode": "wait"}, headers=AUTH) as p:
            assert p.status == 200
        async with http.post(r.url + "/admin/pause", params={"mode": "keep"}, headers=AUTH) as p:
            assert p.status == 502
        status = await (await http.get(r.url + "/status")).json()
        assert status["paused"] is True and status["pause_mode"] == "wait"
        await parked.release()

async def test_a_keep_pause_refuses_a_prefix_cache_reset(sims, make_router) -> None:
    r = await make_router([sims[0].base_url], admin_token=TOKEN, pause_resets_prefix_cache=True)
    async with aiohttp.ClientSession() as http:
        for params, hint in (({"mode": "keep"}, True), ({"mode": "keep", "reset_prefix_cache": "true"}, False)):
            async with http.post(r.url + "/admin/pause", params=params, headers=AUTH) as p:
                assert p.status == 400
                err = (await p.json())["error"]
            assert err["param"] == "reset_prefix_cache" and "reset_prefix_cache=false" in err["message"]
            assert ("pause_resets_prefix_cache" in err["message"]) is hint
        assert r.state.runner.paused is False
        async with http.post(r.url + "/admin/pause", params={"mode": "keep", "reset_prefix_cache": "false"},
                             headers=AUTH) as p:
            assert p.status == 200 and (await p.json())["frozen_engines"] == []  # nothing in flight to freeze


async def test_engine_ops_fan_out_and_the_call_passes_through(sims, make) -> None:
    urls = [s.base_url for s in sims]
    r = await make(urls)
    async with aiohttp.ClientSession() as http:
        async with http.post(r.url + "/admin/engines/sleep?level=1", headers=AUTH) as resp:
            body = await resp.json()
        assert body == {"op": "sleep", "engines": {u: {"status": 200, "body": ""} for u in urls}}
        assert all(s.app[SIM_STATE].sleeping and s.app[SIM_STATE].sleep_level == 1 for s in sims)
        call = {"method": "GET", "path": "/is_sleeping"}
        async with http.post(r.url + "/admin/engines/call", json=call, headers=AUTH) as resp:
            body = await resp.json()
        assert body["engines"] == {u: {"status": 200, "body": {"is_sleeping": True}} for u in urls}
        async with http.post(r.url + "/admin/engines/wake_up", headers=AUTH) as resp:
            assert all(v["status"] == 200 for v in (await resp.json())["engines"].values())
        assert not any(s.app[SIM_STATE].sleeping for s in sims)
        async with http.post(r.url + "/admin/engines/reset_prefix_cache", headers=AUTH) as resp:
            assert all(v["status"] == 200 for v in (await resp.json())["engines"].values())
        update = {"path": "/update_weight_version", "body": {"new_version": "v9"}, "weight_version": "v9"}
        async with http.post(r.url + "/admin/engines/call", json=update, headers=AUTH) as resp:
            body = await resp.json()
        assert body["engines"] == {u: {"status": 200, "body": {"success": True, "new_version": "v9"}}
                                   for u in urls}
        status = await (await http.get(r.url + "/status")).json()
        assert [e["weight_version"] for e in status["engines"]] == ["v9", "v9"]
        assert all(s.app[SIM_STATE].weight_version == "v9" for s in sims)
        metrics = await (await http.get(r.url + "/metrics")).text()
    assert f'misat_engine_weight_version_info{{engine="{urls[0]}",version="v9"}} 1.0' in metrics
    assert "misat_weight_version_changes_total" in metrics


async def test_a_prefix_cache_reset_passed_through_resets_the_policys_index_too(sims, make_router) -> None:
    r = await make_router([s.base_url for s in sims], admin_token=TOKEN, policy="misa")
    index = r.state.runner.policy.index
    async with aiohttp.ClientSession() as http:
        async with http.post(r.url + "/v1/completions", headers=RLVR,
                             json={"model": MODEL, "prompt": list(range(100, 164)), "max_tokens": 1}) as resp:
            engine = resp.headers["X-Misat-Engine"]
        assert index.size(engine) > 0
        call = {"path": "/reset_prefix_cache", "body": {"reset_running_requests": False}}
        async with http.post(r.url + "/admin/engines/call", json=call, headers=AUTH) as resp:
            assert all(v["status"] == 200 for v in (await resp.json())["engines"].values())
    assert index.size(engine) == 0


async def test_a_failed_engine_is_reported_and_not_versioned(make) -> None:
    fakes = [FakeEngine("a", wait_s=WAIT_S), FakeEngine("b", wait_s=WAIT_S)]
    for f in fakes:
        await f.start()
    try:
        r = await make([f.url for f in fakes])
        await fakes[1].die()
        call = {"path": "/update_weights", "body": {"update_info": {}}, "weight_version": "v2"}
        async with aiohttp.ClientSession() as http, http.post(r.url + "/admin/engines/call", json=call,
                                                              headers=AUTH) as resp:
            body = await resp.json()
        # The fake engine has no such endpoint (404); the dead one cannot be reached.
        assert body["engines"][fakes[0].url]["status"] == 404
        assert "error" in body["engines"][fakes[1].url]
        assert r.state.weight_versions == {}
    finally:
        for f in fakes:
            await f.close()


async def _restart(r, fake: FakeEngine) -> None:  # type: ignore[no-untyped-def]
    """What the router sees of an engine process starting again: its cumulative counters go back."""
    st = r.state.registry.get(fake.url)
    fake.prefix_queries, fake.prefix_hits = 100, 40
    await r.wait(lambda: st.metrics is not None and st.metrics.prefix_queries_total == 100)
    fake.prefix_queries = fake.prefix_hits = 0
    await r.wait(lambda: st.restarts == 1)


async def test_an_engine_restart_loses_its_weight_version_and_holds_it_until_an_update_reaches_it(make) -> None:
    fakes = [FakeEngine("a", wait_s=WAIT_S), FakeEngine("b", wait_s=WAIT_S)]
    for f in fakes:
        await f.start()
    try:
        a, b = (f.url for f in fakes)
        r = await make([a, b])
        # A call every engine answers 2xx records a version (as a weight-update call does).
        asserted = {"method": "GET", "path": "/health", "weight_version": "v1"}
        async with aiohttp.ClientSession() as http:
            async with http.post(r.url + "/admin/engines/call", json=asserted, headers=AUTH) as resp:
                assert resp.status == 200
            assert r.state.weight_versions == {a: "v1", b: "v1"}
            await _restart(r, fakes[0])
            status = await (await http.get(r.url + "/status")).json()
            engine_a = next(e for e in status["engines"] if e["id"] == a)
            assert engine_a["healthy"] and engine_a["restarts"] == 1 and engine_a["weight_version"] is None
            assert "weight version 'v1'" in engine_a["held"]
            metrics = await (await http.get(r.url + "/metrics")).text()
            assert f'misat_engine_restarts_total{{engine="{a}"}} 1.0' in metrics
            assert f'misat_engine_held{{engine="{a}"}} 1.0' in metrics
            assert f'misat_engine_held{{engine="{b}"}} 0.0' in metrics
            # Nothing new goes to the engine serving its start-up weights.
            for i in range(6):
                async with http.post(r.url + "/v1/completions", headers={**RLVR, "X-Session-Id": f"s{i}"},
                                     json={"model": MODEL, "prompt": [i, 1, 2], "max_tokens": 1}) as resp:
                    assert resp.status == 200 and resp.headers["X-Misat-Engine"] == b
            assert fakes[0].generations == 0
            # Engine-wide calls still reach it (here pause's prefix-cache reset).
            async with http.post(r.url + "/admin/pause", params={"reset_prefix_cache": "true"},
                                 headers=AUTH) as resp:
                assert (await resp.json())["prefix_cache_reset"] == {a: "ok", b: "ok"}
            # A resume's version is not proof that the update reached it: still held.
            async with http.post(r.url + "/admin/resume", params={"weight_version": "v2"}, headers=AUTH) as resp:
                assert resp.status == 200
            assert r.state.weight_versions == {a: None, b: "v2"} and r.state.registry.placeable_count() == 1
            # A weight-update call it answers 2xx is.
            update = {"method": "GET", "path": "/health", "weight_version": "v3"}
            async with http.post(r.url + "/admin/engines/call", json=update, headers=AUTH) as resp:
                assert resp.status == 200
            assert r.state.weight_versions == {a: "v3", b: "v3"}
            assert r.state.registry.snapshots()[a].healthy and r.state.registry.placeable_count() == 2
            status = await (await http.get(r.url + "/status")).json()
            assert [e["held"] for e in status["engines"]] == [None, None]
    finally:
        for f in fakes:
            await f.close()


async def test_an_engine_joining_after_a_weight_version_is_held_until_an_update_reaches_it(make) -> None:
    fakes = [FakeEngine(n, wait_s=WAIT_S) for n in "abc"]
    for f in fakes:
        await f.start()
    try:
        a, b, c = (f.url for f in fakes)
        r = await make([a])
        async with aiohttp.ClientSession() as http:
            # Before any version: a new engine (a scale-up) is simply placed on.
            doc = r.state.config.model_dump(mode="json") | {"generation": 2, "engines": {"urls": [a, b]}}
            async with http.put(r.url + "/admin/config", json=doc, headers=AUTH) as resp:
                assert resp.status == 200
            await r.wait(lambda: r.state.registry.placeable_count() == 2)
            call = {"method": "GET", "path": "/health", "weight_version": "v1"}
            async with http.post(r.url + "/admin/engines/call", json=call, headers=AUTH) as resp:
                assert resp.status == 200
            # After one: a pod at a new address serves its start-up weights, so it waits for an update.
            doc |= {"generation": 3, "engines": {"urls": [a, b, c]}}
            async with http.put(r.url + "/admin/config", json=doc, headers=AUTH) as resp:
                assert resp.status == 200
            await r.wait(lambda: r.state.registry.healthy_count() == 3)
            assert r.state.registry.placeable_count() == 2
            assert "joined after weight version 'v1'" in (r.state.registry.get(c).held or "")  # type: ignore[union-attr]
            call["weight_version"] = "v2"
            async with http.post(r.url + "/admin/engines/call", json=call, headers=AUTH) as resp:
                assert resp.status == 200
            assert r.state.registry.placeable_count() == 3 and r.state.weight_versions == dict.fromkeys([a, b, c], "v2")
    finally:
        for f in fakes:
            await f.close()


async def test_a_restart_without_a_recorded_version_is_counted_and_holds_nothing(engines, make) -> None:
    r = await make([e.url for e in engines])
    await _restart(r, engines[0])
    assert r.state.registry.placeable_count() == 2 and r.state.registry.get(engines[0].url).held is None


async def test_with_every_engine_held_a_request_fails_fast_naming_the_hold(make_router) -> None:
    fake = FakeEngine("a", wait_s=WAIT_S)
    await fake.start()
    try:
        r = await make_router([fake], admin_token=TOKEN, no_healthy_engine_wait_s=0.1)
        async with aiohttp.ClientSession() as http:
            call = {"method": "GET", "path": "/health", "weight_version": "v1"}
            async with http.post(r.url + "/admin/engines/call", json=call, headers=AUTH) as resp:
                assert resp.status == 200
            await _restart(r, fake)
            async with http.post(r.url + "/v1/completions", headers=RLVR,
                                 json={"model": MODEL, "prompt": [1, 2], "max_tokens": 1}) as resp:
                body = await resp.json()
                assert resp.status == 503 and body["error"]["code"] == "no_healthy_engine"
            assert "weight version 'v1'" in body["error"]["message"]
            async with http.get(r.url + "/ready") as resp:
                assert resp.status == 200  # reachable for the admin call that releases the engine
        assert fake.generations == 0
    finally:
        await fake.close()


@pytest.mark.parametrize(
    ("method", "path", "payload", "status", "param"),
    [
        ("POST", "/admin/pause?mode=later", None, 400, "mode"),
        ("POST", "/admin/resume?weight_version=", None, 400, "weight_version"),
        ("POST", "/admin/engines/explode", None, 404, "op"),
        ("POST", "/admin/engines/call", {"path": "/v1/completions"}, 400, "path"),
        ("POST", "/admin/engines/call", {"path": "/v1"}, 400, "path"),
        ("POST", "/admin/engines/call", {"path": "update_weights"}, 400, "path"),
        ("POST", "/admin/engines/call", {"path": "//evil/x"}, 400, "path"),
        ("POST", "/admin/engines/call", {"path": "/pause?mode=abort"}, 400, "path"),
        ("POST", "/admin/engines/call", {}, 400, "path"),
        ("POST", "/admin/engines/call", {"path": "/sleep", "method": "PATCH"}, 400, "method"),
        ("POST", "/admin/engines/call", {"path": "/sleep", "headers": {}}, 400, "headers"),
    ],
)
async def test_refusals_have_the_openai_shape(make, method, path, payload, status, param) -> None:
    fake = FakeEngine("a", wait_s=WAIT_S)
    await fake.start()
    try:
        r = await make([fake.url])
        async with aiohttp.ClientSession() as http, http.request(method, r.url + path, json=payload,
                                                                 headers=AUTH) as resp:
            assert resp.status == status
            err = (await resp.json())["error"]
        assert err["param"] == param and set(err) == {"message", "type", "param", "code"}
        assert r.state.runner.paused is False and fake.generations == 0
    finally:
        await fake.close()


async def test_engine_admin_needs_the_token(make) -> None:
    fake = FakeEngine("a", wait_s=WAIT_S)
    await fake.start()
    try:
        r = await make([fake.url])
        async with aiohttp.ClientSession() as http:
            for path in ("/admin/engines/sleep", "/admin/engines/call"):
                async with http.post(r.url + path, json={"path": "/sleep"}) as resp:
                    assert resp.status == 401
    finally:
        await fake.close()
