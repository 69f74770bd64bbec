"""Pure status building: conditions with stable transition times, and the router's view.

Conditions (``type``, ``status``, ``reason``, ``message``, ``lastTransitionTime``):

- ``ConfigApplied``: True only when the router's ``/status`` reports the pool's
  current generation. Reasons: Applied, Pending (pushed or written, not yet
  reported), PushFailed, InvalidSpec.
- ``Progressing``: True while engines or router are not yet at the desired
  state (RollingOut) or config is not yet applied; False (Stable) otherwise.
- ``Degraded``: True for an invalid spec (InvalidSpec), an unreachable router
  (RouterUnreachable) or a router reporting no healthy engines
  (NoHealthyEngines); False (AsExpected) otherwise.
- ``Ready``: all engines ready, router ready and config applied (AllReady);
  otherwise False with the first reason that is missing.

``lastTransitionTime`` changes only when a condition's status changes, so a
GitOps tool's health view does not flap with every status tick.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from misat_router.status import RouterStatus

READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
CONFIG_APPLIED = "ConfigApplied"
CONDITION_ORDER = (READY, PROGRESSING, DEGRADED, CONFIG_APPLIED)


def now_iso(now: datetime | None = None) -> str:
    return (now or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")


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
    by_type = {c.get("type"): dict(c) for c in existing or () if isinstance(c, Mapping)}
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


def invalid_spec_conditions(message: str) -> list[Cond]:
    return [
        Cond(READY, False, "InvalidSpec", message),
        Cond(PROGRESSING, False, "InvalidSpec", "nothing applied until the spec is fixed"),
        Cond(DEGRADED, True, "InvalidSpec", message),
        Cond(CONFIG_APPLIED, False, "InvalidSpec", message),
    ]


@dataclass(frozen=True, slots=True)
class Observed:
    """What the status timer saw, one snapshot: Deployments and the router's answer."""

    generation: int
    engines_desired: int
    engines_ready: int
    router_desired: int
    router_ready_replicas: int
    router: RouterStatus | None
    router_error: str | None = None


def health_conditions(obs: Observed) -> list[Cond]:
    """Ready / Progressing / Degraded / ConfigApplied from one observation (pure)."""
    applied = obs.router is not None and obs.router.generation >= obs.generation
    if applied:
        config = Cond(CONFIG_APPLIED, True, "Applied", f"router reports generation {obs.generation}")
    elif obs.router is not None and obs.router.last_reload_error:
        config = Cond(CONFIG_APPLIED, False, "ReloadRefused", obs.router.last_reload_error)
    else:
        seen = "unreachable" if obs.router is None else f"at generation {obs.router.generation}"
        config = Cond(CONFIG_APPLIED, False, "Pending", f"waiting for generation {obs.generation}; router {seen}")

    engines_ok = obs.engines_ready >= obs.engines_desired
    router_pods_ok = obs.router_ready_replicas >= obs.router_desired
    rolling = not engines_ok or not router_pods_ok
    if rolling:
        progressing = Cond(
            PROGRESSING, True, "RollingOut",
            f"engines {obs.engines_ready}/{obs.engines_desired}, "
            f"router {obs.router_ready_replicas}/{obs.router_desired}",
        )
    elif not applied:
        progressing = Cond(PROGRESSING, True, "ApplyingConfig", config.message)
    else:
        progressing = Cond(PROGRESSING, False, "Stable", "desired state reached")

    if obs.router_desired and obs.router is None and router_pods_ok:
        degraded = Cond(DEGRADED, True, "RouterUnreachable", obs.router_error or "no answer from /status")
    elif obs.router is not None and obs.engines_desired and obs.router.healthy_engines == 0 and engines_ok:
        degraded = Cond(DEGRADED, True, "NoHealthyEngines", "engine pods are ready but the router sees none healthy")
    else:
        degraded = Cond(DEGRADED, False, "AsExpected", "")

    router_ok = obs.router_desired == 0 or (obs.router is not None and obs.router.ready)
    if not engines_ok:
        ready = Cond(READY, False, "EnginesNotReady", progressing.message)
    elif not router_ok:
        ready = Cond(READY, False, "RouterNotReady", obs.router_error or "router not ready")
    elif not applied:
        ready = Cond(READY, False, "ConfigNotApplied", config.message)
    elif degraded.status:
        ready = Cond(READY, False, degraded.reason, degraded.message)
    else:
        ready = Cond(READY, True, "AllReady", "engines, router and config are in place")
    return [ready, progressing, degraded, config]


def _pct(x: float) -> float:
    return round(100.0 * x, 2)


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
