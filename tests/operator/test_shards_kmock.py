"""The real operator with a sharded pool (router.shards 3) against the emulated API server.

Two real router shards run in this process (the third is down: nothing listens at its
address); each shard's address is a loopback IP of its own on the pool's router port
(``shard_url`` template ``http://127.0.{shard}.1:{port}``), the engines' headless Service
and the shards' peer names resolve to local fake engines and shards. The operator renders
the StatefulSet, its headless Service and the HAProxy proxy, pushes the config to every
shard, and combines their ``/status`` into the pool's status: per-class counts summed, the
consumed mixture recomputed from the sums, each shard up or down.
"""

from __future__ import annotations

import base64
import copy
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import kopf
import pytest
import pytest_asyncio

from misat_router import lifecycle as router_lifecycle
from misat_router import shard_peers
from misat_router.app import create_app
from misat_router.service import RouterService, start_service
from misat_router.state import RouterState
from tests.support.fake_engine import FakeEngine
from tests.support.kopf_run import NS, api_call, condition, emulated, running_operator
from tests.support.processes import free_port
from tests.support.router_config import router_config

POOLS = "misat.dev/v1alpha1/rolloutpools"
POOL_URL = f"/apis/misat.dev/v1alpha1/namespaces/{NS}/rolloutpools"
WAIT_S = 15.0
N_SHARDS, N_ENGINES = 3, 4
RUNNING = (0, 1)
"""Shards that run; shard 2 is down for the whole test."""


def shard_ip(i: int) -> str:
    return f"127.0.{i}.1"


class Shards:
    def __init__(self, port: int, engines: list[FakeEngine]) -> None:
        self.port = port
        self.engines = engines
        self.routers: dict[int, RouterService] = {}

    def url(self, i: int) -> str:
        return f"http://{shard_ip(i)}:{self.port}"

    def state(self, i: int) -> RouterState:
        return self.routers[i].state


@pytest_asyncio.fixture
async def shards(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Shards]:
    engines = [FakeEngine(f"e{i}", model="policy") for i in range(N_ENGINES)]
    for e in engines:
        await e.start()
    s = Shards(free_port(), engines)
    engines_dns = f"mixed-pool-engines.{NS}.svc.cluster.local"

    async def fake_resolve(ref: Any) -> list[str]:
        if ref.name != engines_dns:
            raise OSError(f"cannot resolve {ref.name}")
        return [e.url for e in engines]

    real_check = shard_peers.check_peer

    async def check_by_index(state: RouterState, session: aiohttp.ClientSession, peer: int, url: str) -> None:
        # The rendered peers are the shard pods' DNS names; here they are loopback IPs by index.
        await real_check(state, session, peer, s.url(peer))

    monkeypatch.setattr(router_lifecycle, "resolve_service", fake_resolve)
    monkeypatch.setattr(shard_peers, "check_peer", check_by_index)
    # A fresh shard pod: generation 0, the peers, an admin token it has not read yet.
    config = router_config([e.url for e in engines], generation=None, model="policy",
                           shards={"peers": [s.url(i) for i in range(N_SHARDS)]})
    try:
        for i in RUNNING:
            s.routers[i] = await start_service(create_app(config, admin_token="not-mounted-yet", shard_index=i),
                                               shard_ip(i), s.port)
        yield s
    finally:
        for router in s.routers.values():
            await router.stop()
        for e in engines:
            await e.close()


def sharded_pool(mixed_pool: dict[str, Any], port: int, **router: Any) -> dict[str, Any]:
    body = copy.deepcopy(mixed_pool)
    body["metadata"]["namespace"] = NS
    body["spec"]["router"] = {**body["spec"]["router"], "shards": N_SHARDS, "port": port, **router}
    return body


