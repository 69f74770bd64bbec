"""kopf handlers: reconcile (create/update/resume), hot reload, status timer. The only API I/O.

Shape of every pass: validate the whole spec, render every object, then apply
(create, patch only differences, or leave alone) in a fixed order, push the
router config, and report. An invalid spec stops before the first write:
conditions say why (``InvalidSpec``) and ``kopf.PermanentError`` ends the
retries until the spec changes. The operator writes the pool's status (and
kopf's bookkeeping annotations), never its spec.

Hot reload: the ConfigMap is patched and ``PUT /admin/config`` is sent at
once; ``ConfigApplied`` turns True only when the router's ``/status`` reports
the pool's generation. The timer retries the push while the router lags
(e.g. a router that was still starting), and the router's own file watcher is
the fallback when the operator cannot reach it.

``register(registry, settings)`` wires everything into a given registry, so
each test runs a fresh one.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field
from typing import Any

import kopf
from pydantic import ValidationError

from misat_router.config import RouterConfig

from .apply import NotOwned, apply_object
from .kube import Credentials, KubeClient, KubeError, from_kubeconfig, in_cluster
from .models import RolloutPoolSpec, describe_spec_error, parse_spec, pool_name_error
from .names import GROUP, PLURAL, VERSION, PoolNames
from .render import (
    ENGINE_COMPONENT,
    PoolRef,
    build_router_config,
    render,
    token_from_secret,
)
from .router_client import RouterClient, RouterUnavailable
from .settings import OperatorSettings
from .status import (
    Cond,
    Observed,
    deployment_ready,
    health_conditions,
    invalid_spec_conditions,
    merge_conditions,
    now_iso,
    router_view,
)

TOKEN_BYTES = 32
KUBE_RETRY_DELAY_S = 5.0
ANNOTATION_PREFIX = GROUP


class InvalidPool(Exception):
    """The spec cannot be applied; the message names the path and the problem."""


@dataclass
class Runtime:
    """Clients shared by all handlers (created on start-up, closed on cleanup), and per-pool
    serialisation: reconcile and the status timer of one pool never interleave, and each writes
    its status inside the pool's lock, so an older observation can never overwrite a newer one."""

    settings: OperatorSettings
    kube: KubeClient | None = None
    router: RouterClient = field(default_factory=RouterClient)
    locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    reconciled: dict[str, int] = field(default_factory=dict)
    """Latest generation a reconcile started on, per pool uid (a timer with an older body skips)."""
    conditions: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """Conditions last written per pool uid (transition times survive a stale handler body)."""
    stopping: bool = False
    """Set on cleanup: kopf may still tick timers while it exits; they must not reopen clients."""

    def kube_client(self) -> KubeClient:
        assert self.kube is not None, "operator not started"
        return self.kube

    def lock(self, uid: str) -> asyncio.Lock:
        return self.locks.setdefault(uid, asyncio.Lock())

    def known_conditions(self, uid: str, status: Any) -> Any:
        return self.conditions.get(uid) or status.get("conditions")

    async def write_status(self, ref: PoolRef, body: dict[str, Any]) -> None:
        await self.kube_client().patch_pool_status(ref.namespace, ref.name, body)
        if "conditions" in body:
            self.conditions[ref.uid] = body["conditions"]


def kube_credentials(settings: OperatorSettings) -> Credentials:
    if settings.kube_server:
        return Credentials(server=settings.kube_server)
    return in_cluster() or from_kubeconfig()


def validate(spec: Any, name: str) -> RolloutPoolSpec:
    """The typed spec, or InvalidPool naming every problem (pure)."""
    problem = pool_name_error(name)
    if problem:
        raise InvalidPool(problem)
    try:
        return parse_spec(dict(spec))
    except ValidationError as exc:
        raise InvalidPool(describe_spec_error(exc)) from None


def _generation(meta: Any) -> int:
    return int(meta.get("generation") or 1)


async def _report_invalid(rt: Runtime, ref: PoolRef, status: Any, message: str) -> None:
    conditions = merge_conditions(
        rt.known_conditions(ref.uid, status), invalid_spec_conditions(message), ref.generation, now_iso()
    )
    await rt.write_status(ref, {"observedGeneration": ref.generation, "conditions": conditions})


