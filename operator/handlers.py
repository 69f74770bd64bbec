"""kopf wiring and the reconcile pass. The only API I/O (with kube.py and router_client.py).

Level-triggered: one function, ``converge``, makes the cluster match a pool's
spec from whatever it finds, and everything only asks for it to run:

- a pool's watch event with a new generation (create, update, an operator
  start: kopf lists every pool first);
- a watch event on a Deployment, Service or ConfigMap labelled as a pool's
  child (edited, deleted, its status moved), for the pool that controls it;
- the resync tick (``status_interval_s``) for every pool: status refresh, a
  lagging config push, drift on Secrets (not watched: a cluster-wide watch on
  Secrets is a grant worth avoiding), and conflicts with foreign objects
  (which carry no pool label, so no event announces that they went).

Runs of one pool never overlap: a request while one runs marks it dirty and
it runs once more after. No kopf timer, daemon or on-delete handler is
registered, so kopf adds no finalizer: deleting a pool needs no operator
(children go by owner references), and a pool never waits for an operator
that was uninstalled. kopf's finalizer name is set to the project's own
(``FINALIZER``) all the same, and the finalizer an older version added
(``RETIRED_FINALIZER``) is removed on sight.

Shape of a pass: validate the whole spec and render every object (an invalid
spec stops here: ``Stalled``/``InvalidSpec``, nothing written); read what the
rollout order needs (engine Deployment, ConfigMap, the router's /status);
apply in order (Secret, ConfigMap, Services, Deployments); push the router
config when the router runs another; write the status; post an Event per
condition transition. A child the API server refuses makes the generation
``Stalled`` (``ChildRefused``, the server's message, the child named) and
backs off; a foreign object with a child's name makes it ``Stalled``
(``NameConflict``) until it goes, checked every tick. The operator writes the
pool's status, never its spec.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import math
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf
from pydantic import ValidationError

from misat_router.config import RouterConfig
from misat_router.shard_status import ShardReading, combine_shards
from misat_router.status import RouterStatus

from .apply import ChildProblem, NameConflict, apply_object
from .kube import Credentials, KubeClient, KubeError, from_kubeconfig, in_cluster
from .models import RolloutPoolSpec, describe_spec_error, effective_values, parse_spec, pool_name_error
from .names import API_VERSION, CONFIG_KEY, GROUP, KIND, MANAGER, PLURAL, POOL_LABEL, VERSION, PoolNames
from .render import ENGINE_COMPONENT, PROXY_REPLICAS, PoolRef, build_config_map, render, token_from_secret
from .rollout import (
    DELETION_COST_ANNOTATION,
    DRAINED_DELETION_COST,
    Drain,
    ScalePlan,
    config_engine_port,
    drain_from_status,
    drain_to_status,
    engine_rows,
    needs_recreate,
    plan_scale,
    pods_of_engines,
    routed_port,
    with_rollout_order,
)
from .router_client import ConfigRefused, RouterClient, RouterUnavailable
from .settings import OperatorSettings
from .status import (
    INVALID_SPEC,
    STALLED,
    Cond,
    Observed,
    Pending,
    PushError,
    Stall,
    deployment_ready,
    held_engines,
    merge_conditions,
    now_iso,
    pool_conditions,
    push_condition,
    router_view,
    shards_error,
    shards_view,
    stalled_conditions,
    transitions,
    weight_versions,
)

log = logging.getLogger(__name__)

TOKEN_BYTES = 32
ANNOTATION_PREFIX = GROUP
FINALIZER = f"{GROUP}/operator"
"""kopf's finalizer name for this operator (no handler registered needs one today)."""
RETIRED_FINALIZER = "kopf.zalando.org/KopfFinalizerMarker"
"""kopf's default, added by earlier versions for their status timer; removed on sight."""
EVENT_MESSAGE_LIMIT = 1024
"""Longest Event message written (the API server truncates longer ones anyway)."""
CHILD_RESOURCES = (
    ("apps", "v1", "deployments"), ("apps", "v1", "statefulsets"), ("", "v1", "services"), ("", "v1", "configmaps"),
)
"""Watched children (Secrets are repaired by the resync tick; see the module docstring)."""


