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

from misat_router.policy.mixture import tv_distance
from misat_router.status import ClassStatus, RouterStatus

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
    rollout = (
        f"engines {obs.engines_ready}/{obs.engines_desired}, "
        f"router {obs.router_ready_replicas}/{obs.router_desired}"
    )
    router_missing = obs.router_desired and obs.router is None and router_pods_ok
    no_engines = (
        obs.router is not None and obs.engines_desired and obs.router.healthy_engines == 0 and engines_ok
    )

    if not engines_ok or not router_pods_ok:
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


@dataclass(frozen=True, slots=True)
class ShardReading:
    """One shard's ``/status`` (None when it did not answer, with the error)."""

    index: int
    url: str
    status: RouterStatus | None
    error: str | None = None


def _sum_known(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def combine_shards(readings: Sequence[ShardReading]) -> RouterStatus | None:
    """The pool's router view from its shards: sums of sessions, held work, budgets and completed
    units; the consumed mixture recomputed from the summed per-class counts (never an average of
    the shards' ratios); the oldest generation; ready only when every shard answered ready.
    None when no shard answered."""
    up = [r.status for r in readings if r.status is not None]
    if not up:
        return None
    first = up[0]
    names = [c.name for c in first.classes]
    by_name: dict[str, list[ClassStatus]] = {n: [] for n in names}
    for st in up:
        for c in st.classes:
            by_name.setdefault(c.name, []).append(c)
    completed = {n: sum(c.completed_units for c in cs) for n, cs in by_name.items()}
    total = sum(completed.values())
    target = {c.name: c.target_share for c in first.classes}
    consumed = {n: (completed[n] / total if total else 0.0) for n in by_name}
    classes = [
        ClassStatus(
            name=n,
            target_share=target.get(n, 0.0),
            consumed_share=consumed[n],
            completed_units=completed[n],
            active_sessions=sum(c.active_sessions for c in cs),
            held_requests=sum(c.held_requests for c in cs),
            kv_budget_tokens=_sum_known(c.kv_budget_tokens for c in cs),
            kv_used_tokens=_sum_known(c.kv_used_tokens for c in cs),
        )
        for n, cs in by_name.items()
    ]
    seen: set[str] = set()
    engines = []
    for st in up:  # disjoint by ownership; a re-homing in progress may list one twice for a moment
        for e in st.engines:
            if e.id not in seen:
                seen.add(e.id)
                engines.append(e)
    held_by_reason: dict[str, int] = {}
    for st in up:
        for reason, n in st.held_by_reason.items():
            held_by_reason[reason] = held_by_reason.get(reason, 0) + n
    holds = [st.oldest_hold_s for st in up if st.oldest_hold_s is not None]
    hashes = sorted({st.config_hash for st in up})
    queries = sum(st.prefix_queries_total for st in up)
    hits = sum(st.prefix_hits_total for st in up)
    return RouterStatus(
        generation=min(st.generation for st in up),
        config_hash=hashes[0] if len(hashes) == 1 else "mixed:" + ",".join(hashes),
        model=first.model,
        policy=first.policy,
        paused=any(st.paused for st in up),
        pause_mode=next((st.pause_mode for st in up if st.pause_mode), None),
        ready=len(up) == len(readings) and all(st.ready for st in up),
        draining=any(st.draining for st in up),
        healthy_engines=sum(st.healthy_engines for st in up),
        requests_in_flight=sum(st.requests_in_flight for st in up),
        held_requests=sum(st.held_requests for st in up),
        held_by_reason=held_by_reason,
        oldest_hold_s=max(holds) if holds else None,
        classes=classes,
        engines=engines,
        kv=[row for st in up for row in st.kv],
        mixture_tv_points=100.0 * tv_distance(target, consumed) if total else 0.0,
        sample_rate_per_min=sum(st.sample_rate_per_min for st in up),
        prefix_hit_rate=hits / queries if queries > 0 else None,
        sessions_ended_idle=sum(st.sessions_ended_idle for st in up),
        last_reload_error=next((st.last_reload_error for st in up if st.last_reload_error), None),
        policy_state={},
        prefix_queries_total=queries,
        prefix_hits_total=hits,
    )


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
            "liveShards": st.shard.live if st and st.shard else None,
            "error": r.error,
        })
    return out


def shards_error(readings: Sequence[ShardReading]) -> str | None:
    """One line naming every shard that did not answer, or None."""
    down = [f"shard {r.index}: {r.error}" for r in readings if r.status is None]
    return "; ".join(down) or None
