"""Pure status building: kstatus conditions with stable transition times, and the router's view.

Conditions follow kstatus (sigs.k8s.io/cli-utils), so Flux, cli-utils and
Argo CD (``charts/misa-t/argocd/``) read a pool without a custom rule:

- ``Reconciling`` (abnormal-true): True while the cluster does not yet match
  the spec and progress is expected: engines or router rolling out, config
  not yet applied, a rollout step in order (port switch, model switch), a
  scale-down draining engines, a router not answering yet.
- ``Stalled`` (abnormal-true): True when progress needs someone to act: the
  spec is invalid (``InvalidSpec``), the API server refused a child
  (``ChildRefused``), a child's name is taken by a foreign object
  (``NameConflict``). While Stalled, Reconciling is False, so kstatus reports
  the pool as Failed rather than in progress until a timeout.
- ``Ready`` (normal-true): engines ready, router ready, config applied.
- ``ConfigApplied``: True only when the router's ``/status`` reports the
  pool's current generation (the project's own; it never contradicts the
  three above).

Every condition carries ``observedGeneration`` (the generation it describes),
``reason``, ``message`` and ``lastTransitionTime``, which changes only when the
condition's status changes, so a GitOps health view does not flap with every
status tick. Conditions of an older operator (``Progressing``, ``Degraded``)
are dropped on the next write.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from misat_router.shard_status import ShardReading
from misat_router.status import RouterStatus

READY = "Ready"
RECONCILING = "Reconciling"
STALLED = "Stalled"
CONFIG_APPLIED = "ConfigApplied"
CONDITION_ORDER = (READY, RECONCILING, STALLED, CONFIG_APPLIED)
RETIRED_CONDITIONS = frozenset({"Progressing", "Degraded"})
"""Written by earlier operator versions; Reconciling and Stalled replace them."""

INVALID_SPEC = "InvalidSpec"
CHILD_REFUSED = "ChildRefused"
NAME_CONFLICT = "NameConflict"


def now_iso(now: datetime | None = None) -> str:
    return (now or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")


def iso_at(epoch_s: float) -> str:
    return now_iso(datetime.fromtimestamp(epoch_s, UTC))


def parse_iso(text: Any) -> float | None:
    """Epoch seconds of an RFC 3339 time as written by ``now_iso``, or None."""
    if not isinstance(text, str):
        return None
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class Cond:
    type: str
    status: bool
    reason: str
    message: str = ""


def merge_conditions(
    existing: Iterable[Mapping[str, Any]] | None, updates: Iterable[Cond], generation: int, now: str
) -> list[dict[str, Any]]:
    """New conditions list: updated ones replace old ones; transition time kept if status unchanged."""
    by_type = {
        c.get("type"): dict(c)
        for c in existing or ()
        if isinstance(c, Mapping) and c.get("type") not in RETIRED_CONDITIONS
    }
    for cond in updates:
        status = "True" if cond.status else "False"
        old = by_type.get(cond.type)
        since = old["lastTransitionTime"] if old and old.get("status") == status else now
        by_type[cond.type] = {
            "type": cond.type,
            "status": status,
            "reason": cond.reason,
            "message": cond.message,
            "lastTransitionTime": since,
            "observedGeneration": generation,
        }
    ordered = [by_type.pop(t) for t in CONDITION_ORDER if t in by_type]
    return ordered + [by_type[t] for t in sorted(by_type, key=str)]


def condition(conditions: Iterable[Mapping[str, Any]] | None, type_: str) -> Mapping[str, Any] | None:
    for c in conditions or ():
        if c.get("type") == type_:
            return c
    return None


def transitions(
    before: Iterable[Mapping[str, Any]] | None, after: Iterable[Mapping[str, Any]]
) -> list[Mapping[str, Any]]:
    """Conditions of ``after`` whose status or reason differs from ``before`` (each is an Event)."""
    old = {c.get("type"): c for c in before or () if isinstance(c, Mapping)}
    out = []
    for c in after:
        prev = old.get(c.get("type"))
        if prev is None or prev.get("status") != c.get("status") or prev.get("reason") != c.get("reason"):
            out.append(c)
    return out


@dataclass(frozen=True, slots=True)
class Stall:
    """Why this generation cannot make progress on its own (reason: a ``Stalled`` reason)."""

    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class Pending:
    """A rollout step the operator is waiting on (reason and message of ``Reconciling``)."""

    reason: str
    message: str
    blocks_ready: bool = True
    """False for steps that leave the pool serving as before (a scale-down drain)."""


@dataclass(frozen=True, slots=True)
class Observed:
    """What one pass saw: Deployments and the router's answer."""

    generation: int
    engines_desired: int
    engines_ready: int
    router_desired: int
    router_ready_replicas: int
    router: RouterStatus | None
    router_error: str | None = None
    proxy_desired: int = 0
    """Shard proxy pods wanted (router.shards > 1); 0 without shards."""
    proxy_ready_replicas: int = 0


