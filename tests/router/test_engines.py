"""vLLM metrics parsing and the engine registry's health bookkeeping."""

from __future__ import annotations

import pytest

from misat_router.engines import EngineRegistry, engine_url
from misat_router.vllm_metrics import VllmMetrics, parse_vllm_metrics
from tests.support.fake_engine import FakeEngine

TWO_ENGINES = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 900.0
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 4.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="300"} 1.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="+Inf",engine="0",model_name="m"} 5.0
"""


def test_parse_sums_internal_engines_and_weights_kv_usage() -> None:
    m = parse_vllm_metrics(TWO_ENGINES)
    assert m.kv_capacity_tokens == 400 * 16
    assert m.kv_usage == pytest.approx((0.5 * 1600 + 0.25 * 4800) / 6400)
    assert (m.num_running, m.num_waiting) == (4, 2)
    assert (m.prefix_queries_total, m.prefix_hits_total, m.preemptions_total) == (1000, 900, 4)


def test_parse_fake_engine_page_and_missing_metrics() -> None:
    m = parse_vllm_metrics(FakeEngine("x").metrics_text())
    assert m.kv_capacity_tokens == 64 * 16 and m.num_running == 0
    assert parse_vllm_metrics("") == VllmMetrics()


class Calls:
    def __init__(self) -> None:
        self.down: list[str] = []
        self.up: list[str] = []
        self.removed: list[str] = []


def make_registry() -> tuple[EngineRegistry, Calls]:
    c = Calls()
    reg = EngineRegistry(lambda: 42.0, on_down=c.down.append, on_up=c.up.append,
                         on_removed=c.removed.append)
    return reg, c


def test_a_counted_failure_shares_the_health_checks_count() -> None:
    reg, calls = make_registry()
    reg.set_engines(["http://a"])
    reg.record_health("http://a", True, down_after=2, up_after=1)
    reg.count_failure("http://a", "ConnectTimedOut: slow", down_after=2)
    assert reg.snapshots()["http://a"].healthy and calls.down == []  # one is not enough
    reg.record_health("http://a", True, down_after=2, up_after=1)  # a passed check starts the count again
    reg.count_failure("http://a", "ConnectTimedOut: slow", down_after=2)
    assert reg.snapshots()["http://a"].healthy
    reg.record_health("http://a", False, down_after=2, up_after=1, error="/health failed")
    assert calls.down == ["http://a"]  # a timeout and a failed check in a row
    assert reg.get("http://a").last_error == "/health failed"  # type: ignore[union-attr]


def test_registry_health_transitions_and_snapshots() -> None:
    reg, calls = make_registry()
    reg.set_engines(["http://a", "http://b"])
    assert not any(s.healthy for s in reg.snapshots().values())  # unknown until checked
    reg.record_health("http://a", True, down_after=2, up_after=1)
    assert calls.up == ["http://a"] and reg.snapshots()["http://a"].healthy
    reg.record_health("http://a", False, down_after=2, up_after=1)
    assert reg.snapshots()["http://a"].healthy  # one failure is not enough
    reg.record_health("http://a", False, down_after=2, up_after=1)
    assert calls.down == ["http://a"] and not reg.snapshots()["http://a"].healthy
    reg.record_health("http://b", True, down_after=2, up_after=1)
    reg.mark_failed("http://b", "refused")  # proxy connection error: at once
    assert calls.down == ["http://a", "http://b"]
    reg.record_metrics("http://a", VllmMetrics(kv_capacity_tokens=10, kv_usage=0.5), 7.0)
    snap = reg.snapshots()["http://a"]
    assert (snap.kv_capacity_tokens, snap.kv_used_tokens, snap.scraped_at) == (10, 5.0, 7.0)
    reg.set_engines(["http://b"])
    assert calls.removed == ["http://a"] and list(reg.snapshots()) == ["http://b"]


def test_counters_going_back_are_a_restart_and_a_hold_hides_a_healthy_engine_from_placement() -> None:
    restarted: list[str] = []
    reg = EngineRegistry(lambda: 0.0, on_down=list().append, on_up=list().append,
                         on_removed=list().append, on_restarted=restarted.append)
    reg.set_engines(["http://a", "http://b"])
    for e in ("http://a", "http://b"):
        reg.record_health(e, True, down_after=2, up_after=1)
    reg.record_metrics("http://a", VllmMetrics(prefix_queries_total=100, prefix_hits_total=50), 1.0)
    reg.record_metrics("http://a", VllmMetrics(prefix_queries_total=160, prefix_hits_total=90), 2.0)
    reg.record_metrics("http://a", VllmMetrics(prefix_queries_total=160, prefix_hits_total=90), 3.0)
    assert restarted == []  # the first reading, rising and equal counters: the same process
    reg.record_metrics("http://a", VllmMetrics(prefix_queries_total=7, prefix_hits_total=0), 4.0)
    reg.record_metrics("http://b", VllmMetrics(preemptions_total=3), 4.0)
    reg.record_metrics("http://b", VllmMetrics(preemptions_total=0), 5.0)
    assert restarted == ["http://a", "http://b"]
    assert (reg.get("http://a").restarts, reg.get("http://b").restarts) == (1, 1)  # type: ignore[union-attr]

    reg.hold("http://a", "restarted")
    assert not reg.snapshots()["http://a"].healthy and reg.snapshots()["http://b"].healthy
    # Still counted healthy (probed, scraped, ready for the admin call that releases it), not placeable.
    assert (reg.healthy_count(), reg.placeable_count()) == (2, 1)
    assert reg.release_hold("http://a") and not reg.release_hold("http://a")
    assert reg.snapshots()["http://a"].healthy and reg.placeable_count() == 2


class Owns:
    """An ownership filter the test switches (router shards' ``owned_engines``, by hand)."""

    def __init__(self, mine: set[str]) -> None:
        self.mine = mine

    def __call__(self, known: list[str]) -> list[str]:
        return [e for e in known if e in self.mine]


def sharded_registry(idle_s: float) -> tuple[EngineRegistry, Calls, Owns, list[float]]:
    c, now = Calls(), [0.0]
    reg = EngineRegistry(lambda: now[0], on_down=c.down.append, on_up=c.up.append,
                         on_removed=c.removed.append)
    reg.hand_back_idle_s = idle_s
    owns = Owns({"http://a", "http://b", "http://c"})
    reg.set_ownership(owns)
    reg.set_engines(["http://a", "http://b", "http://c"])
    return reg, c, owns, now


def test_an_engine_handed_back_drains_its_sessions_before_it_is_dropped() -> None:
    reg, calls, owns, now = sharded_registry(idle_s=30.0)
    reg.record_health("http://b", True, down_after=2, up_after=1)
    reg.record_metrics("http://b", VllmMetrics(kv_capacity_tokens=10), 1.0)
    now[0] = 5.0
    owns.mine = {"http://a"}  # a peer came back: b and c are its again
    added, removed = reg.refilter()
    assert (added, removed) == ([], ["http://b", "http://c"])
    assert reg.handing_back == {"http://b", "http://c"} and calls.removed == []
    assert reg.ids() == ["http://a", "http://b", "http://c"]  # still probed, scraped, placed on
    assert reg.owned_ids() == ["http://a"] and reg.healthy_count() == 0  # b is its owner's to count
    assert reg.refilter() == ([], [])  # a second look starts nothing again

    now[0] = 10.0  # b's sessions: one active at 2 (before the hand-back), c: none left
    assert reg.settle_hand_backs({"http://b": 2.0}) == [("http://c", "drained")]
    assert calls.removed == ["http://c"] and reg.handing_back == {"http://b"}
    now[0] = 34.9  # the hand-back's start (5) counts as activity: not yet 30 s quiet
    assert reg.settle_hand_backs({"http://b": 2.0}) == []
    assert reg.settle_hand_backs({"http://b": 20.0}) == []  # a turn at 20 keeps it longer
    now[0] = 50.0
    assert reg.settle_hand_backs({"http://b": 20.0}) == [("http://b", "idle")]
    assert calls.removed == ["http://c", "http://b"] and reg.ids() == ["http://a"]
    assert reg.handing_back == frozenset()


def test_an_engine_owned_again_mid_drain_keeps_its_state_and_one_gone_is_dropped_at_once() -> None:
    reg, calls, owns, now = sharded_registry(idle_s=30.0)
    reg.record_health("http://b", True, down_after=2, up_after=1)
    owns.mine = {"http://a"}
    reg.refilter()
    owns.mine = {"http://a", "http://b", "http://c"}  # the peer went down again before the drain ended
    assert reg.refilter() == ([], [])
    assert reg.handing_back == frozenset() and reg.owned_ids() == ["http://a", "http://b", "http://c"]
    assert reg.snapshots()["http://b"].healthy and calls.removed == []  # never dropped, state kept
    now[0] = 100.0  # owned: no drain to end, sessions or not
    assert reg.settle_hand_backs({}) == [] and calls.removed == []

    owns.mine = {"http://a"}
    reg.refilter()
    reg.set_engines(["http://a", "http://b"])  # c left the pool mid-drain: gone at once
    assert calls.removed == ["http://c"] and reg.handing_back == {"http://b"}


def test_without_a_drain_an_engine_handed_back_is_dropped_at_once() -> None:
    reg, calls, owns, _ = sharded_registry(idle_s=0.0)
    owns.mine = {"http://a"}
    assert reg.refilter() == ([], ["http://b", "http://c"])
    assert calls.removed == ["http://b", "http://c"] and reg.handing_back == frozenset()


def test_engine_url_brackets_ipv6() -> None:
    assert engine_url("http", "10.0.0.1", 8000) == "http://10.0.0.1:8000"
    assert engine_url("http", "fd00::1", 8000) == "http://[fd00::1]:8000"


def test_an_engine_is_joined_once_when_new_to_the_pool_not_when_a_shard_takes_it_over() -> None:
    joined: list[str] = []
    reg = EngineRegistry(lambda: 0.0, on_down=list().append, on_up=list().append,
                         on_removed=list().append, on_joined=joined.append)
    owns = Owns({"http://a"})
    reg.set_ownership(owns)
    reg.set_engines(["http://a", "http://b"])
    assert joined == ["http://a"]  # b is known, another shard's
    owns.mine = {"http://a", "http://b"}  # its shard went down: b is taken over, not new
    assert reg.refilter() == (["http://b"], [])
    reg.set_engines(["http://a", "http://b", "http://c"])
    assert joined == ["http://a"]  # new to the pool, but another shard's: that shard holds it if need be
    owns.mine.add("http://d")
    reg.set_engines(["http://a", "http://b", "http://c", "http://d"])
    assert joined == ["http://a", "http://d"]


async def test_the_probe_interval_runs_from_one_ticks_start_to_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    """A round of scrapes that takes time (many engines) does not stretch the interval; one
    that takes longer than it is followed by the next at once."""
    import asyncio

    from misat_router import scrape

    now = [100.0]
    tick_costs = iter([0.1, 0.05, 0.4, 0.0])
    waits: list[float] = []
    stop = asyncio.Event()

    async def tick() -> None:
        now[0] += next(tick_costs)

    async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
        waits.append(timeout_s)
        now[0] += timeout_s
        if len(waits) == 4:
            stop.set()
        return stop.is_set()

    monkeypatch.setattr(scrape, "wait_event", wait_event)
    await scrape.every(stop, lambda: 0.25, tick, lambda: now[0])
    assert waits == pytest.approx([0.15, 0.2, 0.0, 0.25])
