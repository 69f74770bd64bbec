"""Router shards, router side: engine ownership (pure), peer liveness, and one router app as shard.

The real multi-process shape (shards behind HAProxy, a shard killed under load) is in
``test_shards_haproxy.py``.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from misat_router import server
from misat_router.app import create_app
from misat_router.config import ConfigError, RouterConfig
from misat_router.errors import ConfigRejected
from misat_router.service import start_service
from misat_router.shard_admin import merge_pause
from misat_router.sharding import (
    SHARD_DOWN,
    SHARD_HEADER,
    PeerLiveness,
    engine_owner,
    index_from_hostname,
    owned_engines,
)
from misat_router.state import STATE, RouterState
from tests.support.fake_engine import FakeEngine
from tests.support.router_config import MODEL, router_config

WAIT_S = 5.0
ENGINES = [f"http://10.0.0.{i}:8000" for i in range(1, 13)]


def owners(engines: list[str], shards: int, live: set[int]) -> dict[int, list[str]]:
    return {s: owned_engines(engines, shards, live, s) for s in live}


@pytest.mark.parametrize("shards", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("n_engines", [1, 2, 5, 12])
def test_every_live_set_splits_the_engines_disjointly_and_completely(shards: int, n_engines: int) -> None:
    engines = ENGINES[:n_engines]
    for k in range(1, shards + 1):
        for live in itertools.combinations(range(shards), k):
            sets = owners(engines, shards, set(live))
            flat = [e for owned in sets.values() for e in owned]
            assert sorted(flat) == sorted(engines), (live, sets)  # each engine exactly once


@pytest.mark.parametrize(("shards", "n_engines"), [(2, 2), (2, 5), (3, 12), (4, 6), (8, 12)])
def test_steady_state_is_as_even_as_the_counts_allow(shards: int, n_engines: int) -> None:
    sets = owners(ENGINES[:n_engines], shards, set(range(shards)))
    sizes = [len(v) for v in sets.values()]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("shards", [2, 3, 4, 8])
def test_a_lost_shard_moves_only_its_engines_and_its_return_moves_them_back(shards: int) -> None:
    everyone = set(range(shards))
    steady = owners(ENGINES, shards, everyone)
    for dead in range(shards):
        after = owners(ENGINES, shards, everyone - {dead})
        for s, owned in after.items():
            assert set(steady[s]) <= set(owned)  # nobody lost an engine it had
            assert set(owned) - set(steady[s]) <= set(steady[dead])  # gains are the dead shard's only
        assert owners(ENGINES, shards, everyone) == steady  # the return restores it exactly


def test_a_dead_shards_engines_spread_over_the_survivors() -> None:
    # 4 shards x 6 engines each: rendezvous weights spread shard 0's six over the other three.
    engines = [f"http://10.1.0.{i}:8000" for i in range(24)]
    takers = {engine_owner(i, e, 4, {1, 2, 3}) for i, e in enumerate(engines) if i % 4 == 0}
    assert len(takers) >= 2


def test_no_live_shard_owns_nothing() -> None:
    assert engine_owner(0, ENGINES[0], 3, set()) is None


@pytest.mark.parametrize(("hostname", "index"), [
    ("pool-router-0", 0), ("pool-router-12.pool-router-shards.ns.svc.cluster.local", 12),
    ("pool-router", None), ("laptop", None),
])
def test_index_from_hostname(hostname: str, index: int | None) -> None:
    assert index_from_hostname(hostname) == index


def test_peer_liveness_needs_consecutive_results() -> None:
    peers = PeerLiveness(3, 0)
    assert peers.live() == {0, 1, 2}  # peers start live: a restarted shard owns its share at once
    assert not peers.record(1, False, down_after=2, up_after=2, error="refused")
    assert not peers.record(1, True, down_after=2, up_after=2)  # the streak restarts
    assert not peers.record(1, False, down_after=2, up_after=2, error="refused")
    assert peers.record(1, False, down_after=2, up_after=2, error="refused")
    assert peers.live() == {0, 2}
    assert peers.last_error(1) == "refused"
    assert not peers.record(1, True, down_after=2, up_after=2)
    assert peers.record(1, True, down_after=2, up_after=2)
    assert peers.live() == {0, 1, 2}
    assert not peers.record(0, False, down_after=1, up_after=1)  # itself is not a peer


def test_a_pool_wide_answer_asks_the_live_peers_and_names_the_rest_down() -> None:
    peers = PeerLiveness(4, 1)
    peers.record(2, False, down_after=1, up_after=1, error="refused")
    assert peers.live_peers() == [0, 3]
    assert peers.detail({1: "ok", 3: "unreachable: refused", 0: "ok"}) == {
        "0": "ok", "1": "ok", "2": SHARD_DOWN, "3": "unreachable: refused"}


# ---- one router app as a shard --------------------------------------------------------------


def shard_config(urls: list[str], peers: int | list[str], **probes: object) -> RouterConfig:
    peer_urls = peers if isinstance(peers, list) else [f"http://127.0.0.1:{9100 + i}" for i in range(peers)]
    return router_config(urls, shards={"peers": peer_urls, **probes})


@pytest.fixture
async def engines() -> AsyncIterator[list[FakeEngine]]:
    started = [FakeEngine(f"e{i}") for i in range(5)]
    for e in started:
        await e.start()
    yield started
    for e in started:
        await e.close()


async def test_a_shard_admits_only_on_its_engines_and_takes_over_a_dead_peers(
    engines: list[FakeEngine],
) -> None:
    urls = [e.url for e in engines[:4]]
    # The peer is anything answering /health (an engine's), probed once at start and then not
    # again within the test, which drives liveness through peer_checked.
    config = shard_config(urls, [engines[4].url, "http://127.0.0.1:9101"], peer_probe_interval_s=3600.0)
    server = await start_service(create_app(config, admin_token="t", shard_index=1))
    state: RouterState = server.app[STATE]
    try:
        mine = [urls[1], urls[3]]
        assert state.registry.ids() == mine
        await state.wait_until(lambda: state.registry.healthy_count() == 2, WAIT_S)
        async with aiohttp.ClientSession() as http:
            for _ in range(4):
                async with http.post(server.url + '/v1/completions',
                                     json={"model": MODEL, "prompt": [1], "max_tokens": 2},
                                     headers={"X-Rollout-Class": "rlvr"}) as resp:
                    assert resp.status == 200
                    assert resp.headers[SHARD_HEADER] == "1"
                    assert resp.headers["X-Misat-Engine"] in mine
            async with http.get(server.url + '/status') as resp:
                shard = (await resp.json())["shard"]
        assert shard == {"index": 1, "count": 2, "live": [0, 1], "owned_engines": mine, "handing_back": [],
                         "known_engines": 4}
        assert engines[0].generations == engines[2].generations == 0

        state.peer_checked(0, False, "refused")
        state.peer_checked(0, False, "refused")  # peer_down_after_failures (2)
        assert sorted(state.registry.ids()) == sorted(urls)
        await state.wait_until(lambda: state.registry.healthy_count() == 4, WAIT_S)
        state.peer_checked(0, True)  # peer_up_after_successes (1): its engines go back
        assert state.registry.ids() == mine
    finally:
        await server.stop()


async def test_a_returning_peers_engines_finish_this_shards_sessions_before_they_go(
    engines: list[FakeEngine],
) -> None:
    urls = [e.url for e in engines[:4]]
    # Peer 0 refuses connections (its one probe at start fails, which alone moves nothing);
    # the test drives its liveness through peer_checked. A small footprint prior lets every
    # engine take three sessions once its first scrape reports its 1,024 tokens of KV (the
    # default prior allows one, and four before that scrape): the eight sessions below then
    # fit whenever the scrapes land, on a loaded machine too.
    config = router_config(urls, policy=None, policy_settings={"footprint": {"bootstrap_tokens": 256}}, shards={
        "peers": ["http://127.0.0.1:1", "http://127.0.0.1:9101"], "peer_probe_interval_s": 3600.0})
    server = await start_service(create_app(config, admin_token="t", shard_index=1))
    state: RouterState = server.app[STATE]
    mine, theirs = {urls[1], urls[3]}, {urls[0], urls[2]}

    async def turn(http: aiohttp.ClientSession, sid: str, t: int, end: bool = False,
                   workload_class: str = "agentic", context_of: str | None = None) -> str:
        # Each turn's prompt extends the last (an agent's context): the session's prefix is on
        # the engine that served it. ``context_of``: the prompt of another session's turn.
        prompt = [int((context_of or sid)[1:]) * 1000 + i for i in range(64 * (t + 1))]
        headers = {"X-Rollout-Class": workload_class, "X-Session-Id": sid, "X-Session-Turn": str(t)}
        if end:
            headers["X-Session-End"] = "1"
        async with http.post(server.url + "/v1/completions", headers=headers,
                             json={"model": MODEL, "prompt": prompt, "max_tokens": 2}) as resp:
            assert resp.status == 200, await resp.text()
            return resp.headers["X-Misat-Engine"]

    try:
        state.peer_checked(0, False, "refused")
        state.peer_checked(0, False, "refused")  # down: all four are this shard's
        await state.wait_until(lambda: state.registry.healthy_count() == 4, WAIT_S)
        async with aiohttp.ClientSession() as http:
            placed = {f"s{k}": await turn(http, f"s{k}", 0) for k in range(8)}
            on_theirs = {sid: e for sid, e in placed.items() if e in theirs}
            assert on_theirs, placed  # the takeover put sessions on the peer's engines

            state.peer_checked(0, True)  # back: its engines are handed back, with a drain
            assert state.registry.owned_ids() == [urls[1], urls[3]]
            assert state.registry.handing_back == set(on_theirs.values())
            for sid, engine in on_theirs.items():  # continuations finish where their KV is
                assert await turn(http, sid, 1) == engine
            for sid, engine in placed.items():  # the sessions on its own engines end (room for more)
                if engine in mine:
                    await turn(http, sid, 1, end=True)
            for k, sid in enumerate(on_theirs, start=20):
                # A new session goes to this shard's own engines, even one whose prompt is
                # cached only on an engine being handed back.
                assert await turn(http, f"s{k}", 1, end=True, context_of=sid) in mine
                assert await turn(http, f"s{k + 10}", 1, workload_class="rlvr", context_of=sid) in mine
            async with http.get(server.url + "/status") as resp:
                body = await resp.json()
            assert body["shard"]["owned_engines"] == [urls[1], urls[3]]
            assert body["shard"]["handing_back"] == sorted(set(on_theirs.values()))
            assert {e["id"] for e in body["engines"] if e["handing_back"]} == set(on_theirs.values())
            assert {row["engine"] for row in body["kv"]} == mine  # budgets: the owner's to report
            assert body["healthy_engines"] == 2

            for sid in on_theirs:  # the sessions end: the drain is over and the engines go (next epoch)
                await turn(http, sid, 2, end=True)
            await state.wait_until(lambda: not state.registry.handing_back, WAIT_S)
            assert state.registry.ids() == [urls[1], urls[3]]
            async with http.get(server.url + "/metrics") as resp:
                metrics = await resp.text()
        # Both of the peer's engines went back and drained: one with none of this shard's
        # sessions at once, one with them when the last ended.
        assert f'misat_engine_hand_backs_total{{outcome="drained"}} {float(len(theirs))}' in metrics
    finally:
        await server.stop()


async def test_shard_settings_are_checked_at_start_and_on_reload(engines: list[FakeEngine]) -> None:
    urls = [e.url for e in engines[:4]]
    with pytest.raises(ConfigError, match=r"shard index 2 is not one of the 2 shards\.peers"):
        RouterState(shard_config(urls, 2), admin_token=None, shard_index=2)
    with pytest.raises(ConfigError, match="no shard index"):
        RouterState(shard_config(urls, 2), admin_token=None)
    state = RouterState(shard_config(urls, 3), admin_token=None, shard_index=2)
    plain = router_config(urls, generation=2)
    with pytest.raises(ConfigRejected, match="'shards' cannot be added or removed"):
        state.apply_config(plain, "test")
    with pytest.raises(ConfigRejected, match="shard index 2 is not one of the 2"):
        state.apply_config(shard_config(urls, 2).model_copy(update={"generation": 2}), "test")
    grown = shard_config(urls, 4).model_copy(update={"generation": 2})
    state.apply_config(grown, "test")
    assert state.peers is not None and state.peers.live() == {0, 1, 2, 3}
    assert state.registry.ids() == [urls[2]]


def test_an_unsharded_router_is_unchanged(engines: list[FakeEngine]) -> None:
    urls = [e.url for e in engines[:4]]
    state = RouterState(router_config(urls), admin_token=None, shard_index=5)  # ignored without shards
    assert state.shard_index is None and state.peers is None
    assert state.registry.ids() == urls
    assert state.status().shard is None


def test_misat_router_takes_its_index_from_the_hostname_or_refuses_to_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    config = shard_config(["http://127.0.0.1:9"], 3)
    path = tmp_path / "router.json"
    path.write_text(config.model_dump_json())
    monkeypatch.setattr(server.socket, "gethostname", lambda: "laptop")
    assert server.main(["--config", str(path), "--port", "0"]) == server.EXIT_CONFIG
    assert "no shard index" in capsys.readouterr().err
    monkeypatch.setattr(server.socket, "gethostname", lambda: "pool-router-7")
    assert server.main(["--config", str(path), "--port", "0"]) == server.EXIT_CONFIG
    assert "shard index 7 is not one of the 3 shards.peers" in capsys.readouterr().err


async def test_an_admin_call_a_peer_cannot_apply_is_a_502_naming_it(engines: list[FakeEngine]) -> None:
    urls = [e.url for e in engines[:4]]
    # Peer 0 answers /health (it is an engine) but has no admin API: the pause cannot reach it.
    config = shard_config(urls, [engines[4].url, "http://127.0.0.1:9101"], peer_probe_interval_s=3600.0)
    server = await start_service(create_app(config, admin_token="t", shard_index=1))
    state: RouterState = server.app[STATE]
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(server.url + "/admin/pause") as resp:
                assert resp.status == 401  # refused here: nothing is sent on without the token
            async with http.post(server.url + "/admin/pause", headers={"Authorization": "Bearer t"}) as resp:
                body = await resp.json()
        assert resp.status == 502 and body["error"]["code"] == "shard_fanout_failed"
        assert "shard 0 answered 404" in body["error"]["message"]
        assert body["shards"]["1"] == "ok" and body["shards"]["0"].startswith("answered 404")
        assert state.runner.paused  # this shard applied it; the caller repeats the call
    finally:
        await server.stop()


async def test_status_scope_is_checked_and_an_unsharded_router_is_its_own_pool(engines: list[FakeEngine]) -> None:
    server = await start_service(create_app(router_config([engines[0].url]), admin_token=None))
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(server.url + "/status", params={"scope": "pool"}) as resp:
                body = await resp.json()
                assert resp.status == 200 and "shards" not in body and body["shard"] is None
            async with http.get(server.url + "/status", params={"scope": "cluster"}) as resp:
                error = (await resp.json())["error"]
                assert resp.status == 400 and error["param"] == "scope" and "'cluster'" in error["message"]
    finally:
        await server.stop()


async def pool_view(url: str) -> dict[str, object]:
    async with aiohttp.ClientSession() as http, http.get(url + "/status", params={"scope": "pool"}) as resp:
        assert resp.status == 200
        body: dict[str, object] = await resp.json()
        return body


async def test_a_pool_status_names_a_live_peer_that_did_not_answer(engines: list[FakeEngine]) -> None:
    urls = [e.url for e in engines[:4]]
    # Peer 0 is live by its /health (an engine's) but has no /status: the pool view lacks it.
    config = shard_config(urls, [engines[4].url, "http://127.0.0.1:9101"], peer_probe_interval_s=3600.0)
    server = await start_service(create_app(config, admin_token=None, shard_index=1))
    state: RouterState = server.app[STATE]
    try:
        pool = await pool_view(server.url)
        assert pool["ready"] is False
        assert pool["shards"]["1"] == "ok" and pool["shards"]["0"].startswith("answered 404")
        assert sorted(e["id"] for e in pool["engines"]) == sorted([urls[1], urls[3]])
        state.peer_checked(0, False, "refused")
        state.peer_checked(0, False, "refused")  # down: its engines are this shard's now
        pool = await pool_view(server.url)
        assert pool["shards"]["0"].startswith("down") and len(pool["engines"]) == 4
    finally:
        await server.stop()


def test_merged_pause_answers_join_the_frozen_engines_and_sum_the_counts() -> None:
    def answer(frozen: list[str], in_flight: int) -> dict:
        return {"paused": True, "mode": "keep", "requests_in_flight": in_flight, "held_requests": 1,
                "aborted_requests": 0, "frozen_engines": frozen, "prefix_cache_reset": None}

    merged = merge_pause([answer(["http://e2"], 2), answer(["http://e1", "http://e3"], 3), answer([], 0)])
    assert merged["frozen_engines"] == ["http://e1", "http://e2", "http://e3"]
    assert merged["requests_in_flight"] == 5 and merged["held_requests"] == 3 and merged["paused"] is True
