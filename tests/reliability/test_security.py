"""Least privilege at the router's edge: the admin token, size limits, upstream timeouts.

- The admin bearer token is compared in constant time and never appears in a log line,
  whatever fails (wrong tokens, bad reloads, a bad config file, start-up errors).
- A body over ``max_body_bytes`` is a 413 in the OpenAI error format, announced or not;
  oversized or too many headers are refused by the HTTP parser before any router code.
- A stalled engine (accepts, never answers; or stops mid-stream) ends in a timely error,
  never a hang: generation, pass-through and control calls all have timeouts.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import yaml

from misat_router import admin
from misat_router.server import main as router_main

from .conftest import MODEL, assert_drained, is_openai_error, router_config

TOKEN = "tok-5d9f0c4e-very-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
RLVR = {"X-Rollout-Class": "rlvr"}


def assert_token_absent(caplog: pytest.LogCaptureFixture, *extra: str) -> None:
    texts = list(extra)
    for rec in caplog.records:
        texts.append(rec.getMessage())
        if rec.exc_info:
            texts.append(logging.Formatter().formatException(rec.exc_info))
    assert texts, "nothing was logged: the check would be vacuous"
    for t in texts:
        assert TOKEN not in t and TOKEN[:12] not in t


async def test_admin_token_never_logged(
    misbehaving, make_router, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    compared: list[int] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append(1)
        return real(a, b)

    monkeypatch.setattr(admin.hmac, "compare_digest", spy)
    (engine,) = await misbehaving(1)
    cfg = router_config([engine.url], config_poll_interval_s=0.02)
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    with caplog.at_level(logging.DEBUG):
        r = await make_router(cfg, admin_token=TOKEN, config_path=path)
        wrong = [f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}", f"Basic {TOKEN}", TOKEN, f"Bearer  {TOKEN} extra",
                 "Bearer \udcff" + TOKEN]
        async with aiohttp.ClientSession() as http:
            for value in wrong[:-1]:
                async with http.post(r.url + "/admin/pause", headers={"Authorization": value}) as resp:
                    assert resp.status == 401 and is_openai_error(await resp.json())
            # Reloads: applied, refused (invalid, stale), through PUT and through the file.
            doc = cfg.model_dump(mode="json") | {"generation": 2}
            for data, status in [(yaml.safe_dump(doc), 200), (b"\x00garbage", 400),
                                 (yaml.safe_dump(doc | {"generation": 1}), 409)]:
                async with http.put(r.url + "/admin/config", data=data, headers=AUTH) as resp:
                    assert resp.status == status
            path.write_bytes(b"model: [")
            await r.wait(lambda: r.state.last_reload_error is not None and "YAML" in r.state.last_reload_error)
            for p in ("/admin/pause?reset_prefix_cache=true", "/admin/resume"):
                async with http.post(r.url + p, headers=AUTH) as resp:
                    assert resp.status == 200
            # A generation request carrying the token (a client's own API key) is not logged either.
            async with http.post(r.url + "/v1/completions", json={"model": MODEL, "prompt": [1]},
                                 headers=RLVR | AUTH) as resp:
                assert resp.status == 200
        await r.close()
    assert len(compared) >= len(wrong) - 1  # every check went through hmac.compare_digest
    assert_token_absent(caplog)


async def test_token_with_invalid_utf8_is_a_401_not_a_crash(misbehaving, make_router) -> None:
    (engine,) = await misbehaving(1)
    r = await make_router(router_config([engine.url]), admin_token=TOKEN)
    reader, writer = await asyncio.open_connection("127.0.0.1", r.server.port)
    writer.write(b"POST /admin/pause HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe" + TOKEN.encode()
                 + b"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    head = await asyncio.wait_for(reader.read(), 5.0)
    writer.close()
    assert head.startswith(b"HTTP/1.1 401")
    assert r.state.runner.paused is False


def test_startup_errors_do_not_print_the_token(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: m\nengines: {urls: ['ftp://x']}\n")
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(router_config(["http://127.0.0.1:9"]).model_dump(mode="json")))
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:  # main() installs its own log handler on the root logger
        assert router_main(["--config", str(bad), "--admin-token-file", str(token_file)]) == 2
        assert router_main(["--config", str(good), "--admin-token-file", str(tmp_path / "missing")]) == 2
        token_file.write_text("")
        assert router_main(["--config", str(good), "--admin-token-file", str(token_file)]) == 2
    finally:
        root.handlers[:], root.level = saved[0], saved[1]
    err = capsys.readouterr().err
    assert err.count("invalid config") == 3
    assert TOKEN not in err


# ---- size limits --------------------------------------------------------------------


async def test_body_over_limit_is_413_in_openai_format(misbehaving, make_router) -> None:
    (engine,) = await misbehaving(1)
    r = await make_router(router_config([engine.url], max_body_bytes=64 * 1024), admin_token=TOKEN)
    big = b'{"model": "m", "prompt": "' + b"x" * (10 * 1024 * 1024) + b'"}'

    async def chunked() -> AsyncIterator[bytes]:
        for i in range(0, len(big), 256 * 1024):
            yield big[i:i + 256 * 1024]

    async with aiohttp.ClientSession() as http:
        for path, headers, data in [("/v1/completions", RLVR, big), ("/v1/chat/completions", RLVR, chunked()),
                                    ("/admin/config", AUTH, big), ("/tokenize", {}, big)]:
            method = "PUT" if path == "/admin/config" else "POST"
            try:
                async with http.request(method, r.url + path, data=data, headers=headers) as resp:
                    assert resp.status == 413, path
                    body = await resp.json()
            except aiohttp.ClientOSError:  # refused before the client finished sending: fine,
                continue  # but the announced-length case below must get the answer
            assert is_openai_error(body) and body["error"]["type"] == "invalid_request_error"
        async with http.post(r.url + "/v1/completions", data=big, headers=RLVR) as resp:
            assert resp.status == 413
    assert engine.generations == 0  # nothing oversized was forwarded
    assert r.state.config.max_body_bytes == 64 * 1024


@pytest.mark.parametrize(
    "headers",
    [pytest.param({"X-Session-Id": "s" * 20_000}, id="one-huge-header"),
     pytest.param({f"X-Filler-{i}": "v" for i in range(300)}, id="too-many-headers")],
)
async def test_oversized_headers_are_refused(misbehaving, make_router, headers: dict[str, str]) -> None:
    (engine,) = await misbehaving(1)
    r = await make_router(router_config([engine.url]))
    async with aiohttp.ClientSession() as http:
        async with http.post(r.url + "/v1/completions", json={"model": MODEL, "prompt": [1]},
                             headers=RLVR | headers) as resp:
            assert resp.status in (400, 431)
        async with http.get(r.url + "/health") as resp:  # still serving
            assert resp.status == 200
    assert engine.generations == 0


# ---- stalled engines ----------------------------------------------------------------

STALL_TIMEOUT_S = 0.3
"""upstream_timeout_s / scrape_timeout_s for these tests; the answer must come well within 10x."""


@pytest.fixture
async def stalled(misbehaving, make_router):
    (engine,) = await misbehaving(1)
    r = await make_router(router_config([engine.url], upstream_timeout_s=STALL_TIMEOUT_S,
                                        scrape_timeout_s=STALL_TIMEOUT_S, policy="least-loaded"),
                          admin_token=TOKEN)
    return engine, r


async def timed(coro) -> tuple[float, object]:
    t0 = time.monotonic()
    out = await asyncio.wait_for(coro, 10 * STALL_TIMEOUT_S + 2)
    return time.monotonic() - t0, out


async def test_stalled_generation_is_a_timely_502(stalled) -> None:
    engine, r = stalled
    engine.stall_generation = True
    async with aiohttp.ClientSession() as http:
        async def call() -> tuple[int, dict]:
            async with http.post(r.url + "/v1/completions", json={"model": MODEL, "prompt": [1], "stream": True},
                                 headers=RLVR) as resp:
                return resp.status, await resp.json()

        took, (status, body) = await timed(call())
        assert status == 502 and is_openai_error(body) and body["error"]["code"] == "upstream_timeout"
        assert took < 5 * STALL_TIMEOUT_S
        await assert_drained(r, http)


async def test_stream_stalled_mid_way_ends_with_an_error_event(stalled) -> None:
    engine, r = stalled
    engine.stall_after_first_chunk = True
    async with aiohttp.ClientSession() as http:
        async def call() -> bytes:
            async with http.post(r.url + "/v1/completions", json={"model": MODEL, "prompt": [1], "stream": True},
                                 headers=RLVR) as resp:
                assert resp.status == 200
                return await resp.read()

        took, body = await timed(call())
        assert b"t0" in body and b'"upstream_error"' in body and body.endswith(b"data: [DONE]\n\n")
        assert took < 5 * STALL_TIMEOUT_S
        await assert_drained(r, http)


async def test_stalled_models_call_is_a_timely_502(stalled) -> None:
    engine, r = stalled
    engine.stall_models = True
    async with aiohttp.ClientSession() as http:
        async def models() -> tuple[int, dict]:
            async with http.get(r.url + "/v1/models") as resp:
                return resp.status, await resp.json()

        took, (status, body) = await timed(models())
        assert status == 502 and is_openai_error(body) and body["error"]["code"] == "upstream_timeout"
        assert took < 5 * STALL_TIMEOUT_S


async def test_stalled_prefix_cache_reset_is_bounded_by_the_probe_timeout(misbehaving, make_router) -> None:
    """Pause/resume call every engine; a stalled one costs scrape_timeout_s, not upstream_timeout_s
    (an hour by default, sized for long generations)."""
    (engine,) = await misbehaving(1)
    engine.stall_reset = True
    r = await make_router(router_config([engine.url], scrape_timeout_s=STALL_TIMEOUT_S), admin_token=TOKEN)
    assert r.state.config.upstream_timeout_s == 3600.0
    async with aiohttp.ClientSession() as http:
        async def pause() -> dict:
            async with http.post(r.url + "/admin/pause?reset_prefix_cache=true", headers=AUTH) as resp:
                assert resp.status == 200
                return await resp.json()

        took, out = await timed(pause())
        assert out["prefix_cache_reset"] == {engine.url: "failed: TimeoutError"}  # type: ignore[index]
        assert took < 5 * STALL_TIMEOUT_S


async def test_engine_that_accepts_and_never_answers(make_router) -> None:
    """A black hole (TCP accept, no byte back): never healthy, requests end at the hold deadline."""
    accepted: list[asyncio.StreamWriter] = []

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)

    hole = await asyncio.start_server(swallow, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{hole.sockets[0].getsockname()[1]}"
    try:
        r = await make_router(router_config([url], hold_deadline_s=0.5, health_timeout_s=0.2), healthy=0)
        await r.wait(lambda: r.state.registry.get(url).consecutive_failures >= 2)
        assert not r.state.registry.get(url).healthy
        async with aiohttp.ClientSession() as http:
            async def call() -> tuple[int, dict, str | None]:
                async with http.post(r.url + "/v1/completions", json={"model": MODEL, "prompt": [1]},
                                     headers=RLVR) as resp:
                    return resp.status, await resp.json(), resp.headers.get("Retry-After")

            took, (status, body, retry) = await timed(call())
            assert status == 503 and body["error"]["code"] == "hold_deadline_exceeded" and retry is not None
            assert took < 2.0
            await assert_drained(r, http)
        assert accepted  # the health checks did connect
    finally:
        for w in accepted:
            w.close()
        hole.close()
        await hole.wait_closed()


async def test_engine_error_status_passes_through_unchanged(misbehaving, make_router) -> None:
    """An engine's own 5xx reaches the client as the engine sent it (with X-Misat-Engine),
    which is how the fuzz suite tells it apart from a router error."""
    (engine,) = await misbehaving(1)
    engine.fail_status = 500
    r = await make_router(router_config([engine.url]))
    async with aiohttp.ClientSession() as http:
        async with http.post(r.url + "/v1/completions", json={"model": MODEL, "prompt": [1]}, headers=RLVR) as resp:
            assert resp.status == 500 and resp.headers["X-Misat-Engine"] == engine.url
            assert (await resp.json())["message"] == "engine says no"
        await assert_drained(r, http)


