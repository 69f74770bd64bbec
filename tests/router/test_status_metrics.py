"""/status, /metrics, /health and /ready content, and MISA-T through the live service."""

from __future__ import annotations

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from misat_router.status import RouterStatus, SampleRateMeter
from tests.support.fake_engine import BLOCK_SIZE, NUM_GPU_BLOCKS, FakeEngine
from tests.support.router_config import MODEL


async def _traffic(url: str) -> None:
    async with aiohttp.ClientSession() as http:
        for cls, n in (("rlvr", 3), ("rlhf", 1)):
            for i in range(n):
                async with http.post(url + "/v1/completions",
                                     json={"model": MODEL, "prompt": [i, 1, 2]},
                                     headers={"X-Rollout-Class": cls}) as r:
                    assert r.status == 200


async def test_status_reports_mixture_engines_and_rates(engines: list[FakeEngine], make_router) -> None:
    engines[0].cached_tokens = 1
    h = await make_router(engines)
    await _traffic(h.url)
    # Wait for a scrape that saw the traffic's prefix-cache counters.
    await h.wait(lambda: all(
        st.metrics is not None and st.metrics.prefix_queries_total > 0
        for st in (h.state.registry.get(e.url) for e in engines) if st))
    async with aiohttp.ClientSession() as http, http.get(h.url + "/status") as r:
        status = RouterStatus.model_validate(await r.json())
    assert status.generation == 1 and status.ready and status.healthy_engines == 2
    classes = {c.name: c for c in status.classes}
    assert classes["rlvr"].completed_units == 3 and classes["rlhf"].completed_units == 1
    assert classes["rlvr"].consumed_share == 0.75
    # target 40/20/40, consumed 75/25/0: TV = 0.5 * (35 + 5 + 40) = 40 points
    assert abs(status.mixture_tv_points - 40.0) < 1e-9
    assert status.sample_rate_per_min > 0
    eng = {e.id: e for e in status.engines}
    assert eng[engines[0].url].kv_capacity_tokens == NUM_GPU_BLOCKS * BLOCK_SIZE
    assert eng[engines[0].url].prefix_hit_rate is not None
    assert status.prefix_hit_rate is not None and 0 < status.prefix_hit_rate < 1
    assert status.kv == []  # round-robin reports no class budgets


async def test_metrics_exposes_misat_series(engines: list[FakeEngine], make_router) -> None:
    h = await make_router(engines[:1])
    await _traffic(h.url)
    async with aiohttp.ClientSession() as http, http.get(h.url + "/metrics") as r:
        assert r.status == 200
        text = await r.text()
    names = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    for expected in (
        "misat_decisions_total", "misat_requests_total", "misat_held_requests",
        "misat_active_sessions", "misat_mixture_target", "misat_mixture_consumed",
        "misat_mixture_tv_points", "misat_prefix_hit_rate", "misat_engine_healthy",
        "misat_proxy_overhead_seconds_bucket", "misat_sample_rate_per_min",
        "misat_completed_units_total", "misat_config_generation",
    ):
        assert expected in names, expected
    assert 'misat_decisions_total{action="place",class="rlvr",reason="round_robin"} 3.0' in text
    assert "misat_proxy_overhead_seconds_count 4.0" in text


async def test_health_is_alive_and_ready_needs_an_engine(engines: list[FakeEngine], make_router) -> None:
    h = await make_router(engines[:1])
    async with aiohttp.ClientSession() as http:
        async with http.get(h.url + "/health") as r:
            assert r.status == 200
        async with http.get(h.url + "/ready") as r:
            assert r.status == 200 and (await r.json())["generation"] == 1


async def test_misa_t_places_and_reports_class_budgets(engines: list[FakeEngine], make_router) -> None:
    h = await make_router(engines, policy="misa-t")
    # Wait for a scrape, so the policy knows the engines' KV capacity.
    await h.wait(lambda: all(
        (st := h.state.registry.get(e.url)) is not None and st.metrics is not None for e in engines))
    await _traffic(h.url)
    async with aiohttp.ClientSession() as http:
        async with http.post(h.url + "/v1/completions", json={"model": MODEL, "prompt": [9, 9]},
                             headers={"X-Rollout-Class": "agentic", "X-Session-Id": "a1"}) as r:
            assert r.status == 200
        async with http.get(h.url + "/status") as r:
            status = RouterStatus.model_validate(await r.json())
        async with http.get(h.url + "/metrics") as r:
            text = await r.text()
    assert status.policy == "misa-t"
    assert {c.name: c.active_sessions for c in status.classes}["agentic"] == 1
    rows = [k for k in status.kv if k.workload_class == "agentic" and k.sessions]
    assert len(rows) == 1 and rows[0].budget_tokens is not None and rows[0].budget_tokens > 0
    assert "misat_kv_budget_tokens{" in text
    assert 'reason="new_session"' in text


def test_sample_rate_meter_counts_units_in_window() -> None:
    m = SampleRateMeter(started_at=0.0)
    m.observe(2, now=10.0, window_s=60.0)
    m.observe(5, now=50.0, window_s=60.0)
    assert m.per_minute(now=60.0, window_s=60.0) == 5.0
    # 70 s later only the second batch (3 units) is inside the 60 s window.
    assert m.per_minute(now=100.0, window_s=60.0) == 3.0


def test_sample_rate_meter_memory_is_bounded_without_readers() -> None:
    # An hour at 1,000 units/s and nobody reading /status: the window holds at most
    # window / resolution entries, and the rate is still exact.
    m = SampleRateMeter(started_at=0.0, resolution_s=0.1)
    for i in range(1, 3_600_001, 250):  # 250 units every 0.25 s
        m.observe(i + 249, now=i / 1000, window_s=60.0)
        assert m.entries() <= 601
    assert m.per_minute(now=3600.0, window_s=60.0) == pytest.approx(60_000, rel=0.01)