async def test_a_sharded_pool_renders_pushes_to_every_shard_and_combines_their_status(
    k8s: Any, fresh_kopf_registry: kopf.OperatorRegistry, shards: Shards, waiter: Callable[..., Any],
    mixed_pool: dict[str, Any],
) -> None:
    api = str(k8s.url).rstrip("/")
    pool = lambda: emulated(k8s, POOLS, "mixed-pool")  # noqa: E731
    async with (
        running_operator(fresh_kopf_registry, api, "http://127.0.0.1:1", shard_url="http://127.0.{shard}.1:{port}"),
        aiohttp.ClientSession(api) as http,
    ):
        await api_call(http, "POST", POOL_URL, sharded_pool(mixed_pool, shards.port), "application/json")

        # -- rendered: the shards' StatefulSet and headless Service, the proxy; the router at 0 ---------
        await waiter(lambda: emulated(k8s, "apps/v1/deployments", "mixed-pool-router-proxy"), WAIT_S, "proxy")
        sts = emulated(k8s, "apps/v1/statefulsets", "mixed-pool-router")
        assert sts is not None
        assert sts["spec"]["replicas"] == N_SHARDS and sts["spec"]["serviceName"] == "mixed-pool-router-shards"
        assert emulated(k8s, "v1/services", "mixed-pool-router-shards")["spec"]["clusterIP"] == "None"  # type: ignore[index]
        proxy_cfg = emulated(k8s, "v1/configmaps", "mixed-pool-router-proxy")["data"]["haproxy.cfg"]  # type: ignore[index]
        assert "balance hdr(X-Session-Id)" in proxy_cfg and "hash-type consistent" in proxy_cfg
        assert proxy_cfg.count("server shard-") == N_SHARDS
        svc = emulated(k8s, "v1/services", "mixed-pool-router")
        assert svc is not None and svc["spec"]["selector"]["app.kubernetes.io/component"] == "router-proxy"
        assert emulated(k8s, "apps/v1/deployments", "mixed-pool-router")["spec"]["replicas"] == 0  # type: ignore[index]

        # -- the shards mount the Secret; the operator pushes to each running one ------------------------
        secret = emulated(k8s, "v1/secrets", "mixed-pool-router-admin")
        assert secret is not None
        token = base64.b64decode(secret["data"]["token"]).decode()
        for i in RUNNING:
            shards.state(i).admin_token = token
        await waiter(lambda: all(shards.state(i).config.generation == 1 for i in RUNNING), WAIT_S, "config pushed")
        peers = shards.state(0).config.shards
        assert peers is not None and peers.peers[2] == f"http://mixed-pool-router-2.mixed-pool-router-shards.{NS}" \
            f".svc.cluster.local:{shards.port}"

        # -- each shard owns its engines; shard 2 is down, so its engines went to the others ---------------
        for i in RUNNING:
            st = shards.state(i)
            await st.wait_until(lambda st=st: st.peers is not None and 2 not in st.peers.live(), WAIT_S)
        owned = {i: set(shards.state(i).registry.ids()) for i in RUNNING}
        assert owned[0].isdisjoint(owned[1]) and owned[0] | owned[1] == {e.url for e in shards.engines}

        # -- completions on each shard; the pool status sums them by class --------------------------------
        sent = {0: {"rlvr": 3, "rlhf": 1}, 1: {"rlvr": 1, "rlhf": 1, "agentic": 2}}
        async with aiohttp.ClientSession() as direct:
            for i, per_class in sent.items():
                for cls, n in per_class.items():
                    for k in range(n):
                        body = {"model": "policy", "prompt": [1, 2], "max_tokens": 2}
                        headers = {"X-Rollout-Class": cls, "X-Session-Id": f"{i}-{cls}-{k}", "X-Session-End": "1"}
                        async with direct.post(f"{shards.url(i)}/v1/completions", json=body, headers=headers) as r:
                            assert r.status == 200, await r.text()

        def combined() -> dict[str, Any] | None:
            st = (pool() or {}).get("status") or {}
            classes = {c["name"]: c for c in st.get("classes") or ()}
            done = sum(c.get("completedUnits") or 0 for c in classes.values())
            # The engines taken over from shard 2 count as healthy once their new owner probed them.
            healthy = ((st.get("router") or {}).get("healthyEngines") or 0) == N_ENGINES
            return st if done == 8 and healthy else None

        status = await waiter(combined, WAIT_S, "combined status")
        classes = {c["name"]: c for c in status["classes"]}
        assert {n: c["completedUnits"] for n, c in classes.items()} == {"agentic": 2, "rlvr": 4, "rlhf": 2}
        # By counts over all shards (2/8, 4/8, 2/8), not the mean of each shard's ratios.
        assert status["mixture"]["consumed"] == {"agentic": 25.0, "rlvr": 50.0, "rlhf": 25.0}
        by_shard = {s["index"]: s for s in status["router"]["shards"]}
        assert [by_shard[i]["up"] for i in range(N_SHARDS)] == [True, True, False]
        assert by_shard[2]["error"] and by_shard[2]["url"] == shards.url(2)
        assert by_shard[0]["liveShards"] == [0, 1] and by_shard[0]["generation"] == 1
        assert by_shard[0]["ownedEngines"] + by_shard[1]["ownedEngines"] == N_ENGINES
        assert status["router"]["healthyEngines"] == N_ENGINES
        assert status["config"]["appliedGeneration"] == 1
        ready = condition(pool(), "Ready")
        assert ready["status"] == "False"

        # -- the proxy's pods: read from its Deployment (the controller is not emulated) --------------------
        assert status["router"]["proxy"] == {"desired": 2, "ready": 0}
        assert "proxy 0/2" in condition(pool(), "Reconciling")["message"]
        await api_call(http, "PATCH", f"/apis/apps/v1/namespaces/{NS}/deployments/mixed-pool-router-proxy/status",
                       {"status": {"readyReplicas": 1}}, "application/merge-patch+json")
        await waiter(lambda: ((pool() or {}).get("status") or {}).get("router", {}).get("proxy") == {
            "desired": 2, "ready": 1}, WAIT_S, "proxy readiness")
        assert "proxy 1/2" in condition(pool(), "Reconciling")["message"]


