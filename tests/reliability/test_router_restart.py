"""A router restarted mid-run (a new app over the same engines) picks live sessions up again.

The new router knows nothing of the sessions the old one admitted. Their next turns
(turn > 0) must be admitted at once and re-attached to the policy's books, so they count
against the session caps, rather than be treated (and held) as new sessions.

The engines keep every session's KV through the restart, but the new router's prefix index is
empty: placed by cost, a continuation goes wherever is cheapest and computes its whole context
again. ``misat_client`` sessions send the engine of their previous answer
(``X-Session-Engine``), and the new router places each continuation back on it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from misat_client import AsyncRolloutSession

from .conftest import (
    MODEL,
    RouterUnderTest,
    SimEngine,
    assert_drained,
    end_all_sessions,
    gauges,
    router_config,
    start_router,
)

CAP = 2
"""Sessions per engine (max_sessions_per_engine), small so that caps bind."""
POLICY = {"footprint": {"bootstrap_tokens": 256},
          "admission": {"epoch_s": 0.05, "max_sessions_per_engine": CAP, "sessions_before_capacity_known": CAP}}


async def turn(http: aiohttp.ClientSession, r: RouterUnderTest, sid: str, n: int, *, end: bool = False) -> int:
    headers = {"X-Rollout-Class": "agentic", "X-Session-Id": sid, "X-Session-Turn": str(n),
               "X-Session-End": str(end).lower()}
    body = {"model": MODEL, "prompt": [5 + n, 6, 7, 8], "max_tokens": 4, "ignore_eos": True}
    async with http.post(r.url + "/v1/completions", json=body, headers=headers) as resp:
        await resp.read()
        return resp.status


def decisions(metrics_text: str, reason: str) -> float:
    return sum(v for labels, v in gauges(metrics_text)["misat_decisions_total"]
               if labels["reason"] == reason and labels["action"] == "place")


async def start_pool(sim_engines, make_router, **overrides: object) -> tuple[list, RouterUnderTest, object]:
    engines = await sim_engines(2)
    cfg = router_config([e.url for e in engines], policy_settings=POLICY, **overrides)
    return engines, await make_router(cfg), cfg


async def test_restart_reattaches_continuations_and_caps_still_hold(sim_engines, make_router) -> None:
    engines, old, cfg = await start_pool(sim_engines, make_router, hold_deadline_s=0.5)
    sids = [f"traj-{i}" for i in range(2 * CAP)]
    async with aiohttp.ClientSession() as http:
        assert [await turn(http, old, s, 0) for s in sids] == [200] * len(sids)
        assert sum(old.state.runner.policy.engine_sessions.values()) == len(sids)
        await old.close()

        new = await make_router(cfg)
        assert new.state.runner.sessions == {}
        statuses = await asyncio.gather(*(turn(http, new, s, 1) for s in sids))
        assert statuses == [200] * len(sids)  # none held: the hold deadline is 0.5 s
        async with http.get(new.url + "/metrics") as resp:
            text = await resp.text()
        assert decisions(text, "continuation_moved") == len(sids)
        assert 'reason="new_session"' not in text
        policy = new.state.runner.policy
        assert set(new.state.runner.sessions) == set(sids)
        reattached = dict(policy.engine_sessions)
        assert sum(reattached.values()) == len(sids)

        # Caps count the re-attached sessions: new ones only fill what is left per engine.
        room = sum(max(0, CAP - reattached.get(e.url, 0)) for e in engines)
        fresh = await asyncio.gather(*(turn(http, new, f"new-{i}", 0) for i in range(3)))
        assert fresh.count(200) == room and fresh.count(503) == 3 - room, (fresh, reattached)
        for e in engines:
            assert policy.engine_sessions.get(e.url, 0) <= max(CAP, reattached.get(e.url, 0))

        await end_all_sessions(new, http)
        await assert_drained(new, http)


async def test_restart_continuation_not_queued_behind_held_new_sessions(sim_engines, make_router) -> None:
    _, old, cfg = await start_pool(sim_engines, make_router, hold_deadline_s=2.0)
    async with aiohttp.ClientSession() as http:
        assert [await turn(http, old, f"old-{i}", 0) for i in range(2 * CAP)] == [200] * (2 * CAP)
        await old.close()
        new = await make_router(cfg)
        # Fill every engine with new sessions, then one more that must wait.
        assert [await turn(http, new, f"new-{i}", 0) for i in range(2 * CAP)] == [200] * (2 * CAP)
        waiting = asyncio.create_task(turn(http, new, "new-held", 0))
        try:
            await new.wait(lambda: new.state.runner.held_count("agentic") == 1)
            # A session the old router admitted continues: admitted now, not behind "new-held".
            async with asyncio.timeout(1.0):
                assert await turn(http, new, "old-0", 1) == 200
        finally:
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)


SESSIONS = 6
PROMPT_TOKENS = 400
"""Three full KV blocks of the tiny-cpu profile (128 tokens each) and a partial one."""
BLOCK_TOKENS = 128


def prompt(i: int, extra: int = 0) -> list[int]:
    """Session ``i``'s context (distinct per session), ``extra`` tokens longer on a later turn."""
    return [3 + (i * 97 + k) % 2000 for k in range(PROMPT_TOKENS + extra)]


def cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


async def test_a_restarted_router_puts_each_live_session_back_on_its_engine(sim_engines: Any) -> None:
    engines: list[SimEngine] = await sim_engines(3)
    config = router_config([e.url for e in engines])
    first = await start_router(config)
    port = first.server.port
    sessions = [AsyncRolloutSession(first.url, "agentic", f"traj-{i}") for i in range(SESSIONS)]
    try:
        # Turn 0 of every trajectory at once: the router spreads them over the engines.
        await asyncio.gather(*(s.completions(model=MODEL, prompt=prompt(i), max_tokens=8)
                               for i, s in enumerate(sessions)))
        served_by = {s.id: s.engine for s in sessions}
        assert set(served_by.values()) <= {e.url for e in engines} and len(set(served_by.values())) >= 2
    finally:
        await first.close()  # the restart: every session is unknown to the router that comes back

    second = await start_router(config, port=port)  # same address, as a restarted pod behind its Service
    try:
        # Without the hint (a client that does not send it): placed by cost on the cheapest engine,
        # which is not where its KV is, and its whole prompt is computed again.
        cheapest = min(e.url for e in engines)
        i, moved = next((i, s) for i, s in enumerate(sessions) if served_by[s.id] != cheapest)
        async with aiohttp.ClientSession() as http, http.post(
            f"{second.url}/v1/completions",
            headers={"X-Rollout-Class": "agentic", "X-Session-Id": moved.id, "X-Session-Turn": "1"},
            json={"model": MODEL, "prompt": prompt(i, extra=50), "max_tokens": 8},
        ) as resp:
            unhinted = await resp.json()
            assert resp.status == 200 and resp.headers["X-Misat-Engine"] == cheapest
        assert cached(unhinted) == 0

        # With it: every other trajectory's turn 1 goes back to its engine and finds its blocks.
        rest = [(i, s) for i, s in enumerate(sessions) if s is not moved]
        assert second.url == first.url  # the sessions talk to the same address
        answers = await asyncio.gather(*(s.completions(model=MODEL, prompt=prompt(i, extra=50), max_tokens=8,
                                                       end=True) for i, s in rest))
        for (_, s), answer in zip(rest, answers, strict=True):
            assert s.engine == served_by[s.id], s.id
            assert cached(answer) >= (PROMPT_TOKENS // BLOCK_TOKENS) * BLOCK_TOKENS, (s.id, answer["usage"])
        async with aiohttp.ClientSession() as http:
            async with http.get(second.url + "/metrics") as resp:
                decisions = {(labels["reason"]): v for labels, v in gauges(await resp.text())["misat_decisions_total"]
                             if labels["action"] == "place"}
            assert decisions == {"continuation_hinted": len(rest), "continuation_moved": 1}
            await moved.end()
            await assert_drained(second, http)
    finally:
        for s in sessions:
            await s.close()
        await second.close()
