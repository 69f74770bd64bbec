"""Session lifecycle against a live router: labels on every request, turns counted, the session
ended on exit and on error, held requests retried after Retry-After, bounded."""

from __future__ import annotations

import asyncio

import openai
import pytest

from misat_client import AsyncRolloutSession, HeldTooLong, HoldRetry, RolloutSession, SessionEnded
from misat_client.errors import RouterHTTPError

from .conftest import Pool, PoolFactory

HOLD = {"hold_deadline_s": 0.2, "hold_retry_after_s": 2}
"""A short hold deadline, and a Retry-After the tests can tell from any default."""


def header(pool: Pool, i: int, name: str) -> str | None:
    """Header ``name`` of the ``i``-th request the engine got (HTTP header names are case-blind)."""
    return {k.lower(): v for k, v in pool.fakes[0].headers[i].items()}.get(name.lower())


def labels_seen(pool: Pool) -> list[tuple[str | None, str | None, str | None]]:
    return [tuple(header(pool, i, n) for n in ("X-Rollout-Class", "X-Session-Id", "X-Session-Turn"))  # type: ignore[misc]
            for i in range(len(pool.fakes[0].headers))]


async def test_turns_are_labelled_counted_and_the_session_ends_on_exit(fake_pool: PoolFactory) -> None:
    pool = await fake_pool()
    async with AsyncRolloutSession(pool.url, "agentic", "traj-1") as s:
        for _ in range(3):
            out = await s.completions(model=pool.model, prompt=[1, 2, 3], max_tokens=2)
            assert out["usage"]["completion_tokens"] == 2
        assert s.turns == 3
        assert pool.live_sessions("agentic") == 1
    assert labels_seen(pool) == [("agentic", "traj-1", str(t)) for t in range(3)]
    # Each turn after the first names the engine of the answer before it (X-Misat-Engine).
    assert [header(pool, i, "X-Session-Engine") for i in range(3)] == [None, pool.engine_urls[0], pool.engine_urls[0]]
    assert s.engine == pool.engine_urls[0]
    assert pool.live_sessions("agentic") == 0
    with pytest.raises(SessionEnded):
        await s.completions(model=pool.model, prompt=[1], max_tokens=1)


