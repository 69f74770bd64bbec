"""Router shards behind the real HAProxy: session stability, a shard killed under load, its return.

Three ``misat router`` processes (``misat_cli.shards``, as ``misat up --shards 3`` runs them)
in front of six fake engines, behind ``haproxy`` with the operator's rendered configuration;
the official ``openai`` client talks to the proxy. Every answer names its shard
(``X-Misat-Shard``) and engine (``X-Misat-Engine``), so the tests count shard changes per
session and check each answer came from an engine its shard owns.

HAProxy comes from ``scripts/system-packages.sh`` (``make test`` runs it).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx2
import openai
import pytest
from rich.console import Console

from misat_cli.shards import ShardSet, shard_set
from misat_cli.status import fetch_status, render_status
from misat_router.sharding import SHARD_HEADER
from tests.support.fake_engine import FakeEngine
from tests.support.router_config import MODEL, router_config

WAIT_S = 20.0
"""Bound of every wait (shard start-up on a shared 2-core machine included)."""
N_ENGINES, N_SHARDS = 6, 3
PEER_PROBES = {"peer_probe_interval_s": 0.1, "peer_probe_timeout_s": 0.5, "peer_down_after_failures": 2}
HANDBACK_IDLE_S = 8.0
"""Quiet time after which a survivor hands back an engine whose sessions moved (the project default
is a minute; the test's turns follow each other within it, on a shared 2-core machine included)."""
POLL_S = 0.05
"""Spacing of the bounded polls of what only shows in answers (the proxy's view of a shard)."""


class Attempts:
    """Counts HTTP attempts the client library made (its own retries, were any allowed, included)."""

    def __init__(self) -> None:
        self.n = 0

    async def hook(self, request: httpx2.Request) -> None:
        self.n += 1


@contextlib.asynccontextmanager
async def fake_engines(**engine_args: Any) -> AsyncIterator[list[FakeEngine]]:
    started = [FakeEngine(f"e{i}", **engine_args) for i in range(N_ENGINES)]
    for e in started:
        await e.start()
    try:
        yield started
    finally:
        for e in started:
            await e.close()


@pytest.fixture
async def engines() -> AsyncIterator[list[FakeEngine]]:
    async with fake_engines() as started:
        yield started


@pytest.fixture
async def shards(engines: list[FakeEngine], tmp_path: Path) -> AsyncIterator[ShardSet]:
    config = router_config([e.url for e in engines], hold_deadline_s=15.0)
    async with shard_set(config, N_SHARDS, tmp_path, admin_token="t", proxy_log=True, **PEER_PROBES) as s:
        yield s


async def shard_statuses(s: ShardSet, only: list[int] | None = None) -> dict[int, dict[str, Any]]:
    out = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as http:
        for i, url in enumerate(s.shard_urls):
            if only is not None and i not in only:
                continue
            async with http.get(f"{url}/status") as resp:
                out[i] = (await resp.json())["shard"]
    return out


async def wait_ownership(s: ShardSet, live: list[int], timeout_s: float = WAIT_S) -> dict[int, list[str]]:
    """Wait (bounded) until every shard of ``live`` sees exactly ``live`` alive; their owned sets."""
    async with asyncio.timeout(timeout_s):
        while True:
            st = await shard_statuses(s, live)
            if all(v["live"] == live for v in st.values()):
                return {i: v["owned_engines"] for i, v in st.items()}
            await asyncio.sleep(POLL_S)  # bounded poll of another process's view


async def wait_placeable(s: ShardSet, live: list[int], timeout_s: float = WAIT_S) -> None:
    """Wait (bounded) until every shard of ``live`` has checked and scraped every engine it owns: a
    shard places new sessions only on engines it knows healthy and has a KV capacity for, and one
    taken over from a dead shard gets both a probe and a scrape later (later still on a busy machine)."""
    async with asyncio.timeout(timeout_s):
        while True:
            placeable = True
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as http:
                for i in live:
                    async with http.get(f"{s.shard_urls[i]}/status") as resp:
                        st = await resp.json()
                    rows = {e["id"]: e for e in st["engines"]}
                    placeable = placeable and all(
                        e in rows and rows[e]["healthy"] and rows[e]["kv_capacity_tokens"] > 0
                        for e in st["shard"]["owned_engines"])
            if placeable:
                return
            await asyncio.sleep(POLL_S)  # bounded poll of other processes' views


def client(s: ShardSet, attempts: Attempts, max_retries: int = 0) -> openai.AsyncOpenAI:
    """The official client through the proxy; no retries of its own by default, so every answer
    is the proxy's and the shards' doing."""
    http = httpx2.AsyncClient(event_hooks={"request": [attempts.hook]}, timeout=30.0)
    return openai.AsyncOpenAI(base_url=f"{s.proxy_url}/v1", api_key="none", max_retries=max_retries,
                              http_client=http)


async def turn(c: openai.AsyncOpenAI, sid: str, t: int) -> tuple[int, str]:
    raw = await c.completions.with_raw_response.create(
        model=MODEL, prompt=[1, 2, 3, t], max_tokens=2,
        extra_headers={"X-Rollout-Class": "agentic", "X-Session-Id": sid, "X-Session-Turn": str(t)},
    )
    assert raw.parse().choices[0].text
    return int(raw.headers[SHARD_HEADER]), raw.headers["X-Misat-Engine"]


def changes(seq: list[int]) -> int:
    return sum(1 for a, b in itertools.pairwise(seq) if a != b)


async def test_sessions_stay_on_their_shard_and_shards_use_only_their_engines(
    shards: ShardSet, engines: list[FakeEngine]
) -> None:
    owned = await wait_ownership(shards, [0, 1, 2])
    assert sorted(e for v in owned.values() for e in v) == sorted(e.url for e in engines)
    attempts = Attempts()
    c = client(shards, attempts)
    seen: dict[str, list[int]] = defaultdict(list)
    wrong_engine: list[tuple[int, str]] = []

    async def session(k: int) -> None:
        for t in range(5):
            shard, engine = await turn(c, f"s{k}", t)
            seen[f"s{k}"].append(shard)
            if engine not in owned[shard]:
                wrong_engine.append((shard, engine))

    await asyncio.gather(*(session(k) for k in range(40)))
    assert sum(changes(v) for v in seen.values()) == 0  # counted: no session changed shard
    assert {v[0] for v in seen.values()} == {0, 1, 2}  # the hash spread the sessions
    assert wrong_engine == []
    assert attempts.n == 200  # no retry was needed

    # Without a session id the proxy balances round robin.
    no_session = []
    for _ in range(9):
        raw = await c.completions.with_raw_response.create(
            model=MODEL, prompt=[1], max_tokens=1, extra_headers={"X-Rollout-Class": "rlvr"})
        no_session.append(int(raw.headers[SHARD_HEADER]))
    assert sorted(set(no_session)) == [0, 1, 2]
    await c.close()

    # `misat status` through the proxy: the whole pool, whichever shard answers.
    pool = await fetch_status(shards.proxy_url)
    assert pool["shards"] == {"0": "ok", "1": "ok", "2": "ok"}
    assert sorted(e["id"] for e in pool["engines"]) == sorted(e.url for e in engines)
    by_class = {c["name"]: c for c in pool["classes"]}
    assert by_class["agentic"]["active_sessions"] == 40 and by_class["rlvr"]["completed_units"] == 9
    console = Console(width=250, record=True)
    console.print(render_status(pool))
    assert "0: ok; 1: ok; 2: ok" in console.export_text()
    one = await fetch_status(shards.proxy_url, "shard")  # --shard: the answering shard's view only
    assert "shards" not in one and len(one["engines"]) == len(owned[one["shard"]["index"]])


async def admin(http: aiohttp.ClientSession, url: str, path: str) -> tuple[int, dict[str, Any]]:
    async with http.post(url + path, headers={"Authorization": "Bearer t"}) as resp:
        return resp.status, await resp.json()


async def paused(s: ShardSet) -> dict[int, bool]:
    out = {}
    async with aiohttp.ClientSession() as http:
        for i, url in enumerate(s.shard_urls):
            async with http.get(f"{url}/status") as resp:
                out[i] = (await resp.json())["paused"]
    return out


async def test_admin_calls_through_the_proxy_reach_every_live_shard(
    shards: ShardSet, engines: list[FakeEngine]
) -> None:
    await wait_ownership(shards, [0, 1, 2])
    async with aiohttp.ClientSession() as http:
        status, body = await admin(http, shards.proxy_url, "/admin/pause")
        assert status == 200 and body["paused"] is True
        assert body["shards"] == {"0": "ok", "1": "ok", "2": "ok"}
        assert await paused(shards) == {0: True, 1: True, 2: True}
        # An engine call reaches every engine once: each shard calls the engines it owns.
        status, body = await admin(http, shards.proxy_url, "/admin/engines/reset_prefix_cache")
        assert status == 200 and sorted(body["engines"]) == sorted(e.url for e in engines)
        assert all(r["status"] == 200 for r in body["engines"].values())
        status, body = await admin(http, shards.proxy_url, "/admin/resume?weight_version=v2")
        assert status == 200 and body["paused"] is False
        assert await paused(shards) == {0: False, 1: False, 2: False}

        # A dead shard is skipped (its engines are the live shards' now), and said so.
        shards.kill_shard(2)
        owned = await wait_ownership(shards, [0, 1])
        status, body = await admin(http, shards.proxy_url, "/admin/engines/reset_prefix_cache")
        assert status == 200 and body["shards"]["2"].startswith("down")
        assert sorted(body["engines"]) == sorted(e.url for e in engines) == sorted(owned[0] + owned[1])
    pool = await fetch_status(shards.proxy_url)  # its engines are in the live shards' views
    assert pool["shards"]["0"] == pool["shards"]["1"] == "ok" and pool["shards"]["2"].startswith("down")
    assert sorted(e["id"] for e in pool["engines"]) == sorted(e.url for e in engines)


async def test_a_shard_killed_under_load_loses_no_request_and_its_return_reattaches(
    shards: ShardSet, engines: list[FakeEngine]
) -> None:
    steady = await wait_ownership(shards, [0, 1, 2])
    attempts = Attempts()
    c = client(shards, attempts)
    seen: dict[str, list[int]] = defaultdict(list)
    answered = 0
    enough = asyncio.Event()
    killed = asyncio.Event()
    after_kill: dict[str, list[int]] = defaultdict(list)
    n_sessions, n_turns = 30, 12

    async def session(k: int) -> None:
        nonlocal answered
        sid = f"k{k}"
        for t in range(n_turns):
            was_killed = killed.is_set()
            shard, _ = await turn(c, sid, t)
            seen[sid].append(shard)
            if was_killed:
                after_kill[sid].append(shard)
            answered += 1
            if answered >= n_sessions * 3:
                enough.set()

    load = asyncio.gather(*(session(k) for k in range(n_sessions)), return_exceptions=True)
    async with asyncio.timeout(WAIT_S):
        await enough.wait()
    shards.kill_shard(1)
    killed.set()
    results = await load
    errors = [r for r in results if isinstance(r, BaseException)]
    assert errors == []  # counted: every request got an answer
    assert answered == n_sessions * n_turns
    on_one = [sid for sid, v in seen.items() if v[0] == 1]
    assert on_one, "the hash put no session on shard 1"
    for sid, v in seen.items():
        if v[0] != 1:
            assert changes(v) == 0, (sid, v)  # other shards' sessions did not move
    moved = [sid for sid in on_one if after_kill[sid] and 1 not in after_kill[sid]]
    assert moved  # shard 1's sessions continued elsewhere
    assert attempts.n == answered  # max_retries=0: the proxy's retries alone answered them all
    redispatched = shards.redispatched()

    # Its engines were re-homed on the survivors, who keep their own.
    rehomed = await wait_ownership(shards, [0, 2])
    assert sorted(rehomed[0] + rehomed[2]) == sorted(e.url for e in engines)
    assert set(steady[0]) <= set(rehomed[0]) and set(steady[2]) <= set(rehomed[2])

    # Restarted, it re-attaches: its engines come back, and so do its sessions.
    await shards.start_shard(1)
    assert await wait_ownership(shards, [0, 1, 2]) == steady
    sid = on_one[0]
    async with asyncio.timeout(WAIT_S):
        t = n_turns
        while (await turn(c, sid, t))[0] != 1:  # until the proxy's health check sees it up
            t += 1
            await asyncio.sleep(POLL_S)
    await c.close()
    print(f"shard kill: {answered} requests answered, 0 lost, {len(moved)} of {len(on_one)} sessions of "
          f"shard 1 moved, {redispatched} requests redispatched by the proxy, 0 client retries")


@pytest.fixture
async def roomy_engines() -> AsyncIterator[list[FakeEngine]]:
    """Engines with room for a few dozen agentic sessions (the default fake engine holds 1K tokens)."""
    async with fake_engines(num_gpu_blocks=1 << 16) as started:
        yield started


@pytest.fixture
async def cache_shards(roomy_engines: list[FakeEngine], tmp_path: Path) -> AsyncIterator[ShardSet]:
    """Shards running the project's default policy, which keeps a session's turns where its
    prefix is cached (the fixture above runs round-robin, which has no such affinity)."""
    config = router_config([e.url for e in roomy_engines], policy=None, hold_deadline_s=15.0)
    async with shard_set(config, N_SHARDS, tmp_path, admin_token="t", handback_idle_s=HANDBACK_IDLE_S,
                         **PEER_PROBES) as s:
        yield s


async def context_turn(c: openai.AsyncOpenAI, k: int, t: int, end: bool = False) -> tuple[int, str]:
    """Turn ``t`` of agentic session ``k``: its prompt extends the last turn's (the session's
    prefix is cached where it ran)."""
    headers = {"X-Rollout-Class": "agentic", "X-Session-Id": f"r{k}", "X-Session-Turn": str(t)}
    if end:
        headers["X-Session-End"] = "1"
    raw = await c.completions.with_raw_response.create(
        model=MODEL, prompt=[k * 1000 + i for i in range(64 * (t + 1))], max_tokens=2, extra_headers=headers)
    return int(raw.headers[SHARD_HEADER]), raw.headers["X-Misat-Engine"]


async def test_a_returning_shard_takes_its_engines_back_without_moving_the_survivors_sessions(
    cache_shards: ShardSet,
) -> None:
    s = cache_shards
    steady = await wait_ownership(s, [0, 1, 2])
    s.kill_shard(1)
    await wait_ownership(s, [0, 2])
    await wait_placeable(s, [0, 2])  # else new sessions may all avoid the engines just taken over
    c = client(s, Attempts())
    n = 24
    # Sessions that start while shard 1 is down, over the survivors' engines (its own among them).
    before = await asyncio.gather(*(context_turn(c, k, 0) for k in range(n)))
    again = await asyncio.gather(*(context_turn(c, k, 1) for k in range(n)))
    assert again == before  # the policy keeps each session's turns on its engine

    await s.start_shard(1)
    assert await wait_ownership(s, [0, 1, 2]) == steady  # its engines are its own again
    theirs = set(steady[1])
    after = await asyncio.gather(*(context_turn(c, k, 2) for k in range(n)))
    # A survivor's session (its shard did not change) kept its engine, even one of shard 1's:
    # the survivor hands those back only once its sessions there are done.
    stayed = [k for k in range(n) if after[k][0] == before[k][0]]
    kept_there = [k for k in stayed if before[k][1] in theirs]
    assert kept_there, (before, after)  # not vacuous: sessions continued on a handed-back engine
    assert [k for k in stayed if after[k][1] != before[k][1]] == []
    draining = await shard_statuses(s, [0, 2])
    handing_back = {e for v in draining.values() for e in v["handing_back"]}
    # Every engine a survivor's session stayed on is being handed back (and only shard 1's are; one
    # may also hold sessions that moved back to shard 1 and so have stopped arriving).
    assert {before[k][1] for k in kept_there} <= handing_back <= theirs

    await asyncio.gather(*(context_turn(c, k, 3, end=True) for k in range(n)))
    # The survivors' sessions ended; those that moved to shard 1 just stop arriving: the drains end
    # (HANDBACK_IDLE_S after those sessions' last turns there) and the engines go.
    async with asyncio.timeout(WAIT_S):
        while any(v["handing_back"] for v in (await shard_statuses(s, [0, 2])).values()):
            await asyncio.sleep(POLL_S)  # bounded poll of other processes' views
    await c.close()
    print(f"shard return: {len(stayed)} of {n} sessions stayed on their shard, {len(kept_there)} of them "
          f"on the returning shard's engines; 0 changed engine")
