"""Shared fixtures of the operator tests (test modules cannot import each other here:
``tests/operator`` must not become a package, or it would shadow the stdlib ``operator``)."""

from __future__ import annotations

import asyncio
import copy
import itertools
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import attrs
import jsonpatch
import jsonpointer
import kmock
import kopf
import pytest
import pytest_asyncio
import yaml
from aiohttp import web
from kmock._internal.dicts import merge_patch_dict

from misat_operator.render import PoolRef
from misat_router import lifecycle as router_lifecycle
from misat_router.app import create_app
from misat_router.service import start_service
from misat_router.state import STATE, RouterState
from misat_sim.config import SimEngineConfig
from misat_sim.server import start_server
from tests.support.router_config import router_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def mixed_pool() -> dict[str, Any]:
    """examples/mixed-pool.yaml as a mapping (a fresh copy per test)."""
    return yaml.safe_load((ROOT / "examples" / "mixed-pool.yaml").read_text())


@pytest.fixture
def pool_ref() -> PoolRef:
    return PoolRef(name="mixed-pool", namespace="rl", uid="0c7f3e8a-1111-4222-8333-944455556666", generation=3)


# ---- a Kubernetes API emulator that behaves enough like the real one for kopf ----------------
#
# kmock's KubernetesEmulator stores objects verbatim. kopf and this operator rely on what a real
# API server adds, so the subclass below closes these gaps (docs/operator.md lists what stays
# unemulated): uid, resourceVersion, generation and creationTimestamp stamped on create;
# resourceVersion bumped on every write and generation on spec changes only; the status
# subresource (a PATCH of /status changes only .status, a PATCH of the object never changes it);
# optimistic concurrency on metadata.resourceVersion (409); failed JSON-patch tests as 422;
# lists carrying kind, apiVersion and a resourceVersion; watches that start after the listed
# resourceVersion instead of replaying every object.


def _with_data(request: kmock.Request, data: Any) -> kmock.Request:
    """The request with a rewritten body. kmock matches reactions against the very request object
    it logged, so the frozen object is updated in place rather than copied."""
    object.__setattr__(request, "data", data)
    return request


@attrs.define(kw_only=True)
class FaithfulEmulator(kmock.KubernetesEmulator):
    _rv: itertools.count = attrs.field(factory=lambda: itertools.count(1), init=False)

    def _has_status_subresource(self, resource: Any) -> bool:
        try:
            return "status" in self.resources[resource].subresources
        except (KeyError, TypeError):
            return False

    def _stamped(self, request: kmock.Request) -> kmock.Request:
        rv = str(next(self._rv))
        if request.action == kmock.action.CREATE and isinstance(request.data, dict):
            data = copy.deepcopy(request.data)
            meta = data.setdefault("metadata", {})
            meta.setdefault("namespace", request.namespace)
            meta.update(
                uid=str(uuid.uuid4()), resourceVersion=rv, generation=1,
                creationTimestamp=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            )
            if self._has_status_subresource(request.resource):
                data.pop("status", None)
            return _with_data(request, data)
        key = (request.resource, request.namespace, request.name)
        if request.action != kmock.action.UPDATE or key not in self.objects or self.objects[key].deleted:
            return request
        current = copy.deepcopy(self.objects[key].raw)
        data = copy.deepcopy(request.data)
        if isinstance(data, list):
            try:
                new = jsonpatch.apply_patch(current, data)
            except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as exc:
                raise kmock.KubernetesError(status=422, reason="Invalid", message=str(exc)) from None
            ops = [{"op": "add", "path": "/metadata/resourceVersion", "value": rv}]
            if new.get("spec") != current.get("spec"):
                ops.append({"op": "add", "path": "/metadata/generation", "value": current["metadata"]["generation"] + 1})
            return _with_data(request, data + ops)
        if not isinstance(data, dict):
            return request
        given_rv = (data.get("metadata") or {}).get("resourceVersion")
        if given_rv is not None and given_rv != current["metadata"].get("resourceVersion"):
            raise kmock.KubernetesError(status=409, reason="Conflict", message="the object has been modified")
        if request.subresource == "status":
            data = {"status": data.get("status")}
        elif self._has_status_subresource(request.resource):
            data.pop("status", None)
        data.setdefault("metadata", {})["resourceVersion"] = rv
        new = merge_patch_dict(current, data)
        if "generation" in current["metadata"] and new.get("spec") != current.get("spec"):
            data["metadata"]["generation"] = current["metadata"]["generation"] + 1
        return _with_data(request, data)

    async def _handle(self, request: kmock.Request) -> Any:
        if request.resource is not None and request.action in (kmock.action.CREATE, kmock.action.UPDATE):
            try:
                request = self._stamped(request)
            except kmock.KubernetesError as exc:
                return await self._render_error(exc)
        return await super()._handle(request)

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        """Start after ``?resourceVersion=`` as the real API does; kmock replays every object,
        which hands kopf a stale copy of what it just listed (its next patch then conflicts)."""
        since = request.params.get("resourceVersion", "")
        async for event in super()._serve_watch(request):
            obj = event.get("object") if isinstance(event, dict) else None
            rv = str(((obj or {}).get("metadata") or {}).get("resourceVersion", ""))
            if since.isdigit() and rv.isdigit() and int(rv) <= int(since):
                continue
            yield event

    async def _serve_list(self, request: kmock.Request) -> Any:
        payload = await super()._serve_list(request)
        info = self.resources[request.resource]
        group_version = (
            request.resource.version if not request.resource.group
            else f"{request.resource.group}/{request.resource.version}"
        )
        return {
            **payload,
            "apiVersion": group_version,
            "kind": f"{info.kind}List",
            "metadata": {"resourceVersion": str(next(self._rv))},
        }