class InvalidPool(Exception):
    """The spec cannot be applied; the message names the path and the problem."""


@dataclass
class StallState:
    """A generation that cannot progress on its own, and when to try it again (loop time)."""

    generation: int
    stall: Stall
    retry_at: float
    attempts: int = 1


@dataclass
class PoolMemory:
    """What the operator keeps per pool between passes (all of it can be rebuilt from the cluster)."""

    body: dict[str, Any]
    conditions: list[dict[str, Any]] | None = None
    """Conditions last written (the watch's copy of the status may be older)."""
    stall: StallState | None = None
    drain: Drain | None = None
    dirty: bool = False
    task: asyncio.Task[None] | None = None

    @property
    def uid(self) -> str:
        return str(self.body["metadata"]["uid"])

    @property
    def generation(self) -> int:
        return _generation(self.body.get("metadata") or {})


@dataclass
class Runtime:
    """Clients shared by all passes (created on start-up, closed on cleanup) and per-pool memory."""

    settings: OperatorSettings
    kube: KubeClient | None = None
    router: RouterClient = field(default_factory=RouterClient)
    pools: dict[str, PoolMemory] = field(default_factory=dict)
    stopping: bool = False
    """Set on cleanup: nothing new starts (kopf may still deliver events while it exits)."""
    resync: asyncio.Task[None] | None = None

    def kube_client(self) -> KubeClient:
        assert self.kube is not None, "operator not started"
        return self.kube

    def see(self, body: Mapping[str, Any]) -> bool:
        """Record a pool's latest body; True when it is new or its generation changed."""
        raw = copy.deepcopy(dict(body))
        uid = str(raw["metadata"]["uid"])
        mem = self.pools.get(uid)
        if mem is None:
            self.pools[uid] = PoolMemory(raw, drain=drain_from_status(raw.get("status")))
            return True
        changed = _generation(raw["metadata"]) != mem.generation
        mem.body = raw
        return changed

    def forget(self, uid: str) -> None:
        mem = self.pools.pop(uid, None)
        if mem is not None and mem.task is not None:
            mem.task.cancel()

    def trigger(self, uid: str) -> None:
        """Ask for a pass of this pool (coalesced: one runs at a time, the last request wins)."""
        mem = self.pools.get(uid)
        if mem is None or self.stopping:
            return
        if mem.task is not None and not mem.task.done():
            mem.dirty = True
            return
        mem.task = asyncio.create_task(self._run(uid), name=f"converge {uid}")

    async def _run(self, uid: str) -> None:
        while not self.stopping:
            mem = self.pools.get(uid)
            if mem is None:
                return
            mem.dirty = False
            try:
                await converge(self, mem)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in one pass must not end this pool's reconciling for good
                log.exception("reconcile of pool uid %s failed", uid)
            if not mem.dirty:
                return

    def retry_later(self, uid: str, delay_s: float) -> None:
        if not self.stopping:
            asyncio.get_running_loop().call_later(delay_s, self.trigger, uid)


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


def _generation(meta: Mapping[str, Any]) -> int:
    return int(meta.get("generation") or 1)


def _ref(body: Mapping[str, Any]) -> PoolRef:
    meta = body["metadata"]
    return PoolRef(str(meta["name"]), str(meta["namespace"]), str(meta["uid"]), _generation(meta))


async def _admin_token(kube: KubeClient, names: PoolNames) -> str | None:
    secret = await kube.get("v1", "Secret", names.namespace, names.admin_secret)
    return token_from_secret(secret) if secret else None


def router_urls(rt: Runtime, ref: PoolRef, pool: RolloutPoolSpec) -> list[str]:
    """Where the router's admin API and /status are: the router Service, or each shard's own pod
    (admin calls change one router's state, so with shards every one of them is called)."""
    port = pool.router.port
    if pool.router.shards > 1:
        return [rt.settings.shard_base_url(ref.name, ref.namespace, port, i) for i in range(pool.router.shards)]
    return [rt.settings.router_base_url(ref.name, ref.namespace, port)]


