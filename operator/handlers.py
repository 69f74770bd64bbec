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
    """Clients shared by all handlers; created on operator start-up, closed on cleanup."""

    settings: OperatorSettings
    kube: KubeClient | None = None
    router: RouterClient = field(default_factory=RouterClient)

    def kube_client(self) -> KubeClient:
        assert self.kube is not None, "operator not started"
        return self.kube


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


def _report_invalid(patch: kopf.Patch, status: Any, generation: int, message: str) -> None:
    patch.status["observedGeneration"] = generation
    patch.status["conditions"] = merge_conditions(
        status.get("conditions"), invalid_spec_conditions(message), generation, now_iso()
    )


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


def status_patch(
    patch: kopf.Patch, status: Any, ref: PoolRef, pool: RolloutPoolSpec, rt: Runtime,
    obs: Observed, view: dict[str, Any] | None, push_error: str | None, extra: list[Cond] | None = None,
) -> None:
    """Write everything the status shows from one observation (merge patch of .status)."""
    now = now_iso()
    names = ref.names
    conds = health_conditions(obs)
    if push_error and not (obs.router and obs.router.generation >= ref.generation):
        conds = [c for c in conds if c.type != "ConfigApplied"]
        conds.append(Cond("ConfigApplied", False, "PushFailed", push_error))
    patch.status["observedGeneration"] = ref.generation
    patch.status["conditions"] = merge_conditions(status.get("conditions"), conds + (extra or []), ref.generation, now)
    patch.status["engines"] = {
        "desired": obs.engines_desired,
        "ready": obs.engines_ready,
        "summary": f"{obs.engines_ready}/{obs.engines_desired}",
        "selector": names.selector_string(ENGINE_COMPONENT),
    }
    patch.status["router"] = {
        "ready": bool(obs.router and obs.router.ready),
        "readyReplicas": obs.router_ready_replicas,
        "healthyEngines": obs.router.healthy_engines if obs.router else None,
        "url": names.router_url(pool.router.port, rt.settings.cluster_domain),
    }
    patch.status["config"] = {
        "desiredGeneration": ref.generation,
        "appliedGeneration": obs.router.generation if obs.router else None,
        "hash": obs.router.config_hash if obs.router else None,
        "lastError": push_error or (obs.router.last_reload_error if obs.router else None),
    }
    if view is not None:
        patch.status.update(view)
        patch.status["lastUpdateTime"] = now


async def reconcile(
    rt: Runtime, *, spec: Any, meta: Any, status: Any, name: str, namespace: str, patch: kopf.Patch,
    logger: Any,
) -> None:
    generation = _generation(meta)
    kube = rt.kube_client()
    try:
        pool = validate(spec, name)
        ref = PoolRef(name, namespace, str(meta["uid"]), generation)
        token = await _admin_token(kube, ref.names) or secrets.token_urlsafe(TOKEN_BYTES)
        desired = render(pool, ref, token, rt.settings.cluster_domain)
    except (InvalidPool, ValueError) as exc:
        _report_invalid(patch, status, generation, str(exc))
        raise kopf.PermanentError(f"invalid RolloutPool: {exc}") from None
    except KubeError as exc:
        raise kopf.TemporaryError(str(exc), delay=KUBE_RETRY_DELAY_S) from None
    try:
        for obj in desired.objects():
            action = await apply_object(kube, obj, ref.uid)
            logger.debug("%s %s: %s", obj["kind"], obj["metadata"]["name"], action.value)
    except NotOwned as exc:
        _report_invalid(patch, status, generation, str(exc))
        raise kopf.PermanentError(str(exc)) from None
    except KubeError as exc:
        raise kopf.TemporaryError(str(exc), delay=KUBE_RETRY_DELAY_S) from None
    push_error = None
    if pool.router.replicas:
        push_error = await push_config(rt, ref, pool.router.port, token, desired.router_config)
    obs, view = await observe(rt, ref, pool)
    status_patch(patch, status, ref, pool, rt, obs, view, push_error)


async def status_tick(
    rt: Runtime, *, spec: Any, meta: Any, status: Any, name: str, namespace: str, patch: kopf.Patch,
) -> None:
    generation = _generation(meta)
    if status.get("observedGeneration") != generation:
        return  # a reconcile of this generation has not finished (or failed): it reports first
    try:
        pool = validate(spec, name)
    except InvalidPool:
        return  # conditions already say InvalidSpec; nothing to observe
    ref = PoolRef(name, namespace, str(meta["uid"]), generation)
    try:
        obs, view = await observe(rt, ref, pool)
        push_error = None
        if obs.router is not None and obs.router.generation < generation:
            token = await _admin_token(rt.kube_client(), ref.names)
            if token:
                config = build_router_config(pool, ref, rt.settings.cluster_domain)
                push_error = await push_config(rt, ref, pool.router.port, token, config)
                if push_error is None:
                    obs, view = await observe(rt, ref, pool)
    except KubeError as exc:
        raise kopf.TemporaryError(str(exc), delay=KUBE_RETRY_DELAY_S) from None
    status_patch(patch, status, ref, pool, rt, obs, view, push_error)


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

    @kopf.on.cleanup(registry=registry)
    async def _cleanup(**_: Any) -> None:
        if rt.kube is not None:
            await rt.kube.close()
        await rt.router.close()

    async def _reconcile(**kwargs: Any) -> None:
        await reconcile(
            rt, spec=kwargs["spec"], meta=kwargs["meta"], status=kwargs["status"], name=kwargs["name"],
            namespace=kwargs["namespace"], patch=kwargs["patch"], logger=kwargs["logger"],
        )

    for cause, decorator in (("create", kopf.on.create), ("update", kopf.on.update), ("resume", kopf.on.resume)):
        decorator(*resource, registry=registry, id=f"reconcile-{cause}")(_reconcile)

    @kopf.timer(*resource, registry=registry, id="status", interval=settings.status_interval_s)
    async def _status(**kwargs: Any) -> None:
        await status_tick(
            rt, spec=kwargs["spec"], meta=kwargs["meta"], status=kwargs["status"], name=kwargs["name"],
            namespace=kwargs["namespace"], patch=kwargs["patch"],
        )

    return rt
