"""The OpenAI endpoints end to end: pass-through, metadata, malformed input, usage."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI

from tests.support.fake_engine import FakeEngine
from tests.support.router_config import MODEL

_open_clients: list[AsyncOpenAI] = []


def client(url: str, **headers: str) -> AsyncOpenAI:
    c = AsyncOpenAI(base_url=url + "/v1", api_key="unused", default_headers=headers, max_retries=0, timeout=10)
    _open_clients.append(c)
    return c


@pytest.fixture(autouse=True)
async def _close_clients() -> AsyncIterator[None]:
    # An unclosed client's transport is finalised later, printing into another test's output.
    yield
    while _open_clients:
        await _open_clients.pop().close()


async def test_completion_body_passes_through_unchanged(engines: list[FakeEngine], make_router) -> None:
    h = await make_router(engines)
    body = {"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 2}
    async with aiohttp.ClientSession() as http:
        async with http.post(engines[0].url + "/v1/completions", json=body) as r:
            direct = await r.read()
        async with http.post(h.url + "/v1/completions", json=body,
                             headers={"X-Rollout-Class": "rlvr"}) as r:
            routed = await r.read()
            assert r.status == 200
            assert r.headers["X-Engine-Name"] in {"a", "b"}
            assert r.headers["X-Misat-Engine"] in {e.url for e in engines}
    assert routed == direct


async def test_sse_stream_relayed_chunk_by_chunk(engines: list[FakeEngine], make_router) -> None:
    h = await make_router(engines[:1])
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession() as http:
        async with http.post(engines[0].url + "/v1/completions", json=body) as r:
            direct = await r.read()
        async with http.post(h.url + "/v1/completions", json=body,
                             headers={"X-Rollout-Class": "rlhf"}) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            routed = await r.read()
    assert routed == direct
    assert routed.count(b"data: ") == 4 + 2  # 4 tokens, the usage chunk, [DONE]


async def test_openai_client_streams_and_usage_reaches_the_runner(
    engines: list[FakeEngine], make_router
) -> None:
    engines[0].cached_tokens = 2
    h = await make_router(engines[:1])
    c = client(h.url, **{"X-Rollout-Class": "rlvr"})
    stream = await c.completions.create(
        model=MODEL, prompt=[1, 2, 3], max_tokens=5, stream=True,
        stream_options={"include_usage": True},
    )
    texts, usage = [], None
    async for chunk in stream:
        texts += [ch.text for ch in chunk.choices]
        usage = chunk.usage or usage
    assert "".join(texts) == "t0 t1 t2 t3 t4 "
    assert usage is not None and usage.completion_tokens == 5
    metrics = h.state.metrics.render().decode()
    assert 'misat_tokens_total{class="rlvr",kind="completion"} 5.0' in metrics
    assert 'misat_tokens_total{class="rlvr",kind="cached"} 2.0' in metrics
    assert 'misat_requests_total{class="rlvr",outcome="ok"} 1.0' in metrics
    assert h.state.runner.mixture.completed["rlvr"] == 1


async def test_stream_without_usage_is_estimated_from_events(
    engines: list[FakeEngine], make_router
) -> None:
    h = await make_router(engines[:1])
    c = client(h.url, **{"X-Rollout-Class": "rlvr"})
    stream = await c.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=3, stream=True)
    async for _ in stream:
        pass
    metrics = h.state.metrics.render().decode()
    assert 'misat_tokens_total{class="rlvr",kind="completion"} 3.0' in metrics
    assert 'misat_tokens_total{class="rlvr",kind="prompt"} 3.0' in metrics


async def test_chat_completion_json_and_stream(engines: list[FakeEngine], make_router) -> None:
    h = await make_router(engines[:1])
    c = client(h.url, **{"X-Rollout-Class": "agentic", "X-Session-Id": "traj-1",
                         "X-Session-Turn": "0"})
    out = await c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=2)
    assert out.choices[0].message.content == "t0 t1"
    assert out.usage is not None and out.usage.prompt_tokens == 2
    # A multi-turn session stays live after its request finished.
    assert h.state.runner.active_sessions() == {"agentic": 1}
    stream = await c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "more"}], max_tokens=2, stream=True)
    deltas = [ch.choices[0].delta.content async for ch in stream if ch.choices]
    assert "".join(d or "" for d in deltas) == "t0 t1 "


async def test_headers_and_body_metadata_reach_the_policy(
    engines: list[FakeEngine], make_router
) -> None:
    h = await make_router(engines[:1])
    async with aiohttp.ClientSession() as http:
        body = {"model": MODEL, "prompt": "a b c",
                "rollout": {"class": "agentic", "session_id": "s-9", "turn": 2}}
        async with http.post(h.url + "/v1/completions", json=body) as r:
            assert r.status == 200
        # The router strips its own field before forwarding.
        assert "rollout" not in engines[0].requests[-1]
        sessions = h.state.runner.sessions
        assert "s-9" in sessions and sessions["s-9"].workload_class == "agentic"
        # An explicit end by header ends it once the request completes.
        async with http.post(h.url + "/v1/completions", json={"model": MODEL, "prompt": "d"},
                             headers={"X-Rollout-Class": "agentic", "X-Session-Id": "s-9",
                                      "X-Session-End": "true"}) as r:
            assert r.status == 200
    assert "s-9" not in h.state.runner.sessions
    assert h.state.runner.mixture.completed["agentic"] == 1


async def test_session_end_endpoint(engines: list[FakeEngine], make_router) -> None:
    h = await make_router(engines[:1])
    c = client(h.url, **{"X-Rollout-Class": "agentic", "X-Session-Id": "t-1"})
    await c.completions.create(model=MODEL, prompt=[1, 2], max_tokens=1)
    async with aiohttp.ClientSession() as http:
        async with http.post(h.url + "/v1/sessions/t-1/end") as r:
            assert r.status == 200 and (await r.json())["ended"] is True
        async with http.post(h.url + "/v1/sessions/t-1/end") as r:
            assert r.status == 404
            assert (await r.json())["error"]["type"] == "not_found_error"
    assert h.state.runner.mixture.completed["agentic"] == 1


@pytest.mark.parametrize(
    ("body", "headers", "param"),
    [
        pytest.param(b"{not json", {"X-Rollout-Class": "rlvr"}, None, id="bad-json"),
        pytest.param(b"[1, 2]", {"X-Rollout-Class": "rlvr"}, None, id="not-object"),
        pytest.param(b'{"prompt": [1]}', {}, "rollout.class", id="missing-class"),
        pytest.param(b'{"prompt": [1]}', {"X-Rollout-Class": "chess"}, "rollout.class",
                     id="unknown-class"),
        pytest.param(b'{"prompt": [1], "max_tokens": 0}', {"X-Rollout-Class": "rlvr"},
                     "max_tokens", id="max-tokens-zero"),
        pytest.param(b'{"prompt": [1], "max_tokens": -3}', {"X-Rollout-Class": "rlvr"},
                     "max_tokens", id="max-tokens-negative"),
        pytest.param(b'{"prompt": []}', {"X-Rollout-Class": "rlvr"}, "prompt", id="empty-prompt"),
        pytest.param(b'{"prompt": [1]}', {"X-Rollout-Class": "rlvr", "X-Session-Turn": "x"},
                     "X-Session-Turn", id="bad-turn"),
    ],
)
async def test_malformed_requests_get_openai_400(
    engines: list[FakeEngine], make_router, body: bytes, headers: dict[str, str], param: str | None
) -> None:
    h = await make_router(engines[:1])
    async with aiohttp.ClientSession() as http, http.post(h.url + "/v1/completions", data=body,
                         headers={"Content-Type": "application/json", **headers}) as r:
        assert r.status == 400
        err = (await r.json())["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert err["message"]
    assert engines[0].requests == []


async def test_openai_client_sees_bad_request_error(engines: list[FakeEngine], make_router) -> None:
    h = await make_router(engines[:1])
    with pytest.raises(openai.BadRequestError) as info:
        await client(h.url).completions.create(model=MODEL, prompt=[1], max_tokens=1)
    assert info.value.body["type"] == "invalid_request_error"  # type: ignore[index]
    assert info.value.body["code"] == "missing_rollout_class"  # type: ignore[index]


async def test_default_class_labels_unlabelled_traffic(engines: list[FakeEngine], make_router) -> None:
    h = await make_router(engines[:1], workloads={
        "classes": [{"name": "rlvr", "share": 100}], "default_class": "rlvr"})
    await client(h.url).completions.create(model=MODEL, prompt=[1], max_tokens=1)
    assert h.state.runner.mixture.completed == {"rlvr": 1}


async def test_body_too_large_is_413(engines: list[FakeEngine], make_router) -> None:
    h = await make_router(engines[:1], max_body_bytes=1024)
    async with aiohttp.ClientSession() as http:
        body = json.dumps({"prompt": "x" * 4096}).encode()
        async with http.post(h.url + "/v1/completions", data=body,
                             headers={"X-Rollout-Class": "rlvr"}) as r:
            assert r.status == 413
            assert (await r.json())["error"]["type"] == "invalid_request_error"


async def test_models_and_tokenize_pass_through(engines: list[FakeEngine], make_router) -> None:
    h = await make_router(engines)
    models = await client(h.url).models.list()
    assert [m.id for m in models.data] == [MODEL]
    body = {"model": MODEL, "prompt": "a b c"}
    async with aiohttp.ClientSession() as http, http.post(h.url + "/tokenize", json=body) as r:
        assert r.status == 200
        assert (await r.json())["count"] == 3


async def test_engine_error_status_passes_through(engines: list[FakeEngine], make_router) -> None:
    engines[0].fail_status = 400
    h = await make_router(engines[:1])
    async with aiohttp.ClientSession() as http, http.post(
        h.url + "/v1/completions", json={"prompt": [1], "max_tokens": 1},
        headers={"X-Rollout-Class": "rlvr"},
    ) as r:
        assert r.status == 400
        assert (await r.json())["message"] == "engine says no"
    assert h.state.dispatcher.in_flight == {}
    assert h.state.runner.mixture.total == 0  # a failed single-request session is no unit
    metrics = h.state.metrics.render().decode()
    assert 'misat_requests_total{class="rlvr",outcome="engine_error"} 1.0' in metrics


async def test_a_multi_turn_request_without_a_session_id_is_served_with_a_warning(
    engines: list[FakeEngine], make_router
) -> None:
    h = await make_router(engines[:1])
    async with aiohttp.ClientSession() as http:
        async with http.post(h.url + "/v1/completions", headers={"X-Rollout-Class": "agentic"},
                             json={"model": MODEL, "prompt": [1, 2], "max_tokens": 1}) as r:
            assert r.status == 200
            warning = r.headers["X-Misat-Warning"]
        async with http.post(h.url + "/v1/completions",
                             headers={"X-Rollout-Class": "agentic", "X-Session-Id": "s1"},
                             json={"model": MODEL, "prompt": [1, 2], "max_tokens": 1}) as r:
            assert r.status == 200 and "X-Misat-Warning" not in r.headers
        async with http.post(h.url + "/v1/completions", headers={"X-Rollout-Class": "rlvr"},
                             json={"model": MODEL, "prompt": [1, 2], "max_tokens": 1}) as r:
            assert "X-Misat-Warning" not in r.headers  # single-turn classes need no session id
    assert "'agentic' is multi-turn" in warning and "X-Session-Id" in warning
