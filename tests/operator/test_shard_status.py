"""Router shards, operator side, pure: the HAProxy config (checked by the real binary) and the
pool's router view combined from each shard's /status."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from misat_cli.shards import find_haproxy
from misat_operator.haproxy import ShardServer, haproxy_config
from misat_operator.status import shards_error, shards_view
from misat_router.shard_status import ShardReading, combine_shards
from misat_router.status import ClassStatus, EngineStatus, RouterStatus, ShardStatus


def _engine(eid: str) -> EngineStatus:
    return EngineStatus(id=eid, healthy=True, in_flight=1, kv_capacity_tokens=1000, kv_usage=0.5, running=1,
                        waiting=0, prefix_hit_rate=None, preemptions_total=0, last_scrape_age_s=0.1, last_error=None)


def _shard(index: int, units: dict[str, int], engines: list[str], *, generation: int = 4, hits: float = 0.0,
           queries: float = 0.0, config_hash: str = "h") -> RouterStatus:
    total = sum(units.values())
    return RouterStatus(
        generation=generation, config_hash=config_hash, model="policy", policy="misa-t", paused=False,
        ready=True, draining=False, healthy_engines=len(engines), requests_in_flight=len(engines),
        held_requests=1, held_by_reason={"session_cap": 1}, oldest_hold_s=float(index),
        classes=[ClassStatus(name=n, target_share=0.5, consumed_share=u / total if total else 0.0,
                             completed_units=u, active_sessions=1, held_requests=0, kv_budget_tokens=100.0,
                             kv_used_tokens=None) for n, u in units.items()],
        engines=[_engine(e) for e in engines], kv=[], mixture_tv_points=0.0, sample_rate_per_min=6.0,
        prefix_hit_rate=hits / queries if queries else None, sessions_ended_idle=0, last_reload_error=None,
        policy_state={}, prefix_hits_total=hits, prefix_queries_total=queries,
        shard=ShardStatus(index=index, count=3, live=[0, 1], owned_engines=engines, known_engines=4),
    )


def test_shards_combine_by_counts_and_one_down_makes_the_pool_not_ready() -> None:
    # Shard 0: 90 a of 100 (90 %); shard 1: 0 a of 300. By counts a is 90/400 = 22.5 %; the mean of
    # the two shards' ratios would say 45 %.
    readings = [
        ShardReading(0, "http://s0", _shard(0, {"a": 90, "b": 10}, ["e0", "e2"], hits=30, queries=100)),
        ShardReading(1, "http://s1", _shard(1, {"a": 0, "b": 300}, ["e1", "e3"], hits=10, queries=300,
                                           generation=3, config_hash="old")),
        ShardReading(2, "http://s2", None, "GET /status: refused"),
    ]
    pool = combine_shards(readings)
    assert pool is not None
    by = {c.name: c for c in pool.classes}
    assert by["a"].completed_units == 90 and by["b"].completed_units == 310
    assert by["a"].consumed_share == pytest.approx(90 / 400)  # not (0.9 + 0.0) / 2
    assert pool.mixture_tv_points == pytest.approx(100 * abs(0.5 - 90 / 400))
    assert by["a"].kv_budget_tokens == 200.0 and by["a"].kv_used_tokens is None
    assert pool.prefix_hit_rate == pytest.approx(40 / 400)  # hits over queries, not the mean of rates
    assert [e.id for e in pool.engines] == ["e0", "e2", "e1", "e3"] and pool.healthy_engines == 4
    assert pool.held_by_reason == {"session_cap": 2} and pool.oldest_hold_s == 1.0
    assert pool.generation == 3 and pool.config_hash == "mixed:h,old"  # applied only when all have it
    assert pool.ready is False  # shard 2 did not answer
    assert shards_error(readings) == "shard 2: GET /status: refused"
    view = shards_view(readings)
    assert [v["up"] for v in view] == [True, True, False]
    assert view[0]["ownedEngines"] == 2 and view[2]["error"] == "GET /status: refused"


def test_an_engine_being_handed_back_is_the_owners_in_the_pool_view() -> None:
    # Shard 0 hands e1 back to shard 1 and still finishes its sessions there: both list it.
    draining = _shard(0, {"a": 1}, ["e0"])
    row = _engine("e1").model_copy(update={"handing_back": True, "in_flight": 7})
    assert draining.shard is not None
    draining = draining.model_copy(update={
        "engines": [*draining.engines, row],
        "shard": draining.shard.model_copy(update={"handing_back": ["e1"]})})
    readings = [ShardReading(0, "http://s0", draining), ShardReading(1, "http://s1", _shard(1, {"a": 1}, ["e1"]))]
    pool = combine_shards(readings)
    assert pool is not None
    assert [(e.id, e.handing_back, e.in_flight) for e in pool.engines] == [("e0", False, 1), ("e1", False, 1)]
    view = shards_view(readings)
    assert [(v["ownedEngines"], v["handingBackEngines"]) for v in view] == [(1, 1), (1, 0)]


def test_all_shards_up_and_ready_is_ready_and_none_up_is_unknown() -> None:
    up = [ShardReading(i, f"http://s{i}", _shard(i, {"a": 1, "b": 1}, [f"e{i}"])) for i in range(2)]
    combined = combine_shards(up)
    assert combined is not None and combined.ready and combined.config_hash == "h"
    assert combine_shards([ShardReading(0, "http://s0", None, "down")]) is None


@pytest.mark.parametrize("dns", [False, True])
def test_the_rendered_proxy_config_is_valid_for_haproxy(tmp_path: Path, dns: bool) -> None:
    servers = [ShardServer(f"pool-router-{i}.pool-router-shards.rl.svc.cluster.local" if dns else "127.0.0.1",
                           8080 + (0 if dns else i)) for i in range(3)]
    cfg = haproxy_config(servers, bind_address="::" if dns else "127.0.0.1", bind_port=9000, dns=dns)
    path = tmp_path / "haproxy.cfg"
    path.write_text(cfg)
    binary = find_haproxy()  # installed by scripts/system-packages.sh (make test)
    result = subprocess.run([binary, "-c", "-f", str(path)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "balance hdr(X-Session-Id)" in cfg and "hash-type consistent" in cfg
    assert "retry-on conn-failure empty-response" in cfg and "option redispatch 1" in cfg
    assert [line.split()[-1] for line in cfg.splitlines() if line.strip().startswith("server ")] == ["1", "2", "3"]


def test_an_empty_shard_list_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one shard"):
        haproxy_config([], bind_address="127.0.0.1", bind_port=9000, dns=False)