POOLS = "misat.dev/v1alpha1/rolloutpools"
DEPLOYMENTS = "apps/v1/deployments"


@pytest_asyncio.fixture
async def k8s() -> AsyncIterator[FaithfulEmulator]:
    """The emulated API server with the bundled built-in resources and the RolloutPool CRD."""
    async with FaithfulEmulator() as emulator, kmock.Server(emulator):
        emulator.resources.load_bundled()
        emulator.resources[POOLS] = kmock.ResourceInfo(
            kind="RolloutPool", singular="rolloutpool", namespaced=True, shortnames={"rp"},
            verbs={"list", "watch", "get", "create", "patch", "update", "delete"},
            subresources={"status", "scale"},
        )
        yield emulator


@pytest.fixture
def fresh_kopf_registry() -> Iterator[kopf.OperatorRegistry]:
    """A registry for one test; kopf's default registry is restored afterwards."""
    default = kopf.get_default_registry()
    registry = kopf.OperatorRegistry()
    try:
        yield registry
    finally:
        kopf.set_default_registry(default)


async def wait_for(predicate: Callable[[], Any], timeout_s: float = 10.0, what: str = "condition") -> Any:
    """Bounded poll of a condition on emulator state (kopf offers no event to await)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.02)


@pytest.fixture
def waiter() -> Callable[..., Any]:
    return wait_for


# ---- a real router (misat_router.app) on a local port, with simulated engines behind fake DNS ----


@dataclass
class LiveRouter:
    """A running router app; ``dns`` maps Service names to engine URLs (the headless Service)."""

    url: str
    app: web.Application
    dns: dict[str, list[str]]
    engines: list[str]

    @property
    def state(self) -> RouterState:
        return self.app[STATE]

    def mount_token(self, token: str) -> None:
        """What kubelet does when the admin Secret is mounted: the router now knows the token."""
        self.state.admin_token = token


@pytest_asyncio.fixture
async def live_router(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[LiveRouter]:
    """Router + two simulated engines. The router starts as a fresh pod would: generation 0, one
    class, and an admin token it has not read yet (tests call ``mount_token``)."""
    dns: dict[str, list[str]] = {}

    async def fake_resolve(ref: Any) -> list[str]:
        if ref.name not in dns:
            raise OSError(f"cannot resolve {ref.name}")
        return list(dns[ref.name])

    monkeypatch.setattr(router_lifecycle, "resolve_service", fake_resolve)
    engines = [
        await start_server(SimEngineConfig(profile="tiny-cpu", served_model_name="policy", seed=i))
        for i in range(2)
    ]
    # Project defaults (generation 0, the default policy and epoch), one class, probes every 0.1 s.
    config = router_config(
        [e.base_url for e in engines], policy=None, epoch_s=None, fast=False, generation=None, model="policy",
        classes=[{"name": "rlvr", "share": 100.0}], scrape_interval_s=0.1, health_interval_s=0.1,
    )
    app = create_app(config, admin_token="not-mounted-yet")
    service = await start_service(app)
    try:
        yield LiveRouter(service.url, app, dns, [e.base_url for e in engines])
    finally:
        await service.stop()
        for e in engines:
            await e.stop()