async def push_config(
    rt: Runtime, ref: PoolRef, pool: RolloutPoolSpec, token: str, config: RouterConfig
) -> PushError | None:
    """Push the config to the router (every shard); None when all took it."""
    errors = []
    refused = True
    urls = router_urls(rt, ref, pool)
    for i, url in enumerate(urls):
        try:
            await rt.router.push_config(url, token, config)
        except RouterUnavailable as exc:
            errors.append(f"shard {i}: {exc}" if len(urls) > 1 else str(exc))
            refused = refused and isinstance(exc, ConfigRefused)
    return PushError("; ".join(errors), refused) if errors else None


async def shard_readings(rt: Runtime, ref: PoolRef, pool: RolloutPoolSpec) -> list[ShardReading]:
    """Each shard's /status (router.shards > 1), read concurrently."""
    async def read(i: int, url: str) -> ShardReading:
        try:
            return ShardReading(i, url, await rt.router.status(url))
        except RouterUnavailable as exc:
            return ShardReading(i, url, None, str(exc))

    return list(await asyncio.gather(*(read(i, u) for i, u in enumerate(router_urls(rt, ref, pool)))))


async def router_status(rt: Runtime, ref: PoolRef, pool: RolloutPoolSpec) -> tuple[RouterStatus | None, str | None]:
    """The router's /status; with shards, their combined view (``status.combine_shards``)."""
    if not pool.router.replicas:
        return None, None
    if pool.router.shards > 1:
        readings = await shard_readings(rt, ref, pool)
        return combine_shards(readings), shards_error(readings)
    try:
        return await rt.router.status(rt.settings.router_base_url(ref.name, ref.namespace, pool.router.port)), None
    except RouterUnavailable as exc:
        return None, str(exc)


async def observe(
    rt: Runtime, ref: PoolRef, pool: RolloutPoolSpec
) -> tuple[Observed, dict[str, Any] | None, list[ShardReading] | None]:
    """One snapshot: the engines' and the router's (or shards') readiness and the router's /status
    (None if unreachable); with shards, each shard's reading too."""
    kube = rt.kube_client()
    names = ref.names
    sharded = pool.router.shards > 1
    engines = await kube.get("apps/v1", "Deployment", ref.namespace, names.engines)
    router = await kube.get("apps/v1", "StatefulSet" if sharded else "Deployment", ref.namespace, names.router)
    proxy = await kube.get("apps/v1", "Deployment", ref.namespace, names.router_proxy) if sharded else None
    readings = None
    if sharded and pool.router.replicas:
        readings = await shard_readings(rt, ref, pool)
        status, error = combine_shards(readings), shards_error(readings)
    else:
        status, error = await router_status(rt, ref, pool)
    obs = Observed(
        generation=ref.generation,
        engines_desired=pool.engines.managed_replicas,
        engines_ready=deployment_ready(engines),
        router_desired=pool.router.shards if sharded else pool.router.replicas,
        router_ready_replicas=deployment_ready(router),
        router=status,
        router_error=error,
        proxy_desired=PROXY_REPLICAS if sharded else 0,
        proxy_ready_replicas=deployment_ready(proxy),
    )
    return obs, router_view(status) if status is not None else None, readings