@dataclass(frozen=True, slots=True)
class PushError:
    """Why the last push of the config did not take: ``refused`` when every router that failed
    answered and said no (it keeps the config it runs), not when one could not be reached."""

    message: str
    refused: bool


def push_condition(error: PushError) -> Cond:
    """ConfigApplied after a failed push: the router's refusal (ReloadRefused: the spec must change)
    or a failed delivery (PushFailed: the next pass pushes again)."""
    return Cond(CONFIG_APPLIED, False, "ReloadRefused" if error.refused else "PushFailed", error.message)


def config_condition(obs: Observed) -> Cond:
    if obs.router is not None and obs.router.generation >= obs.generation:
        return Cond(CONFIG_APPLIED, True, "Applied", f"router reports generation {obs.generation}")
    if obs.router is not None and obs.router.last_reload_error:
        return Cond(CONFIG_APPLIED, False, "ReloadRefused", obs.router.last_reload_error)
    seen = "unreachable" if obs.router is None else f"at generation {obs.router.generation}"
    return Cond(CONFIG_APPLIED, False, "Pending", f"waiting for generation {obs.generation}; router {seen}")


def stalled_conditions(stall: Stall, obs: Observed | None = None) -> list[Cond]:
    """A generation that needs someone to act: Stalled, not Reconciling, not Ready."""
    if obs is not None:
        config = config_condition(obs)
    else:
        config = Cond(CONFIG_APPLIED, False, stall.reason, "not applied: " + stall.message)
    return [
        Cond(READY, False, stall.reason, stall.message),
        Cond(RECONCILING, False, stall.reason, "waiting for the problem to be fixed (see Stalled)"),
        Cond(STALLED, True, stall.reason, stall.message),
        config,
    ]


def pool_conditions(obs: Observed, pending: Sequence[Pending] = ()) -> list[Cond]:
    """Ready / Reconciling / Stalled / ConfigApplied of a generation that applied cleanly (pure)."""
    config = config_condition(obs)
    applied = config.status
    engines_ok = obs.engines_ready >= obs.engines_desired
    router_pods_ok = obs.router_ready_replicas >= obs.router_desired
    proxy_ok = obs.proxy_ready_replicas >= obs.proxy_desired
    rollout = (
        f"engines {obs.engines_ready}/{obs.engines_desired}, "
        f"router {obs.router_ready_replicas}/{obs.router_desired}"
    )
    if obs.proxy_desired:
        rollout += f", proxy {obs.proxy_ready_replicas}/{obs.proxy_desired}"
    router_missing = obs.router_desired and obs.router is None and router_pods_ok
    no_engines = (
        obs.router is not None and obs.engines_desired and obs.router.healthy_engines == 0 and engines_ok
    )

    if not engines_ok or not router_pods_ok or not proxy_ok:
        reconciling = Cond(RECONCILING, True, "RollingOut", rollout)
    elif pending:
        reconciling = Cond(RECONCILING, True, pending[0].reason, pending[0].message)
    elif router_missing:
        reconciling = Cond(RECONCILING, True, "RouterUnreachable", obs.router_error or "no answer from /status")
    elif not applied:
        reconciling = Cond(RECONCILING, True, "ApplyingConfig", config.message)
    elif no_engines:
        reconciling = Cond(
            RECONCILING, True, "NoHealthyEngines", "engine pods are ready but the router sees none healthy"
        )
    else:
        reconciling = Cond(RECONCILING, False, "Reconciled", "desired state reached")

    router_ok = obs.router_desired == 0 or (obs.router is not None and obs.router.ready)
    blocking = [p for p in pending if p.blocks_ready]
    if not engines_ok:
        ready = Cond(READY, False, "EnginesNotReady", rollout)
    elif not router_ok:
        reason = "RouterUnreachable" if obs.router is None else "RouterNotReady"
        ready = Cond(READY, False, reason, obs.router_error or "router not ready")
    elif obs.proxy_desired and not obs.proxy_ready_replicas:
        # The pool's Service selects the proxy pods: with none ready, no client reaches a shard,
        # however healthy the shards are. One of two ready serves (Reconciling says the rest).
        ready = Cond(READY, False, "ProxyNotReady",
                     f"no shard proxy pod is ready ({rollout}): the pool's Service has no endpoint")
    elif not applied:
        ready = Cond(READY, False, "ConfigNotApplied", config.message)
    elif no_engines:
        ready = Cond(READY, False, "NoHealthyEngines", reconciling.message)
    elif blocking:
        ready = Cond(READY, False, blocking[0].reason, blocking[0].message)
    else:
        ready = Cond(READY, True, "AllReady", "engines, router and config are in place")
    stalled = Cond(STALLED, False, "AsExpected", "")
    return [ready, reconciling, stalled, config]