async def test_shards_without_a_single_router_replica_are_refused_with_the_manifest_path(
    k8s: Any, fresh_kopf_registry: kopf.OperatorRegistry, waiter: Callable[..., Any], mixed_pool: dict[str, Any],
) -> None:
    api = str(k8s.url).rstrip("/")
    pool = lambda: emulated(k8s, POOLS, "mixed-pool")  # noqa: E731
    body = sharded_pool(mixed_pool, 8080, replicas=0)
    async with running_operator(fresh_kopf_registry, api, "http://127.0.0.1:1"), aiohttp.ClientSession(api) as http:
        await api_call(http, "POST", POOL_URL, body, "application/json")
        stalled = await waiter(lambda: condition(pool(), "Stalled").get("status") == "True" and condition(
            pool(), "Stalled"), WAIT_S, "stalled")
        assert stalled["reason"] == "InvalidSpec"
        assert "spec.router.shards: 3 shards need replicas 1" in stalled["message"]
        assert emulated(k8s, "apps/v1/statefulsets", "mixed-pool-router") is None  # nothing written
        # Fixed, but more shards than engines: refused too, naming the same field.
        await api_call(http, "PATCH", f"{POOL_URL}/mixed-pool",
                       {"spec": {"router": {"replicas": 1, "shards": 5}}}, "application/merge-patch+json")
        await waiter(lambda: "5 shards for 4 engines" in condition(pool(), "Stalled").get("message", ""),
                     WAIT_S, "second refusal")
        assert "spec.router.shards" in condition(pool(), "Stalled")["message"]
        assert emulated(k8s, "apps/v1/statefulsets", "mixed-pool-router") is None


async def test_back_to_one_router_scales_the_shards_and_their_proxy_to_zero(
    k8s: Any, fresh_kopf_registry: kopf.OperatorRegistry, waiter: Callable[..., Any], mixed_pool: dict[str, Any],
) -> None:
    api = str(k8s.url).rstrip("/")
    pool = lambda: emulated(k8s, POOLS, "mixed-pool")  # noqa: E731
    replicas = lambda resource, name: ((emulated(k8s, resource, name) or {}).get("spec") or {}).get("replicas")  # noqa: E731
    # No router answers here (nothing listens at these addresses): rendering and scaling need none.
    async with running_operator(fresh_kopf_registry, api, "http://127.0.0.1:1", shard_url="http://127.0.0.1:1/{shard}"), \
            aiohttp.ClientSession(api) as http:
        await api_call(http, "POST", POOL_URL, sharded_pool(mixed_pool, 8080), "application/json")
        await waiter(lambda: ((pool() or {}).get("status") or {}).get("router", {}).get("shards"), WAIT_S, "shards")
        assert replicas("apps/v1/statefulsets", "mixed-pool-router") == N_SHARDS
        assert replicas("apps/v1/deployments", "mixed-pool-router") == 0
        await api_call(http, "PATCH", f"{POOL_URL}/mixed-pool", {"spec": {"router": {"shards": 1}}},
                       "application/merge-patch+json")
        await waiter(lambda: replicas("apps/v1/statefulsets", "mixed-pool-router") == 0
                     and replicas("apps/v1/deployments", "mixed-pool-router-proxy") == 0
                     and replicas("apps/v1/deployments", "mixed-pool-router") == 1, WAIT_S, "shards and proxy at 0")
        svc = emulated(k8s, "v1/services", "mixed-pool-router")
        assert svc is not None and svc["spec"]["selector"]["app.kubernetes.io/component"] == "router"
        config = emulated(k8s, "v1/configmaps", "mixed-pool-router-config")
        assert config is not None and "shards" not in config["data"]["router.yaml"]
