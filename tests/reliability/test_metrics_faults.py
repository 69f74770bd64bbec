"""An engine whose ``/metrics`` is slow, empty or garbage: no crash, one warning, safe estimates.

While an engine's metrics are unusable the policy's snapshot of it keeps the static KV
capacity and cumulative counters of the last good scrape, reads the load gauges as zero
(so MISA-T counts the router's own sessions on it) and is stamped with the failed
scrape's time (so the policy's per-engine event log stays bounded). The good engines'
metrics keep flowing; requests keep being placed on both.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest

from tests.support.fake_engine import METRICS_MODES, FakeEngine

from .conftest import MODEL, RouterUnderTest, router_config

POLICY = {"footprint": {"bootstrap_tokens": 256}}
BAD_MODES = ["slow", *(m for m in METRICS_MODES if m != "ok")]


def warnings_about(caplog: pytest.LogCaptureFixture, engine: FakeEngine) -> list[str]:
    return [rec.getMessage() for rec in caplog.records
            if rec.levelno >= logging.WARNING and engine.url in rec.getMessage() and "metrics" in rec.getMessage()]


async def place_on_both(http: aiohttp.ClientSession, r: RouterUnderTest, engines: list[FakeEngine]) -> None:
    """Concurrent requests: MISA-T spreads them by in-flight load over both engines."""

    async def one(i: int) -> str:
        async with http.post(r.url + "/v1/completions", json={"model": MODEL, "prompt": [i, 1, 2]},
                             headers={"X-Rollout-Class": "rlvr"}) as resp:
            assert resp.status == 200
            return resp.headers["X-Misat-Engine"]

    seen = await asyncio.gather(*(one(i) for i in range(16)))
    assert set(seen) == {e.url for e in engines}


@pytest.mark.parametrize("mode", BAD_MODES)
async def test_bad_metrics_fall_back_logged_once(
    misbehaving, make_router, caplog: pytest.LogCaptureFixture, mode: str
) -> None:
    good, bad = await misbehaving(2)
    r = await make_router(router_config([good.url, bad.url], policy_settings=POLICY,
                                        scrape_interval_s=0.02, scrape_timeout_s=0.1))
    reg = r.state.registry
    await r.wait(lambda: all(reg.get(e.url).metrics is not None for e in (good, bad)))
    capacity = reg.snapshots()[bad.url].kv_capacity_tokens
    assert capacity == 16_000 and reg.snapshots()[bad.url].num_running == 3

    with caplog.at_level(logging.DEBUG, logger="misat_router"):
        bad.metrics_mode = mode
        hits = bad.metrics_hits
        await bad.wait_metrics_hits(hits + 8)  # several failed scrapes in a row
        await r.wait(lambda: reg.get(bad.url).scrape_failed_at is not None)
        snap = r.state.registry.snapshots()[bad.url]
        # Safe estimates: capacity kept, load gauges unknown (the router's own counts rule).
        assert (snap.kv_capacity_tokens, snap.num_running, snap.num_waiting) == (capacity, 0, 0)
        assert snap.healthy and snap.scraped_at >= reg.get(bad.url).scraped_at
        # The good engine is still scraped every tick: one bad page does not stop on_metrics.
        before = reg.get(good.url).scraped_at
        await r.wait(lambda: reg.get(good.url).scraped_at > before)
        async with aiohttp.ClientSession() as http:
            await place_on_both(http, r, [good, bad])
            async with http.get(r.url + "/status") as resp:
                assert resp.status == 200
                engines = {e["id"]: e for e in (await resp.json())["engines"]}
            async with http.get(r.url + "/metrics") as resp:
                assert resp.status == 200
        assert engines[bad.url]["last_error"] and "metrics" in engines[bad.url]["last_error"]
        assert len(warnings_about(caplog, bad)) == 1, warnings_about(caplog, bad)
        assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]

        # Recovery is logged once; a later failure streak warns once more.
        bad.metrics_mode = "ok"
        await r.wait(lambda: reg.get(bad.url).scrape_failed_at is None)
        assert reg.snapshots()[bad.url].num_running == 3
        assert any("usable again" in rec.getMessage() for rec in caplog.records)
        bad.metrics_mode = mode
        await r.wait(lambda: reg.get(bad.url).scrape_failed_at is not None)
        await bad.wait_metrics_hits(bad.metrics_hits + 4)
        assert len(warnings_about(caplog, bad)) == 2


async def test_never_scraped_engine_keeps_the_policy_event_log_bounded(misbehaving, make_router) -> None:
    """MISA-T remembers placements "since the last scrape" per engine; an engine whose
    metrics never work must not make that log grow with every request."""
    (bad,) = await misbehaving(1)
    bad.metrics_mode = "garbage"
    r = await make_router(router_config([bad.url], policy_settings={"footprint": {"bootstrap_tokens": 256}},
                                        scrape_interval_s=0.02))
    await r.wait(lambda: r.state.registry.get(bad.url).scrape_failed_at is not None)
    async with aiohttp.ClientSession() as http:
        for i in range(60):
            async with http.post(r.url + "/v1/completions", json={"model": MODEL, "prompt": [i, 1]},
                                 headers={"X-Rollout-Class": "rlvr"}) as resp:
                assert resp.status == 200
    hits = bad.metrics_hits
    await bad.wait_metrics_hits(hits + 3)
    await r.wait(lambda: len(r.state.runner.policy._events.get(bad.url, ())) < 10)


async def test_a_slow_metrics_page_does_not_make_the_other_engines_readings_older(misbehaving, make_router) -> None:
    """One scrape hangs (its timeout is long); the other engine is still scraped every tick, and the
    hanging scrape is not started again while it runs."""
    good, bad = await misbehaving(2)
    r = await make_router(router_config([good.url, bad.url], policy_settings=POLICY,
                                        scrape_interval_s=0.02, scrape_timeout_s=60.0))
    reg = r.state.registry
    await r.wait(lambda: all(reg.get(e.url).metrics is not None for e in (good, bad)))
    bad.metrics_mode = "slow"
    await r.wait(lambda: bad.metrics_stuck == 1)
    # Bounded by the fake engine's wait (seconds): waiting for the slow scrape's timeout instead
    # would give the good engine no new scrape in that time.
    await good.wait_metrics_hits(good.metrics_hits + 20)
    assert bad.metrics_stuck == 1
    assert reg.get(bad.url).healthy and reg.get(bad.url).scrape_failed_at is None