def _pct(x: float) -> float:
    return round(100.0 * x, 2)


def weight_versions(status: RouterStatus) -> list[str] | None:
    """The weight versions the router reports for its engines (sorted), or None when it reports none."""
    return sorted({e.weight_version for e in status.engines if e.weight_version is not None}) or None


def held_engines(status: RouterStatus) -> list[str] | None:
    """Engines the router holds although healthy (start-up weights after a restart or a late join), or None."""
    return sorted(e.id for e in status.engines if e.held is not None) or None


def router_view(status: RouterStatus) -> dict[str, Any]:
    """The RolloutPool status fields copied from the router's /status (camelCase, rounded)."""
    capacity = float(sum(e.kv_capacity_tokens for e in status.engines))
    used = float(sum(e.kv_capacity_tokens * e.kv_usage for e in status.engines))
    classes = [
        {
            "name": c.name,
            "targetPercent": _pct(c.target_share),
            "consumedPercent": _pct(c.consumed_share),
            "completedUnits": c.completed_units,
            "activeSessions": c.active_sessions,
            "heldRequests": c.held_requests,
            "kvBudgetTokens": c.kv_budget_tokens,
            "kvUsedTokens": c.kv_used_tokens,
        }
        for c in status.classes
    ]
    return {
        "kv": {
            "capacityTokens": capacity,
            "usedTokens": round(used, 1),
            "usedPercent": round(100.0 * used / capacity, 1) if capacity else None,
        },
        "classes": classes,
        "mixture": {
            "target": {c.name: _pct(c.target_share) for c in status.classes},
            "consumed": {c.name: _pct(c.consumed_share) for c in status.classes},
            "tvPoints": round(status.mixture_tv_points, 2),
        },
        "sampleRatePerMin": round(status.sample_rate_per_min, 2),
        "prefixHitRate": None if status.prefix_hit_rate is None else round(status.prefix_hit_rate, 4),
    }


def deployment_ready(deployment: Mapping[str, Any] | None) -> int:
    if not deployment:
        return 0
    return int((deployment.get("status") or {}).get("readyReplicas") or 0)


# ---- router shards: one pool view from each shard's /status ----------------------------


def shards_view(readings: Sequence[ShardReading]) -> list[dict[str, Any]]:
    """``status.router.shards``: each shard up or down, what it owns, and why it did not answer."""
    out = []
    for r in readings:
        st = r.status
        out.append({
            "index": r.index,
            "url": r.url,
            "up": st is not None,
            "ready": bool(st and st.ready),
            "generation": st.generation if st else None,
            "healthyEngines": st.healthy_engines if st else None,
            "ownedEngines": len(st.shard.owned_engines) if st and st.shard else None,
            "handingBackEngines": len(st.shard.handing_back) if st and st.shard else None,
            "liveShards": st.shard.live if st and st.shard else None,
            "error": r.error,
        })
    return out


def shards_error(readings: Sequence[ShardReading]) -> str | None:
    """One line naming every shard that did not answer, or None."""
    down = [f"shard {r.index}: {r.error}" for r in readings if r.status is None]
    return "; ".join(down) or None
