"""The router keeps its last good config when a pushed config is invalid or the watched file
turns to garbage, and keeps serving meanwhile.

(The operator side, an operator restart or a hand-edited ConfigMap, is covered by the
operator's own tests; see docs/reliability.md.)
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import aiohttp
import pytest
import yaml

from .conftest import MODEL, RouterUnderTest, gauges, is_openai_error, router_config

TOKEN = "reliability-admin-token-4f1c"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def good_doc(r: RouterUnderTest, **overrides: object) -> dict:
    doc = r.state.config.model_dump(mode="json")
    doc.update(overrides)
    return doc


async def serves(http: aiohttp.ClientSession, r: RouterUnderTest) -> None:
    async with http.post(r.url + "/v1/completions", json={"model": MODEL, "prompt": [1, 2]},
                         headers={"X-Rollout-Class": "rlvr"}) as resp:
        assert resp.status == 200, await resp.text()


BAD_PUSHES: list[tuple[str, object, int]] = [
    ("binary", b"\x00\xff\xfe garbage \x80", 400),
    ("truncated-yaml", b"generation: 5\nmodel: [unclosed", 400),
    ("not-a-mapping", b"- just\n- a list\n", 400),
    ("empty", b"", 400),
    ("json-null", b"null", 400),
    ("unknown-key", {"typo_field": 1}, 400),
    ("wrong-type", {"hold_deadline_s": "soon"}, 400),
    ("negative-timeout", {"upstream_timeout_s": -1}, 400),
    ("bad-engine-url", {"engines": {"urls": ["ftp://x"]}}, 400),
    ("shares-not-100", {"workloads": {"classes": [{"name": "rlvr", "share": 10}], "default_class": None}}, 400),
    ("unknown-policy", {"policy": {"name": "nope"}}, 400),
    ("stale-generation", {"generation": 0}, 409),
    ("huge-generation-number", {"generation": 10**400}, 400),
    ("infinite-timeout", {"upstream_timeout_s": float("inf")}, 400),
    ("nan-interval", {"scrape_interval_s": float("nan")}, 400),
]


@pytest.mark.parametrize(("name", "payload", "status"), BAD_PUSHES, ids=[b[0] for b in BAD_PUSHES])
async def test_invalid_push_is_refused_and_the_old_config_kept(
    misbehaving, make_router, name: str, payload: object, status: int
) -> None:
    (engine,) = await misbehaving(1)
    r = await make_router(router_config([engine.url]), admin_token=TOKEN)
    before = (r.state.config, r.state.config_hash)
    if isinstance(payload, bytes):
        data = payload
    else:
        doc = good_doc(r, generation=2)
        doc.update(payload)  # type: ignore[arg-type]
        data = yaml.safe_dump(doc).encode()
    async with aiohttp.ClientSession() as http:
        async with http.put(r.url + "/admin/config", data=data, headers=AUTH) as resp:
            assert resp.status == status
            assert is_openai_error(await resp.json())
        assert (r.state.config, r.state.config_hash) == before
        assert r.state.last_reload_error
        await serves(http, r)
        async with http.get(r.url + "/metrics") as resp:
            g = gauges(await resp.text())
    refused = [v for labels, v in g["misat_config_reloads_total"] if labels["result"] == "refused"]
    assert refused == [1.0]


def replace_file(path: Path, data: bytes) -> None:
    """Swap in new content atomically, as a ConfigMap update does: a plain write truncates
    first, and a watcher polling every 20 ms may read the empty file in between (one more
    refusal than the test counts)."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


async def test_watched_file_turning_to_garbage_keeps_the_old_config(
    misbehaving, make_router, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (engine,) = await misbehaving(1)
    cfg = router_config([engine.url], config_poll_interval_s=0.02)
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    r = await make_router(cfg, config_path=path)
    before = r.state.config_hash
    garbage = [b"\x00\x01binary\xff", b"generation: 2\nmodel: [", b"", b"42\n", b"generation: -1\n"]
    async with aiohttp.ClientSession() as http:
        with caplog.at_level(logging.WARNING, logger="misat_router"):
            for i, content in enumerate(garbage, start=1):
                replace_file(path, content)
                await r.wait(lambda i=i: r.state.metrics.reloads.labels("file", "refused")._value.get() == i)
                assert r.state.config_hash == before
                await serves(http, r)
            # The file disappears (unmounted, mid-swap): nothing changes, nothing is refused.
            path.unlink()
            replace_file(path, garbage[0])  # an old garbage again is a new content for the watcher
            await r.wait(lambda: r.state.metrics.reloads.labels("file", "refused")._value.get() == 6)
        refusals = [rec for rec in caplog.records if "refused" in rec.getMessage()]
        assert len(refusals) == 6  # one line per bad content, not one per poll
        # A good file with a newer generation is applied; the router never stopped serving.
        good = cfg.model_dump(mode="json") | {"generation": 2}
        replace_file(path, yaml.safe_dump(good).encode())
        await r.wait(lambda: r.state.config.generation == 2)
        assert r.state.last_reload_error is None
        await serves(http, r)
