"""The real operator (kopf + handlers) against the emulated API server and a real router.

One operator run walks a pool through its life: create -> children with owner
references -> router config applied -> controllers report ready -> admission
update applied live without touching any Deployment -> an invalid update is
refused with a reason and nothing written. A second pool, invalid from the
start, gets no child at all. The change-to-applied time of the admission
update is measured on the whole path (API write -> kopf watch -> reconcile ->
ConfigMap + PUT /admin/config -> router /status -> pool status) and printed.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import kopf
import yaml

from misat_operator.handlers import register
from misat_operator.settings import OperatorSettings

NS = "rl"
POOLS = "misat.dev/v1alpha1/rolloutpools"
POOL_URL = f"/apis/misat.dev/v1alpha1/namespaces/{NS}/rolloutpools"
CHILDREN = [
    ("v1/secrets", "mixed-pool-router-admin"),
    ("v1/configmaps", "mixed-pool-router-config"),
    ("v1/services", "mixed-pool-engines"),
    ("v1/services", "mixed-pool-router"),
    ("apps/v1/deployments", "mixed-pool-engines"),
    ("apps/v1/deployments", "mixed-pool-router"),
]
WAIT_S = 15.0
STOP_GRACE_S = 0.5
APPLY_GOAL_S = 2.0


@contextlib.asynccontextmanager
async def running_operator(
    registry: kopf.OperatorRegistry, api_url: str, router_url: str
) -> AsyncIterator[None]:
    @kopf.on.login(registry=registry)
    def _login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=api_url, insecure=True)

    settings = OperatorSettings(
        status_interval_s=0.2, router_url=router_url, kube_server=api_url, post_events=False,
        liveness_endpoint=None, router_timeout_s=1.0,
    )
    register(registry, settings)
    stop: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        kopf.operator(registry=registry, clusterwide=True, standalone=True, stop_flag=stop)
    )
    try:
        yield
    finally:
        stop.set_result(None)
        # kopf gives every task spawned after its start 5 s to end on its own (the test's servers'
        # connection tasks among them); past a short grace, cancel it, as SIGTERM twice would.
        done, _ = await asyncio.wait({task}, timeout=STOP_GRACE_S)
        if not done:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _obj(k8s: Any, resource: str, name: str) -> dict[str, Any] | None:
    try:
        obj = k8s.objects[resource, NS, name]
    except KeyError:
        return None
    return None if obj.deleted else dict(obj.raw)


def _cond(pool: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    for c in ((pool or {}).get("status") or {}).get("conditions") or ():
        if c["type"] == type_:
            return dict(c)
    return {}


def _versions(k8s: Any, resource: str, name: str) -> int:
    return len(k8s.objects[resource, NS, name].history)


async def _api(session: aiohttp.ClientSession, method: str, url: str, body: Any, ctype: str) -> dict[str, Any]:
    async with session.request(method, url, json=body, headers={"Content-Type": ctype}) as resp:
        payload = await resp.json()
        assert resp.status < 300, payload
        return dict(payload)


async def test_pool_lifecycle(
    k8s: Any, fresh_kopf_registry: kopf.OperatorRegistry, live_router: Any, waiter: Callable[..., Any],
    mixed_pool: dict[str, Any],
) -> None:
    pool_body = copy.deepcopy(mixed_pool)
    pool_body["metadata"]["namespace"] = NS
    live_router.dns[f"mixed-pool-engines.{NS}.svc.cluster.local"] = live_router.engines
    api = str(k8s.url).rstrip("/")
    pool = lambda: _obj(k8s, POOLS, "mixed-pool")  # noqa: E731

    async with (
        running_operator(fresh_kopf_registry, api, live_router.url),
        aiohttp.ClientSession(api) as http,
    ):
        created = await _api(http, "POST", POOL_URL, pool_body, "application/json")
        uid = created["metadata"]["uid"]

        # -- create: every child exists, controlled by the pool -----------------------------------
        await waiter(lambda: all(_obj(k8s, r, n) for r, n in CHILDREN), WAIT_S, "children")
        for resource, name in CHILDREN:
            (owner,) = _obj(k8s, resource, name)["metadata"]["ownerReferences"]  # type: ignore[index]
            assert owner["uid"] == uid and owner["controller"] is True, (resource, name)

        # -- the router pod mounts the Secret; the status timer's retry then gets the config in --------
        secret = _obj(k8s, "v1/secrets", "mixed-pool-router-admin")
        assert secret is not None
        live_router.mount_token(base64.b64decode(secret["data"]["token"]).decode())
        await waiter(lambda: _cond(pool(), "ConfigApplied").get("status") == "True", WAIT_S, "config applied")
        assert live_router.state.config.generation == 1
        assert {c.name for c in live_router.state.config.workloads.classes} == {"agentic", "rlvr", "rlhf"}
        status = pool()["status"]  # type: ignore[index]
        assert status["observedGeneration"] == 1
        assert status["engines"]["desired"] == 4 and status["engines"]["summary"] == "0/4"
        assert _cond(pool(), "Ready")["reason"] == "EnginesNotReady"
        assert status["mixture"]["target"] == {"agentic": 48.6, "rlvr": 33.2, "rlhf": 18.2}

        # -- the Deployment controller (not emulated) reports ready pods -> Ready ---------------------
        for name, ready in (("mixed-pool-engines", 4), ("mixed-pool-router", 1)):
            await _api(
                http, "PATCH", f"/apis/apps/v1/namespaces/{NS}/deployments/{name}/status",
                {"status": {"readyReplicas": ready}}, "application/merge-patch+json",
            )
        await waiter(lambda: _cond(pool(), "Ready").get("status") == "True", WAIT_S, "Ready")
        ready_since = _cond(pool(), "Ready")["lastTransitionTime"]
        status = pool()["status"]  # type: ignore[index]
        assert status["engines"]["summary"] == "4/4"
        assert status["kv"]["capacityTokens"] > 0
        assert {c["name"] for c in status["classes"]} == {"agentic", "rlvr", "rlhf"}
        assert status["lastUpdateTime"]

        # -- admission update: ConfigMap and router change, no Deployment is written -----------------
        deploy_versions = {n: _versions(k8s, r, n) for r, n in CHILDREN if r == "apps/v1/deployments"}
        templates = {n: copy.deepcopy(_obj(k8s, r, n)["spec"]) for r, n in CHILDREN if "deploy" in r}  # type: ignore[index]
        started = time.monotonic()
        await _api(
            http, "PATCH", f"{POOL_URL}/mixed-pool",
            {"spec": {"admission": {"policy": "misa", "sessionAdmission": {"confirmEpochs": 7}}}},
            "application/merge-patch+json",
        )
        await waiter(
            lambda: _cond(pool(), "ConfigApplied").get("observedGeneration") == 2
            and _cond(pool(), "ConfigApplied")["status"] == "True",
            WAIT_S, "generation 2 applied",
        )
        elapsed = time.monotonic() - started
        print(f"\nchange-to-applied (API write -> ConfigApplied=True): {elapsed:.3f} s")
        assert elapsed <= APPLY_GOAL_S, f"hot reload took {elapsed:.2f} s"
        assert live_router.state.config.policy.name.value == "misa"
        assert live_router.state.config.policy.admission.confirm_epochs == 7
        cm = _obj(k8s, "v1/configmaps", "mixed-pool-router-config")
        assert cm is not None
        rendered = yaml.safe_load(cm["data"]["router.yaml"])
        assert rendered["generation"] == 2 and rendered["policy"]["admission"]["confirm_epochs"] == 7
        assert {n: _versions(k8s, r, n) for r, n in CHILDREN if r == "apps/v1/deployments"} == deploy_versions
        assert {n: _obj(k8s, r, n)["spec"] for r, n in CHILDREN if "deploy" in r} == templates  # type: ignore[index]
        await waiter(lambda: _cond(pool(), "Ready").get("status") == "True", WAIT_S, "Ready again")
        assert _cond(pool(), "Ready")["lastTransitionTime"] == ready_since, "Ready never flapped"

        # -- invalid update: refused with a reason, nothing written, router untouched -----------------
        child_versions = {(r, n): _versions(k8s, r, n) for r, n in CHILDREN}
        bad = copy.deepcopy(pool()["spec"])  # type: ignore[index]
        bad["workloads"][0]["share"] = 10.0
        await _api(http, "PATCH", f"{POOL_URL}/mixed-pool", {"spec": {"workloads": bad["workloads"]}},
                   "application/merge-patch+json")
        await waiter(lambda: _cond(pool(), "Degraded").get("reason") == "InvalidSpec", WAIT_S, "InvalidSpec")
        assert _cond(pool(), "Degraded")["message"] == "spec: workloads: shares must sum to 100, they sum to 61.4"
        assert _cond(pool(), "ConfigApplied")["status"] == "False"
        assert _cond(pool(), "Ready")["status"] == "False"
        assert pool()["status"]["observedGeneration"] == 3  # type: ignore[index]
        assert {(r, n): _versions(k8s, r, n) for r, n in CHILDREN} == child_versions
        assert live_router.state.config.generation == 2

        # -- a pool invalid from birth gets no children at all ------------------------------------------
        broken = copy.deepcopy(pool_body)
        broken["metadata"] = {"name": "broken", "namespace": NS}
        broken["spec"]["engines"]["extraArgs"] = ["--port", "9000"]
        await _api(http, "POST", POOL_URL, broken, "application/json")
        await waiter(
            lambda: _cond(_obj(k8s, POOLS, "broken"), "ConfigApplied").get("reason") == "InvalidSpec",
            WAIT_S, "broken pool marked invalid",
        )
        assert _cond(_obj(k8s, POOLS, "broken"), "Degraded")["message"].startswith(
            "spec.engines.extraArgs: extraArgs[0] --port is set from a typed field"
        )
        for resource in ("v1/secrets", "v1/configmaps", "v1/services", "apps/v1/deployments"):
            for suffix in ("-engines", "-router", "-router-config", "-router-admin"):
                assert _obj(k8s, resource, f"broken{suffix}") is None

    # -- GitOps: the operator never wrote a spec (only the test's two spec patches carry one) ------------
    spec_writes = [
        r for r in list(k8s)
        if r.resource is not None and r.resource.plural == "rolloutpools" and r.method == "PATCH"
        and isinstance(r.data, dict) and "spec" in r.data
    ]
    assert len(spec_writes) == 2


async def test_router_scaled_to_zero_is_not_pushed(
    k8s: Any, fresh_kopf_registry: kopf.OperatorRegistry, live_router: Any, waiter: Callable[..., Any],
    mixed_pool: dict[str, Any],
) -> None:
    """With spec.router.replicas 0 the pool still reconciles; config waits in the ConfigMap."""
    body = copy.deepcopy(mixed_pool)
    body["metadata"]["namespace"] = NS
    body["spec"]["router"]["replicas"] = 0
    api = str(k8s.url).rstrip("/")
    async with running_operator(fresh_kopf_registry, api, live_router.url), aiohttp.ClientSession(api) as http:
        await _api(http, "POST", POOL_URL, body, "application/json")
        await waiter(lambda: _obj(k8s, "apps/v1/deployments", "mixed-pool-router"), WAIT_S, "router deployment")
        await waiter(lambda: _cond(_obj(k8s, POOLS, "mixed-pool"), "ConfigApplied"), WAIT_S, "conditions")
        assert _obj(k8s, "apps/v1/deployments", "mixed-pool-router")["spec"]["replicas"] == 0  # type: ignore[index]
        assert _cond(_obj(k8s, POOLS, "mixed-pool"), "ConfigApplied")["status"] == "False"
        assert live_router.state.config.generation == 0