async def test_a_failing_block_still_ends_the_session_and_keeps_its_error(fake_pool: PoolFactory) -> None:
    pool = await fake_pool()
    with pytest.raises(KeyError, match="tool crashed"):
        async with AsyncRolloutSession(pool.url, "agentic") as s:
            await s.chat(model=pool.model, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
            assert pool.live_sessions("agentic") == 1
            raise KeyError("tool crashed")
    assert pool.live_sessions("agentic") == 0


async def test_an_unreachable_router_at_exit_is_noted_on_the_blocks_error(fake_pool: PoolFactory) -> None:
    pool = await fake_pool()
    with pytest.raises(KeyError) as err:
        async with AsyncRolloutSession(pool.url, "agentic") as s:
            await s.completions(model=pool.model, prompt=[1], max_tokens=1)
            await pool.server.stop()
            raise KeyError("boom")
    assert any("ending session" in note for note in err.value.__notes__)


async def test_end_reports_whether_the_router_knew_the_session(fake_pool: PoolFactory) -> None:
    pool = await fake_pool()
    async with AsyncRolloutSession(pool.url, "agentic") as s:
        await s.completions(model=pool.model, prompt=[1], max_tokens=1)
        assert await s.end() is True
    async with AsyncRolloutSession(pool.url, "agentic", "never-sent") as unknown:
        assert await unknown.end() is False
    # A last turn sent with end=True ends the session at the router; exit owes nothing.
    async with AsyncRolloutSession(pool.url, "agentic") as last:
        await last.completions(model=pool.model, prompt=[1], max_tokens=1, end=True)
        await pool.wait(lambda: pool.live_sessions("agentic") == 0)
    assert header(pool, -1, "X-Session-End") == "true"


async def test_a_refused_request_raises_the_routers_error_fields(fake_pool: PoolFactory) -> None:
    pool = await fake_pool()
    async with AsyncRolloutSession(pool.url, "no-such-class") as s:
        with pytest.raises(RouterHTTPError) as err:
            await s.completions(model=pool.model, prompt=[1], max_tokens=1)
    assert err.value.status == 400 and err.value.code == "unknown_rollout_class"


async def test_a_held_request_is_retried_after_retry_after(fake_pool: PoolFactory) -> None:
    pool = await fake_pool(**HOLD)
    pool.state.pause()
    waits: list[float] = []

    async def sleep(seconds: float) -> None:  # the retry's wait: record it, let the pool free up
        waits.append(seconds)
        pool.state.resume()

    async with AsyncRolloutSession(pool.url, "rlvr", sleep=sleep) as s:
        out = await s.completions(model=pool.model, prompt=[4, 5], max_tokens=1)
        assert s.turns == 1  # the retry is the same turn
    assert out["choices"][0]["finish_reason"] == "length"
    assert waits == [2.0]
    assert labels_seen(pool) == [("rlvr", s.id, "0")]


async def test_retries_are_bounded(fake_pool: PoolFactory) -> None:
    pool = await fake_pool(**HOLD)
    pool.state.pause()
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    async with AsyncRolloutSession(pool.url, "rlvr", retry=HoldRetry(max_retries=2), sleep=sleep) as s:
        with pytest.raises(HeldTooLong) as err:
            await s.completions(model=pool.model, prompt=[4], max_tokens=1)
    assert waits == [2.0, 2.0] and err.value.attempts == 3 and err.value.code == "hold_deadline_exceeded"
    assert pool.fakes[0].generations == 0


async def test_the_openai_client_carries_the_labels_and_its_held_answers_are_retried(fake_pool: PoolFactory) -> None:
    pool = await fake_pool(**HOLD)
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        pool.state.resume()

    base = openai.AsyncOpenAI(base_url=pool.url + "/v1", api_key="unused")
    async with AsyncRolloutSession(pool.url, "agentic", sleep=sleep) as s:
        client = s.openai(base)
        assert client.max_retries == 0  # the session does the hold retries
        first = await s.create(client.chat.completions.create, model=pool.model,
                               messages=[{"role": "user", "content": "a b c"}], max_tokens=2)
        pool.state.pause()
        second = await s.create(client.completions.create, model=pool.model, prompt=[7, 8], max_tokens=1,
                                extra_headers={"X-Trace": "t1"})
    await base.close()
    assert first.choices[0].message.content and second.choices[0].text
    assert waits == [2.0]
    assert labels_seen(pool) == [("agentic", s.id, "0"), ("agentic", s.id, "1")]
    assert header(pool, -1, "X-Trace") == "t1"
    assert pool.live_sessions("agentic") == 0


async def test_an_sdk_call_with_its_raw_response_names_the_engine_for_the_next_turn(fake_pool: PoolFactory) -> None:
    """The SDK's parsed objects carry no headers; its raw responses do, and the session reads the
    engine from them (the next turn then carries X-Session-Engine)."""
    pool = await fake_pool()
    base = openai.AsyncOpenAI(base_url=pool.url + "/v1", api_key="unused")
    async with AsyncRolloutSession(pool.url, "agentic") as s:
        client = s.openai(base)
        await s.create(client.completions.create, model=pool.model, prompt=[1, 2], max_tokens=1)
        assert s.engine is None  # a parsed answer: no headers to read
        raw = await s.create(client.with_raw_response.completions.create, model=pool.model, prompt=[3],
                             max_tokens=1)
        assert raw.parse().choices[0].text and s.engine == pool.engine_urls[0]
        await s.create(client.completions.create, model=pool.model, prompt=[4], max_tokens=1)
    await base.close()
    assert [header(pool, i, "X-Session-Engine") for i in range(3)] == [None, None, pool.engine_urls[0]]


async def test_the_openai_path_is_bounded_too(fake_pool: PoolFactory) -> None:
    pool = await fake_pool(**HOLD)
    pool.state.pause()
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    base = openai.AsyncOpenAI(base_url=pool.url + "/v1", api_key="unused")
    async with AsyncRolloutSession(pool.url, "rlvr", retry=HoldRetry(max_retries=1), sleep=sleep) as s:
        with pytest.raises(HeldTooLong) as err:
            await s.create(s.openai(base).completions.create, model=pool.model, prompt=[1], max_tokens=1)
    await base.close()
    assert waits == [2.0] and err.value.attempts == 2
    assert isinstance(err.value.__cause__, openai.InternalServerError)


async def test_the_sync_session_behaves_alike(fake_pool: PoolFactory) -> None:
    pool = await fake_pool(**HOLD)
    pool.state.pause()
    loop = asyncio.get_running_loop()
    waits: list[float] = []

    def sleep(seconds: float) -> None:  # runs in the worker thread; the router lives on this loop
        waits.append(seconds)
        loop.call_soon_threadsafe(pool.state.resume)

    def worker() -> tuple[int, str]:
        with RolloutSession(pool.url, "agentic", sleep=sleep) as s:
            s.completions(model=pool.model, prompt=[1, 2], max_tokens=1)
            client = s.openai(openai.OpenAI(base_url=pool.url + "/v1", api_key="unused"))
            s.create(client.completions.create, model=pool.model, prompt=[3], max_tokens=1)
            return s.turns, s.id

    turns, sid = await asyncio.to_thread(worker)
    assert turns == 2 and waits == [2.0]
    assert labels_seen(pool) == [("agentic", sid, "0"), ("agentic", sid, "1")]
    assert pool.live_sessions("agentic") == 0


async def test_the_body_labels_reach_the_router_and_not_the_engine(fake_pool: PoolFactory) -> None:
    pool = await fake_pool()
    async with AsyncRolloutSession(pool.url, "agentic") as s:
        body = s.labelled_body({"model": pool.model, "prompt": [9, 9], "max_tokens": 1})
        assert body["rollout"] == {"class": "agentic", "session_id": s.id, "turn": 0}
        async with __import__("aiohttp").ClientSession() as http, \
                http.post(pool.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
        assert pool.live_sessions("agentic") == 1
    assert "rollout" not in pool.fakes[0].requests[0]
    assert pool.live_sessions("agentic") == 0
