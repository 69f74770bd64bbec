"""Pure rollout-order decisions: what the operator writes now, given what the cluster shows.

Three changes cannot be applied in one step without hurting the rollouts that
run on the pool; each is ordered here, from the current objects alone (no
memory between passes beyond what the pool's status records), so a restarted
operator continues where the last one stopped:

- ``engines.port``: the engines roll first and the router keeps the port it
  has until every engine pod runs the new template; then the router gets the
  new port. Pushing first would make every engine unreachable for the whole
  rollout; this way only the pods already rolled are (capacity shrinks pod by
  pod, then comes back at once).
- ``model.name`` under an unchanged ``servedName``: a rolling update would let
  the old and the new model answer under one name at the same time (samples
  from two policies, silently mixed). The engine Deployment switches to
  ``Recreate`` for that rollout: every old pod ends (its grace period lets
  in-flight generations finish) before a new one starts, the router holds new
  requests while no engine is healthy (bounded by its hold deadline), and the
  strategy returns to ``RollingUpdate`` once the rollout is complete (a
  strategy change alone restarts nothing).
- a smaller ``engines.replicas`` (scale subresource): the departing engines are
  chosen, marked draining in the router's config (no new sessions; live ones
  continue there), and the Deployment shrinks only when their sessions are
  done or the drain deadline passes. Deployment pods are not ordered, so the
  chosen pods get the lowest ``controller.kubernetes.io/pod-deletion-cost``
  just before the shrink, which makes the ReplicaSet controller remove them
  rather than others (it ranks not-ready pods first, and those hold no
  sessions either).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from misat_router.engines import engine_url
from misat_router.status import RouterStatus

from .names import ENGINE_PORT_NAME, GROUP
from .status import iso_at, parse_iso

MODEL_ANNOTATION = f"{GROUP}/model"
SERVED_MODEL_ANNOTATION = f"{GROUP}/served-model"
"""Set by the operator on the engine Deployment: what its pods serve (read back to order a model change)."""
DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
DRAINED_DELETION_COST = "-1000000"
"""Deletion cost of a drained engine pod: far below the default 0 (and anything a user would set),
so the ReplicaSet removes drained pods first among ready ones."""
RECREATE = "Recreate"


# ---- Deployments -------------------------------------------------------------------


def rollout_complete(deployment: Mapping[str, Any] | None) -> bool:
    """The Deployment controller has rolled the current template to every replica (no old pods)."""
    if not deployment:
        return False
    meta, spec, status = deployment.get("metadata") or {}, deployment.get("spec") or {}, deployment.get("status") or {}
    want = int(spec.get("replicas", 1))
    observed = int(status.get("observedGeneration") or 0) >= int(meta.get("generation") or 0)
    return (
        observed
        and int(status.get("updatedReplicas") or 0) >= want
        and int(status.get("replicas") or 0) <= want
        and int(status.get("readyReplicas") or 0) >= want
    )


def template_engine_port(deployment: Mapping[str, Any] | None) -> int | None:
    """The engine port of the Deployment's pod template (the container port named ENGINE_PORT_NAME)."""
    pod = (((deployment or {}).get("spec") or {}).get("template") or {}).get("spec") or {}
    for container in pod.get("containers") or ():
        for port in container.get("ports") or ():
            if port.get("name") == ENGINE_PORT_NAME and "containerPort" in port:
                return int(port["containerPort"])
    return None


def config_engine_port(config_map: Mapping[str, Any] | None, key: str) -> int | None:
    """The engine port in the router config a ConfigMap holds now (None: none, or unreadable)."""
    raw = ((config_map or {}).get("data") or {}).get(key)
    if not raw:
        return None
    try:
        doc = yaml.safe_load(raw)
        port = doc["engines"]["service"]["port"]
    except (yaml.YAMLError, KeyError, TypeError):
        return None
    return int(port) if isinstance(port, int) else None


def routed_port(desired: int, routed_now: int | None, engines: Mapping[str, Any] | None) -> int:
    """The engine port the router config carries in this pass (the port change order above)."""
    if routed_now is None or routed_now == desired:
        return desired
    if template_engine_port(engines) == desired and rollout_complete(engines):
        return desired
    return routed_now


def needs_recreate(current: Mapping[str, Any] | None, model: str, served: str) -> bool:
    """Whether the engine rollout must be ``Recreate`` (the model change order above)."""
    if not current:
        return False
    annotations = (current.get("metadata") or {}).get("annotations") or {}
    old_model, old_served = annotations.get(MODEL_ANNOTATION), annotations.get(SERVED_MODEL_ANNOTATION)
    if old_model is not None and old_model != model and old_served == served:
        return True
    strategy = ((current.get("spec") or {}).get("strategy") or {}).get("type")
    return strategy == RECREATE and not rollout_complete(current)


def with_rollout_order(
    deployment: dict[str, Any], *, model: str, served: str, recreate: bool, replicas: int
) -> dict[str, Any]:
    """The rendered engine Deployment adjusted for this pass: model annotations, strategy, replicas."""
    out = dict(deployment)
    meta = dict(out["metadata"])
    meta["annotations"] = {
        **(meta.get("annotations") or {}), MODEL_ANNOTATION: model, SERVED_MODEL_ANNOTATION: served,
    }
    spec = dict(out["spec"])
    spec["replicas"] = replicas
    if recreate:
        spec["strategy"] = {"type": RECREATE}
    out["metadata"], out["spec"] = meta, spec
    return out