async def _admin_token(kube: KubeClient, names: PoolNames) -> str | None:
    secret = await kube.get("v1", "Secret", names.namespace, names.admin_secret)
    return token_from_secret(secret) if secret else None


async def push_config(rt: Runtime, ref: PoolRef, port: int, token: str, config: RouterConfig) -> str | None:
    """Push the config to the router; returns the error text, or None when the router took it."""
    url = rt.settings.router_base_url(ref.name, ref.namespace, port)
    try:
        await rt.router.push_config(url, token, config)
    except RouterUnavailable as exc:
        return str(exc)
    return None


async def observe(rt: Runtime, ref: PoolRef, pool: RolloutPoolSpec) -> tuple[Observed, dict[str, Any] | None]:
    """One snapshot: both Deployments' readiness and the router's /status (None if unreachable)."""
    kube = rt.kube_client()
    names = ref.names
    engines = await kube.get("apps/v1", "Deployment", ref.namespace, names.engines)
    router = await kube.get("apps/v1", "Deployment", ref.namespace, names.router)
    url = rt.settings.router_base_url(ref.name, ref.namespace, pool.router.port)
    router_status, error = None, None
    if pool.router.replicas:
        try:
            router_status = await rt.router.status(url)
        except RouterUnavailable as exc:
            error = str(exc)
    obs = Observed(
        generation=ref.generation,
        engines_desired=pool.engines.replicas,
        engines_ready=deployment_ready(engines),
        router_desired=pool.router.replicas,
        router_ready_replicas=deployment_ready(router),
        router=router_status,
        router_error=error,
    )
    view = router_view(router_status) if router_status is not None else None
    return obs, view


def build_status(
    rt: Runtime, status: Any, ref: PoolRef, pool: RolloutPoolSpec,
    obs: Observed, view: dict[str, Any] | None, push_error: str | None,
) -> dict[str, Any]:
    """Everything the status shows from one observation (a merge patch of .status)."""
    now = now_iso()
    out: dict[str, Any] = {}
    names = ref.names
    conds = health_conditions(obs)
    if push_error and not (obs.router and obs.router.generation >= ref.generation):
        conds = [c for c in conds if c.type != "ConfigApplied"]
        conds.append(Cond("ConfigApplied", False, "PushFailed", push_error))
    out["observedGeneration"] = ref.generation
    out["conditions"] = merge_conditions(rt.known_conditions(ref.uid, status), conds, ref.generation, now)
    out["engines"] = {
        "desired": obs.engines_desired,
        "ready": obs.engines_ready,
        "summary": f"{obs.engines_ready}/{obs.engines_desired}",
        "selector": names.selector_string(ENGINE_COMPONENT),
    }
    out["router"] = {
        "ready": bool(obs.router and obs.router.ready),
        "readyReplicas": obs.router_ready_replicas,
        "healthyEngines": obs.router.healthy_engines if obs.router else None,
        "url": names.router_url(pool.router.port, rt.settings.cluster_domain),
    }
    out["config"] = {
        "desiredGeneration": ref.generation,
        "appliedGeneration": obs.router.generation if obs.router else None,
        "hash": obs.router.config_hash if obs.router else None,
        "lastError": push_error or (obs.router.last_reload_error if obs.router else None),
    }
    if view is not None:
        out.update(view)
        out["lastUpdateTime"] = now
    return out


async def reconcile(
    rt: Runtime, *, spec: Any, meta: Any, status: Any, name: str, namespace: str, logger: Any,
) -> None:
    ref = PoolRef(name, namespace, str(meta["uid"]), _generation(meta))
    async with rt.lock(ref.uid):
        rt.reconciled[ref.uid] = max(ref.generation, rt.reconciled.get(ref.uid, 0))
        await _reconcile_locked(rt, ref, spec, status, logger)


