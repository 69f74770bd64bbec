"""Admin API: auth, hot reload (PUT and watched file), pause/resume."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import aiohttp
import pytest
import yaml

from tests.support.fake_engine import FakeEngine
from tests.support.router_config import MODEL, router_config

from .conftest import open_parked_stream

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def config_doc(h, **overrides: object) -> dict:
    doc = h.state.config.model_dump(mode="json")
    doc.update(overrides)
    return doc


@pytest.mark.parametrize(
    ("token", "headers", "status", "error_type"),
    [
        pytest.param(None, AUTH, 403, "permission_error", id="no-token-configured"),
        pytest.param(TOKEN, {}, 401, "authentication_error", id="no-header"),
        pytest.param(TOKEN, {"Authorization": "Bearer wrong"}, 401, "authentication_error",
                     id="wrong-token"),
        pytest.param(TOKEN, {"Authorization": f"Basic {TOKEN}"}, 401, "authentication_error",
                     id="wrong-scheme"),
    ],
)
async def test_admin_auth(engines: list[FakeEngine], make_router, token: str | None,
                          headers: dict[str, str], status: int, error_type: str) -> None:
    h = await make_router(engines[:1], admin_token=token)
    async with aiohttp.ClientSession() as http:
        for method, path in [("POST", "/admin/pause"), ("PUT", "/admin/config"),
                             ("GET", "/admin/config")]:
            async with http.request(method, h.url + path, headers=headers, data=b"{}") as r:
                assert r.status == status
                assert (await r.json())["error"]["type"] == error_type
    assert h.state.runner.paused is False


async def test_put_config_applies_atomically_and_keeps_live_sessions(
    engines: list[FakeEngine], make_router
) -> None:
    h = await make_router(engines[:1], admin_token=TOKEN)
    async with aiohttp.ClientSession() as http:
        async with http.post(h.url + "/v1/completions", json={"model": MODEL, "prompt": [1]},
                             headers={"X-Rollout-Class": "agentic", "X-Session-Id": "s1"}) as r:
            assert r.status == 200
        doc = config_doc(h, generation=2)
        doc["policy"]["name"] = "misa-t"
        doc["workloads"]["classes"][0]["share"] = 30
        doc["workloads"]["classes"][1]["share"] = 30
        async with http.put(h.url + "/admin/config", data=yaml.safe_dump(doc), headers=AUTH) as r:
            assert r.status == 200
            result = await r.json()
        assert result["applied"] is True and result["policy_rebuilt"] is True
        assert set(result["changes"]) == {"generation", "policy", "workloads"}
        async with http.get(h.url + "/status") as r:
            status = await r.json()
    assert status["generation"] == 2 and status["policy"] == "misa-t"
    assert status["config_hash"] == h.state.config.config_hash()
    assert {c["name"]: c["target_share"] for c in status["classes"]}["rlvr"] == pytest.approx(0.3)
    assert "s1" in h.state.runner.sessions  # the live session survived the policy swap
    # ... and the new policy counts it against its engine's caps.
    agentic = [k for k in status["kv"] if k["workload_class"] == "agentic"]
    assert [k["sessions"] for k in agentic] == [1]


@pytest.mark.parametrize(
    ("mutate", "status", "fragment"),
    [
        pytest.param(lambda d: d.update(generation=0), 409, "older", id="stale-generation"),
        pytest.param(lambda d: d["workloads"]["classes"][0].update(share=99), 400,
                     "shares must sum to 100", id="bad-shares"),
        pytest.param(lambda d: d.update(bogus=1), 400, "bogus", id="unknown-field"),
        pytest.param(lambda d: d["policy"].update(name="nope"), 400, "policy.name",
                     id="unknown-policy"),
    ],
)
async def test_invalid_config_is_refused_and_old_kept(
    engines: list[FakeEngine], make_router, mutate, status: int, fragment: str
) -> None:
    h = await make_router(engines[:1], admin_token=TOKEN)
    old_hash = h.state.config_hash
    doc = config_doc(h)
    mutate(doc)
    async with aiohttp.ClientSession() as http:
        async with http.put(h.url + "/admin/config", data=json.dumps(doc), headers=AUTH) as r:
            assert r.status == status
            assert fragment in (await r.json())["error"]["message"]
        async with http.get(h.url + "/status") as r:
            body = await r.json()
    assert h.state.config_hash == old_hash and body["generation"] == 1
    assert fragment in body["last_reload_error"]


async def test_reload_refuses_dropping_a_class_with_live_work(
    engines: list[FakeEngine], make_router
) -> None:
    h = await make_router(engines[:1], admin_token=TOKEN)
    async with aiohttp.ClientSession() as http:
        async with http.post(h.url + "/v1/completions", json={"model": MODEL, "prompt": [1]},
                             headers={"X-Rollout-Class": "agentic", "X-Session-Id": "s"}) as r:
            assert r.status == 200
        doc = config_doc(h, generation=2)
        doc["workloads"]["classes"] = [{"name": "rlvr", "share": 100}]
        async with http.put(h.url + "/admin/config", data=json.dumps(doc), headers=AUTH) as r:
            assert r.status == 400
            assert "agentic" in (await r.json())["error"]["message"]


async def test_file_reload_with_in_flight_stream_unaffected(
    engines: list[FakeEngine], make_router, tmp_path: Path
) -> None:
    eng = engines[0]
    eng.mid_stream_gate = asyncio.Event()
    # A ConfigMap-like directory: the file is a symlink into a ..data directory.
    cfg = router_config([eng.url])
    (tmp_path / "..2024_01").mkdir()
    (tmp_path / "..2024_01" / "router.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    os.symlink("..2024_01", tmp_path / "..data")
    os.symlink("..data/router.yaml", tmp_path / "router.yaml")
    h = await make_router([eng], config_path=str(tmp_path / "router.yaml"))
    async with aiohttp.ClientSession() as http:
        resp, _ = await open_parked_stream(http, h.url, stream_options={"include_usage": True})
        # Invalid content first: refused, old config kept.
        new_dir = tmp_path / "..2024_02"
        new_dir.mkdir()
        (new_dir / "router.yaml").write_text("generation: 2\nmodel: [oops\n")
        os.symlink("..2024_02", tmp_path / "..data_tmp")
        os.replace(tmp_path / "..data_tmp", tmp_path / "..data")
        await h.wait(lambda: h.state.last_reload_error is not None)
        assert h.state.config.generation == 1
        # Then a valid new generation, swapped in the same way.
        doc = cfg.model_dump(mode="json") | {"generation": 3, "hold_deadline_s": 9.0}
        newer = tmp_path / "..2024_03"
        newer.mkdir()
        (newer / "router.yaml").write_text(yaml.safe_dump(doc))
        os.symlink("..2024_03", tmp_path / "..data_tmp")
        os.replace(tmp_path / "..data_tmp", tmp_path / "..data")
        await h.wait(lambda: h.state.config.generation == 3)
        assert h.state.config.hold_deadline_s == 9.0 and h.state.last_reload_error is None
        eng.mid_stream_gate.set()
        rest = await resp.read()
        assert resp.status == 200 and rest.endswith(b"data: [DONE]\n\n")
        assert rest.count(b"data: ") == 2 + 1 + 1  # two more tokens, usage, [DONE]
    await h.wait(lambda: not h.state.dispatcher.in_flight)
    assert h.state.runner.mixture.completed["rlvr"] == 1


async def test_pause_holds_new_work_and_resume_releases_it(
    engines: list[FakeEngine], make_router
) -> None:
    eng = engines[0]
    h = await make_router([eng], admin_token=TOKEN)
    async with aiohttp.ClientSession() as http:
        async with http.post(h.url + "/admin/pause", headers=AUTH) as r:
            assert r.status == 200 and (await r.json())["paused"] is True
        task = asyncio.create_task(http.post(
            h.url + "/v1/completions", json={"model": MODEL, "prompt": [1]},
            headers={"X-Rollout-Class": "rlhf"}))
        await h.wait(lambda: h.state.runner.held_count() == 1)
        assert h.state.runner.held()[0].reason.value == "paused"
        assert eng.requests == []
        async with http.post(h.url + "/admin/resume?reset_prefix_cache=true", headers=AUTH) as r:
            body = await r.json()
        assert body["paused"] is False and body["prefix_cache_reset"] == {eng.url: "ok"}
        assert eng.prefix_resets == 1
        resp = await task
        assert resp.status == 200
        resp.release()
        async with http.post(h.url + "/admin/pause?reset_prefix_cache=maybe", headers=AUTH) as r:
            assert r.status == 400


async def test_pause_resets_prefix_cache_by_config_default(
    engines: list[FakeEngine], make_router
) -> None:
    h = await make_router(engines, admin_token=TOKEN, pause_resets_prefix_cache=True)
    async with aiohttp.ClientSession() as http, http.post(h.url + "/admin/pause", headers=AUTH) as r:
        assert set((await r.json())["prefix_cache_reset"]) == {e.url for e in engines}
    assert [e.prefix_resets for e in engines] == [1, 1]


async def test_put_config_answer_counts_the_work_it_found_live(
    engines: list[FakeEngine], make_router
) -> None:
    eng = engines[0]
    eng.mid_stream_gate = asyncio.Event()
    h = await make_router([eng], admin_token=TOKEN)
    async with aiohttp.ClientSession() as http:
        resp, _ = await open_parked_stream(http, h.url)  # parked mid-way by the engine
        doc = config_doc(h, generation=2) | {"hold_deadline_s": 9.0}
        async with http.put(h.url + "/admin/config", data=json.dumps(doc), headers=AUTH) as r:
            assert r.status == 200
            result = await r.json()
        assert result["applied"] is True and result["changes"] == ["generation", "hold_deadline_s"]
        assert (result["requests_in_flight"], result["held_requests"]) == (1, 0)
        eng.mid_stream_gate.set()
        assert (await resp.read()).endswith(b"data: [DONE]\n\n")
        resp.release()