def build_status(
    rt: Runtime, ref: PoolRef, pool: RolloutPoolSpec, obs: Observed, view: dict[str, Any] | None,
    push_error: PushError | None, conds: list[Cond], drain: dict[str, Any] | None,
    readings: list[ShardReading] | None = None,
) -> dict[str, Any]:
    """Everything the status shows from one observation (a merge patch of .status)."""
    names = ref.names
    if push_error and not (obs.router and obs.router.generation >= ref.generation):
        conds = [c for c in conds if c.type != "ConfigApplied"]
        conds.append(push_condition(push_error))
    out: dict[str, Any] = {"observedGeneration": ref.generation, "conditions": conds,
                           "effective": effective_values(pool)}
    out["engines"] = {
        "desired": obs.engines_desired,
        "ready": obs.engines_ready,
        "summary": f"{obs.engines_ready}/{obs.engines_desired}",
        "selector": names.selector_string(ENGINE_COMPONENT),
        "drain": drain,
        "weightVersions": weight_versions(obs.router) if obs.router else None,
        "held": held_engines(obs.router) if obs.router else None,
    }
    out["router"] = {
        "ready": bool(obs.router and obs.router.ready),
        "readyReplicas": obs.router_ready_replicas,
        "healthyEngines": obs.router.healthy_engines if obs.router else None,
        "url": names.router_url(pool.router.port, rt.settings.cluster_domain),
        "shards": shards_view(readings) if readings is not None else None,
        "proxy": {"desired": obs.proxy_desired, "ready": obs.proxy_ready_replicas} if obs.proxy_desired else None,
    }
    out["config"] = {
        "desiredGeneration": ref.generation,
        "appliedGeneration": obs.router.generation if obs.router else None,
        "hash": obs.router.config_hash if obs.router else None,
        "lastError": push_error.message if push_error else (obs.router.last_reload_error if obs.router else None),
    }
    if view is not None:
        out.update(view)
        out["lastUpdateTime"] = now_iso()
    return out


# ---- writing status and events -------------------------------------------------------


async def write_status(rt: Runtime, mem: PoolMemory, ref: PoolRef, status: dict[str, Any]) -> None:
    """Merge the conditions with the last ones written, patch .status, and post an Event per transition."""
    before = mem.conditions if mem.conditions is not None else (mem.body.get("status") or {}).get("conditions")
    conds: list[Cond] = status.pop("conditions")
    merged = merge_conditions(before, conds, ref.generation, now_iso())
    await rt.kube_client().patch_pool_status(ref.namespace, ref.name, {**status, "conditions": merged})
    mem.conditions = merged
    changed = transitions(before, merged)
    stalled = [c for c in changed if c["type"] == STALLED and c["status"] == "True"]
    # A stall also turns Ready and Reconciling False for the same reason: one Warning says it all.
    for cond in stalled or changed:
        await post_event(rt, ref, "Warning" if stalled else "Normal", str(cond["reason"]),
                         f"{cond['type']}={cond['status']}: {cond['message']}")


async def post_event(rt: Runtime, ref: PoolRef, type_: str, reason: str, message: str) -> None:
    """A core/v1 Event on the pool (best effort: a lost Event must not fail the pass)."""
    if not rt.settings.post_events:
        return
    now = now_iso()
    event = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{ref.name}.{secrets.token_hex(8)}", "namespace": ref.namespace},
        "involvedObject": {
            "apiVersion": API_VERSION, "kind": KIND, "name": ref.name, "namespace": ref.namespace, "uid": ref.uid,
        },
        "type": type_,
        "reason": reason,
        "message": message[:EVENT_MESSAGE_LIMIT],
        "source": {"component": MANAGER},
        "reportingComponent": MANAGER,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
    try:
        await rt.kube_client().create_event(ref.namespace, event)
    except KubeError as exc:
        log.warning("event %s on %s/%s not posted: %s", reason, ref.namespace, ref.name, exc)


async def report_stall(
    rt: Runtime, mem: PoolMemory, ref: PoolRef, stall: Stall, backoff: Callable[[int], float]
) -> None:
    """Record and show a Stalled generation; it is tried again after ``backoff(attempts)`` seconds."""
    prev = mem.stall if mem.stall is not None and mem.stall.generation == ref.generation else None
    attempts = prev.attempts + 1 if prev is not None and prev.stall.reason == stall.reason else 1
    retry_at = asyncio.get_running_loop().time() + backoff(attempts)
    mem.stall = StallState(ref.generation, stall, retry_at, attempts)
    await write_status(rt, mem, ref, {"observedGeneration": ref.generation, "conditions": stalled_conditions(stall)})


def refused_backoff_s(settings: OperatorSettings, attempts: int) -> float:
    """Wait before trying a refused generation again: doubling from the initial delay, capped."""
    return float(min(settings.stalled_backoff_max_s, settings.stalled_backoff_initial_s * 2 ** max(0, attempts - 1)))