async def _reconcile_locked(rt: Runtime, ref: PoolRef, spec: Any, status: Any, logger: Any) -> None:
    kube = rt.kube_client()
    try:
        try:
            pool = validate(spec, ref.name)
            token = await _admin_token(kube, ref.names) or secrets.token_urlsafe(TOKEN_BYTES)
            desired = render(pool, ref, token, rt.settings.cluster_domain)
        except (InvalidPool, ValueError) as exc:
            await _report_invalid(rt, ref, status, str(exc))
            raise kopf.PermanentError(f"invalid RolloutPool: {exc}") from None
        try:
            for obj in desired.objects():
                action = await apply_object(kube, obj, ref.uid)
                logger.debug("%s %s: %s", obj["kind"], obj["metadata"]["name"], action.value)
        except NotOwned as exc:
            await _report_invalid(rt, ref, status, str(exc))
            raise kopf.PermanentError(str(exc)) from None
        push_error = None
        if pool.router.replicas:
            push_error = await push_config(rt, ref, pool.router.port, token, desired.router_config)
        obs, view = await observe(rt, ref, pool)
        await rt.write_status(ref, build_status(rt, status, ref, pool, obs, view, push_error))
    except KubeError as exc:
        raise kopf.TemporaryError(str(exc), delay=KUBE_RETRY_DELAY_S) from None


async def status_tick(
    rt: Runtime, *, spec: Any, meta: Any, status: Any, name: str, namespace: str,
) -> None:
    ref = PoolRef(name, namespace, str(meta["uid"]), _generation(meta))
    if rt.stopping or status.get("observedGeneration") != ref.generation:
        return  # a reconcile of this generation has not reported yet (or failed): it reports first
    try:
        pool = validate(spec, name)
    except InvalidPool:
        return  # conditions already say InvalidSpec; nothing to observe
    async with rt.lock(ref.uid):
        if rt.reconciled.get(ref.uid, ref.generation) > ref.generation:
            return  # this body is older than what a reconcile already reported
        try:
            obs, view = await observe(rt, ref, pool)
            push_error = None
            if obs.router is not None and obs.router.generation < ref.generation:
                token = await _admin_token(rt.kube_client(), ref.names)
                if token:
                    config = build_router_config(pool, ref, rt.settings.cluster_domain)
                    push_error = await push_config(rt, ref, pool.router.port, token, config)
                    if push_error is None:
                        obs, view = await observe(rt, ref, pool)
            await rt.write_status(ref, build_status(rt, status, ref, pool, obs, view, push_error))
        except KubeError as exc:
            raise kopf.TemporaryError(str(exc), delay=KUBE_RETRY_DELAY_S) from None


def register(registry: kopf.OperatorRegistry, settings: OperatorSettings) -> Runtime:
    """Register every handler of the operator into ``registry``; returns the shared runtime."""
    rt = Runtime(settings=settings, router=RouterClient(settings.router_timeout_s))
    resource = (GROUP, VERSION, PLURAL)

    @kopf.on.startup(registry=registry)
    async def _startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
        )
        settings.posting.enabled = rt.settings.post_events
        rt.kube = KubeClient(kube_credentials(rt.settings))

    @kopf.on.delete(*resource, registry=registry, id="forget", optional=True)
    async def _forget(meta: Any, **_: Any) -> None:
        """Drop per-pool memory; the children go with the pool (owner references, GC)."""
        uid = str(meta.get("uid"))
        rt.locks.pop(uid, None)
        rt.reconciled.pop(uid, None)
        rt.conditions.pop(uid, None)

    @kopf.on.cleanup(registry=registry)
    async def _cleanup(**_: Any) -> None:
        rt.stopping = True
        if rt.kube is not None:
            await rt.kube.close()
        await rt.router.close()

    async def _reconcile(**kwargs: Any) -> None:
        await reconcile(
            rt, spec=kwargs["spec"], meta=kwargs["meta"], status=kwargs["status"], name=kwargs["name"],
            namespace=kwargs["namespace"], logger=kwargs["logger"],
        )

    for cause, decorator in (("create", kopf.on.create), ("update", kopf.on.update), ("resume", kopf.on.resume)):
        decorator(*resource, registry=registry, id=f"reconcile-{cause}")(_reconcile)

    @kopf.timer(*resource, registry=registry, id="status", interval=settings.status_interval_s)
    async def _status(**kwargs: Any) -> None:
        await status_tick(
            rt, spec=kwargs["spec"], meta=kwargs["meta"], status=kwargs["status"], name=kwargs["name"],
            namespace=kwargs["namespace"],
        )

    return rt