# ---- scale-down drain --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EngineRow:
    """One engine as the router's /status shows it (the drain's inputs)."""

    id: str
    healthy: bool
    sessions: int
    in_flight: int
    draining: bool

    @property
    def busy(self) -> int:
        return self.sessions + self.in_flight


@dataclass(frozen=True, slots=True)
class Drain:
    """A scale-down in progress (recorded in status.engines.drain, so a restart resumes it)."""

    engines: tuple[str, ...]
    from_replicas: int
    to_replicas: int
    started_at: float
    deadline: float


@dataclass(frozen=True, slots=True)
class ScalePlan:
    replicas: int
    """engine Deployment replicas to write now"""
    drain: Drain | None
    """the drain to record (None: no drain in progress)"""
    draining: tuple[str, ...] = ()
    """engine ids for the router config's engines.draining"""
    release: tuple[str, ...] = ()
    """engines whose pods get the drained deletion cost before this pass shrinks the Deployment"""
    sessions_left: int = 0
    cut_sessions: int = 0
    """sessions still live on departing engines when the deadline forced the shrink"""
    note: str = ""


def pick_departing(rows: Sequence[EngineRow], count: int) -> tuple[str, ...]:
    """The engines that go: unhealthy ones first (they hold nothing), then the least busy; ties by id."""
    ranked = sorted(rows, key=lambda r: (r.healthy, r.busy, r.id))
    return tuple(sorted(r.id for r in ranked[:count]))


def plan_scale(
    desired: int,
    current: int | None,
    rows: Sequence[EngineRow] | None,
    drain: Drain | None,
    now: float,
    timeout_s: float,
    live: int | None = None,
) -> ScalePlan:
    """One pass of a session-aware scale-down (pure; see the module docstring).

    ``current``: the engine Deployment's spec.replicas (None before it exists); ``live``: its
    status.replicas (pods that still exist, terminating ones included); ``rows``: the router's
    engines (None when the router is not reachable or not run).
    """
    if current is None or desired >= current:
        if drain is not None and desired == drain.to_replicas == current and live is not None and live > desired:
            # Shrunk, but the ReplicaSet has not removed the departing pods yet: keep them draining
            # and keep their deletion cost until it has (clearing it now could change its choice).
            return ScalePlan(desired, drain, drain.engines)
        return ScalePlan(desired, None)
    if drain is None or (drain.from_replicas, drain.to_replicas) != (current, desired):
        if not rows:
            return ScalePlan(desired, None, note="no router view: scaled down without draining")
        chosen = pick_departing(rows, current - desired)
        new = Drain(chosen, current, desired, now, now + timeout_s)
        # Never shrink before the router has confirmed the drain (a new session could land there).
        return ScalePlan(current, new, chosen, sessions_left=sum(r.busy for r in rows if r.id in chosen))
    by_id = {r.id: r for r in rows or ()}
    mine = [by_id[e] for e in drain.engines if e in by_id]
    left = sum(r.busy for r in mine)
    acknowledged = rows is not None and all(r.draining for r in mine)
    if (acknowledged and not left) or now >= drain.deadline:
        cut = 0 if acknowledged and not left else left
        note = f"drain deadline passed: {cut} live sessions cut on {', '.join(drain.engines)}" if cut else ""
        return ScalePlan(desired, drain, drain.engines, release=drain.engines, cut_sessions=cut, note=note)
    return ScalePlan(current, drain, drain.engines, sessions_left=left)


def engine_rows(status: RouterStatus | None) -> list[EngineRow] | None:
    """The router /status engines as drain inputs (None without a status)."""
    if status is None:
        return None
    return [EngineRow(e.id, e.healthy, e.sessions, e.in_flight, e.draining) for e in status.engines]


def pods_of_engines(
    pods: Iterable[Mapping[str, Any]], engine_ids: Iterable[str], port: int, scheme: str = "http"
) -> list[str]:
    """Names of the pods behind the given engine ids (an engine id is ``scheme://podIP:port``)."""
    wanted = set(engine_ids)
    out = []
    for pod in pods:
        status = pod.get("status") or {}
        ips = {status.get("podIP")} | {p.get("ip") for p in status.get("podIPs") or ()}
        if any(ip and engine_url(scheme, str(ip), port) in wanted for ip in ips):
            out.append(str(pod["metadata"]["name"]))
    return sorted(out)


def drain_to_status(drain: Drain, sessions_left: int) -> dict[str, Any]:
    return {
        "engines": list(drain.engines),
        "fromReplicas": drain.from_replicas,
        "toReplicas": drain.to_replicas,
        "startedAt": iso_at(drain.started_at),
        "deadline": iso_at(drain.deadline),
        "sessionsLeft": sessions_left,
    }


def drain_from_status(status: Mapping[str, Any] | None) -> Drain | None:
    """The drain a pool's status records (after an operator restart), or None."""
    raw = (((status or {}).get("engines") or {}).get("drain")) or None
    if not isinstance(raw, Mapping):
        return None
    started, deadline = parse_iso(raw.get("startedAt")), parse_iso(raw.get("deadline"))
    try:
        engines = tuple(str(e) for e in raw["engines"])
        from_r, to_r = int(raw["fromReplicas"]), int(raw["toReplicas"])
    except (KeyError, TypeError, ValueError):
        return None
    if started is None or deadline is None:
        return None
    return Drain(engines, from_r, to_r, started, deadline)