# ---- the pass ----------------------------------------------------------------------------


async def converge(rt: Runtime, mem: PoolMemory) -> None:
    body = mem.body
    meta = body.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return  # the garbage collector takes the children; nothing to write
    ref = _ref(body)
    if mem.stall is not None and mem.stall.generation != ref.generation:
        mem.stall = None  # a new generation: try it at once
    if mem.stall is not None and asyncio.get_running_loop().time() < mem.stall.retry_at:
        return  # the status says Stalled; the backoff of this generation has not passed
    try:
        await _drop_retired_finalizer(rt, ref, meta)
        await _converge(rt, mem, ref, body.get("spec") or {})
    except NameConflict as exc:
        # Checked again on every tick: the foreign object's removal announces itself nowhere.
        await report_stall(rt, mem, ref, Stall(exc.reason, exc.message), lambda _: 0.0)
    except ChildProblem as exc:
        await report_stall(
            rt, mem, ref, Stall(exc.reason, exc.message), lambda n: refused_backoff_s(rt.settings, n)
        )
    except KubeError as exc:
        log.warning("pool %s/%s: %s; retrying in %g s", ref.namespace, ref.name, exc, rt.settings.retry_delay_s)
        rt.retry_later(ref.uid, rt.settings.retry_delay_s)


async def _drop_retired_finalizer(rt: Runtime, ref: PoolRef, meta: Mapping[str, Any]) -> None:
    finalizers = list(meta.get("finalizers") or ())
    if RETIRED_FINALIZER not in finalizers:
        return
    i = finalizers.index(RETIRED_FINALIZER)
    path = f"/metadata/finalizers/{i}"
    ops = [{"op": "test", "path": path, "value": RETIRED_FINALIZER}, {"op": "remove", "path": path}]
    await rt.kube_client().json_patch_pool(ref.namespace, ref.name, ops)


async def _converge(rt: Runtime, mem: PoolMemory, ref: PoolRef, spec: Any) -> None:
    kube = rt.kube_client()
    names = ref.names
    try:
        pool = validate(spec, ref.name)
        token = await _admin_token(kube, names) or secrets.token_urlsafe(TOKEN_BYTES)
        desired = render(pool, ref, token, rt.settings.cluster_domain)
    except (InvalidPool, ValueError) as exc:
        # Deterministic: the same spec fails the same way, so this generation is not tried again.
        await report_stall(rt, mem, ref, Stall(INVALID_SPEC, str(exc)), lambda _: math.inf)
        return

    # -- what the rollout order needs: the engine Deployment, the ConfigMap, the router -------------
    engines_now = await kube.get("apps/v1", "Deployment", ref.namespace, names.engines)
    config_map_now = await kube.get("v1", "ConfigMap", ref.namespace, names.router_config)
    before, _ = await router_status(rt, ref, pool)
    current_replicas = int((engines_now.get("spec") or {}).get("replicas", 1)) if engines_now else None
    live_replicas = int((engines_now.get("status") or {}).get("replicas") or 0) if engines_now else None
    plan = plan_scale(
        pool.engines.replicas, current_replicas, engine_rows(before), mem.drain, time.time(),
        rt.settings.drain_timeout_s, live_replicas,
    )
    recreate = needs_recreate(engines_now, pool.model.name, pool.model.served)
    if pool.engines.external is not None:
        # Engines this pool does not run: their address is the user's, and nothing rolls or drains here.
        port = pool.engines.port
        config = desired.router_config
    else:
        port = routed_port(pool.engines.port, config_engine_port(config_map_now, CONFIG_KEY), engines_now)
        config = _routed_config(desired.router_config, port, plan.draining)

    # -- apply, in order ----------------------------------------------------------------------------
    if plan.release:
        await _mark_departing(rt, ref, pool, plan.release)
    if pool.router.shards == 1 and _was_sharded(mem.body):
        await _retire_shards(rt, ref)
    for obj in desired.objects():
        if obj is desired.config_map:
            obj = build_config_map(ref, config)
        elif obj is desired.engine_deployment:
            obj = with_rollout_order(
                obj, model=pool.model.name, served=pool.model.served, recreate=recreate, replicas=plan.replicas
            )
        action = await apply_object(kube, obj, ref.uid)
        log.debug("%s %s: %s", obj["kind"], obj["metadata"]["name"], action.value)
    if mem.stall is not None:
        mem.stall = None  # everything applied: whatever stalled this generation is gone

    # -- the router: push when it runs another config ---------------------------------------------
    push_error = None
    pushed = False
    if pool.router.replicas and (before is None or before.config_hash != config.config_hash()):
        push_error = await push_config(rt, ref, pool, token, config)
        pushed = push_error is None

    await _finish_drain(rt, mem, ref, plan)
    obs, view, readings = await observe(rt, ref, pool)
    pending = _pending(pool, port, recreate, plan, mem.drain)
    conds = pool_conditions(obs, pending)
    drain = drain_to_status(mem.drain, plan.sessions_left) if mem.drain else None
    await write_status(rt, mem, ref, build_status(rt, ref, pool, obs, view, push_error, conds, drain, readings))
    if pushed and plan.drain is not None and not plan.release:
        mem.dirty = True  # the router took the drain list: the next pass can see it acknowledged


