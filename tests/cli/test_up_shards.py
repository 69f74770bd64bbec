"""``misat up`` with router shards: the manifest's router.shards (or --shards) runs that many
``misat router`` processes behind the real haproxy; admission edits reach every shard."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
import yaml

from misat_cli import shards as shards_module
from misat_cli.localpool import PoolError, local_pool
from misat_cli.shards import ShardsError, find_haproxy
from misat_router.sharding import SHARD_HEADER
from tests.support.fake_engine import FakeEngine
from tests.support.manifests import EXAMPLE


def sharded_manifest(tmp_path: Path, shards: int, engines: int) -> Path:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["engines"]["replicas"] = engines
    doc["spec"]["router"]["shards"] = shards
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


async def test_the_manifests_shards_run_behind_haproxy_and_take_admission_edits(tmp_path: Path) -> None:
    engines = [FakeEngine(f"e{i}", model="policy") for i in range(2)]
    for e in engines:
        await e.start()
    manifest = sharded_manifest(tmp_path, 2, 2)
    try:
        async with local_pool(manifest, engine_urls=[e.url for e in engines], log_dir=tmp_path / "logs") as pool, \
                aiohttp.ClientSession() as http:
            assert len(pool.shard_urls) == 2 and pool.router_url not in pool.shard_urls
            seen = set()
            for k in range(12):
                headers = {"X-Rollout-Class": "rlvr", "X-Session-Id": f"s{k}"}
                body = {"model": "policy", "prompt": [1, 2], "max_tokens": 1}
                async with http.post(f"{pool.router_url}/v1/completions", json=body, headers=headers) as resp:
                    assert resp.status == 200, await resp.text()
                    seen.add(resp.headers[SHARD_HEADER])
            assert seen == {"0", "1"}  # 12 sessions hashed over both shards
            doc = yaml.safe_load(manifest.read_text())
            doc["spec"]["admission"]["sessionAdmission"]["epochS"] = 0.25
            manifest.write_text(yaml.safe_dump(doc))
            line = await pool.reload(manifest)
            assert "applied generation 2" in line
            for url in pool.shard_urls:
                async with http.get(f"{url}/status") as resp:
                    assert (await resp.json())["generation"] == 2
    finally:
        for e in engines:
            await e.close()


async def test_more_shards_than_engines_is_refused(tmp_path: Path) -> None:
    # In the manifest (spec validation, with the manifest's path) and as --shards over given engines.
    with pytest.raises(PoolError, match=r"spec\.router\.shards: 3 shards for 2 engines"):
        async with local_pool(sharded_manifest(tmp_path, 3, 2)):
            pass
    engines = ["http://127.0.0.1:9", "http://127.0.0.1:10"]
    with pytest.raises(PoolError, match="3 router shards for 2 engines"):
        async with local_pool(sharded_manifest(tmp_path, 1, 2), engine_urls=engines, shards=3):
            pass


def test_a_missing_haproxy_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(shards_module.shutil, "which", lambda _: None)
    monkeypatch.setattr(shards_module, "SBIN_HAPROXY", tmp_path / "no-haproxy")
    with pytest.raises(ShardsError, match=r"scripts/system-packages\.sh"):
        find_haproxy()