def _routed_config(config: RouterConfig, port: int, draining: tuple[str, ...]) -> RouterConfig:
    """The rendered router config with this pass's engine port and draining engines."""
    engines = config.engines
    update: dict[str, Any] = {"draining": draining}
    if engines.service is not None and engines.service.port != port:
        update["service"] = engines.service.model_copy(update={"port": port})
    return config.model_copy(update={"engines": engines.model_copy(update=update)})


def _pending(
    pool: RolloutPoolSpec, port: int, recreate: bool, plan: ScalePlan, drain: Drain | None
) -> list[Pending]:
    out = []
    if port != pool.engines.port:
        out.append(Pending(
            "EnginePortSwitch",
            f"engines rolling to port {pool.engines.port}; the router stays on {port} until every engine runs it",
        ))
    if recreate:
        out.append(Pending(
            "ModelSwitch",
            f"model {pool.model.name} replaces the previous one under {pool.model.served!r}: old engines stop "
            "before new ones start (Recreate), so two models never answer as one",
        ))
    if drain is not None:
        out.append(Pending(
            "DrainingEngines",
            f"scale-down {drain.from_replicas} -> {drain.to_replicas}: {len(drain.engines)} engines take no new "
            f"sessions, {plan.sessions_left} sessions left, deadline {drain_to_status(drain, 0)['deadline']}",
            blocks_ready=False,
        ))
    return out


def _was_sharded(body: Mapping[str, Any]) -> bool:
    """The last status written shows router shards (so their StatefulSet and proxy may run)."""
    router = ((body.get("status") or {}).get("router")) or {}
    return bool(router.get("shards"))


async def _retire_shards(rt: Runtime, ref: PoolRef) -> None:
    """Back to one router: the shards and their proxy go to 0 replicas (kept, as the router
    Deployment is kept at 0 while sharded; never two admitting routers for the same engines)."""
    kube = rt.kube_client()
    names = ref.names
    for kind, name in (("StatefulSet", names.router), ("Deployment", names.router_proxy)):
        obj = await kube.get("apps/v1", kind, ref.namespace, name)
        mine = obj is not None and any(
            o.get("uid") == ref.uid for o in (obj.get("metadata") or {}).get("ownerReferences") or ()
        )
        if mine and obj is not None and (obj.get("spec") or {}).get("replicas"):
            await kube.patch("apps/v1", kind, ref.namespace, name, {"spec": {"replicas": 0}})


async def _mark_departing(rt: Runtime, ref: PoolRef, pool: RolloutPoolSpec, engines: tuple[str, ...]) -> None:
    """Give the drained engines' pods the lowest deletion cost, just before the Deployment shrinks."""
    kube = rt.kube_client()
    pods = await kube.list_labelled("v1", "Pod", ref.namespace, ref.names.selector(ENGINE_COMPONENT))
    for name in pods_of_engines(pods, engines, pool.engines.port):
        patch = {"metadata": {"annotations": {DELETION_COST_ANNOTATION: DRAINED_DELETION_COST}}}
        await kube.patch("v1", "Pod", ref.namespace, name, patch)


async def _finish_drain(rt: Runtime, mem: PoolMemory, ref: PoolRef, plan: ScalePlan) -> None:
    """Record the drain of this pass; when one ends, clear the deletion cost of pods that stayed."""
    ended = mem.drain is not None and plan.drain is None
    started = plan.drain is not None and plan.drain != mem.drain
    previous, mem.drain = mem.drain, plan.drain
    if started and plan.drain is not None:
        await post_event(rt, ref, "Normal", "DrainingEngines",
                         f"scale-down {plan.drain.from_replicas} -> {plan.drain.to_replicas}: "
                         f"{', '.join(plan.drain.engines)} take no new sessions")
    if plan.cut_sessions:
        await post_event(rt, ref, "Warning", "SessionsCut", plan.note)
    elif plan.note:
        await post_event(rt, ref, "Warning", "ScaledDownWithoutDrain", plan.note)
    if ended and previous is not None:
        kube = rt.kube_client()
        pods = await kube.list_labelled("v1", "Pod", ref.namespace, ref.names.selector(ENGINE_COMPONENT))
        for pod in pods:
            annotations = (pod.get("metadata") or {}).get("annotations") or {}
            if annotations.get(DELETION_COST_ANNOTATION) == DRAINED_DELETION_COST:
                patch = {"metadata": {"annotations": {DELETION_COST_ANNOTATION: None}}}
                await kube.patch("v1", "Pod", ref.namespace, pod["metadata"]["name"], patch)
        await post_event(rt, ref, "Normal", "ScaledDown", f"engines at {previous.to_replicas}")


# ---- kopf wiring -------------------------------------------------------------------------


def _controller_pool(body: Mapping[str, Any]) -> str | None:
    """uid of the RolloutPool controlling a child, from its owner references."""
    for owner in (body.get("metadata") or {}).get("ownerReferences") or ():
        if owner.get("controller") and owner.get("kind") == KIND and str(owner.get("apiVersion", "")).startswith(GROUP):
            return str(owner.get("uid"))
    return None


async def _resync_forever(rt: Runtime) -> None:
    while not rt.stopping:
        await asyncio.sleep(rt.settings.status_interval_s)
        for uid in list(rt.pools):
            rt.trigger(uid)


def register(registry: kopf.OperatorRegistry, settings: OperatorSettings) -> Runtime:
    """Register every handler of the operator into ``registry``; returns the shared runtime."""
    rt = Runtime(settings=settings, router=RouterClient(settings.router_timeout_s))
    resource = (GROUP, VERSION, PLURAL)

    @kopf.on.startup(registry=registry)
    async def _startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.persistence.finalizer = FINALIZER
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
        )
        settings.posting.enabled = rt.settings.post_events
        rt.kube = KubeClient(kube_credentials(rt.settings))
        rt.resync = asyncio.create_task(_resync_forever(rt), name="misat resync")

    @kopf.on.cleanup(registry=registry)
    async def _cleanup(**_: Any) -> None:
        rt.stopping = True
        tasks = [t for t in [rt.resync, *(m.task for m in rt.pools.values())] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if rt.kube is not None:
            await rt.kube.close()
        await rt.router.close()

    @kopf.on.event(*resource, registry=registry, id="pool")
    async def _pool(event: Mapping[str, Any], body: Mapping[str, Any], **_: Any) -> None:
        uid = str((body.get("metadata") or {}).get("uid"))
        if event.get("type") == "DELETED":
            rt.forget(uid)
            return
        if rt.see(body):
            rt.trigger(uid)

    async def _child(body: Mapping[str, Any], **_: Any) -> None:
        uid = _controller_pool(body)
        if uid is not None:
            rt.trigger(uid)

    for group, version, plural in CHILD_RESOURCES:
        kopf.on.event(
            group=group, version=version, plural=plural, registry=registry, id=f"child-{plural}",
            labels={POOL_LABEL: kopf.PRESENT},
        )(_child)

    return rt
