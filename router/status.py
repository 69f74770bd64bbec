"""The ``/status`` snapshot: one pydantic model, built from the live state in one pass.

The operator's status timer copies this into the RolloutPool status, so the
model is the contract: field names are stable and documented in
``docs/router.md``. ``/metrics`` renders the very same snapshot as gauges
(``metrics.py``), so the two views never disagree.

Per-class KV budget and use come from ``policy.describe()``: MISA-T and its
ablations report ``engines[w].classes[b].{budget_tokens, used_tokens,
sessions, cap}``; baselines report none and the fields are null.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Collection, Mapping
from typing import Any

from pydantic import BaseModel, Field

from .config import RouterConfig
from .engines import EngineRegistry
from .policy.runner import PolicyRunner

SECONDS_PER_MINUTE = 60.0
SAMPLE_RATE_RESOLUTION_S = 0.1
"""Completions this close together share one entry of the sample-rate window (a rate shown
per minute does not need finer time; it bounds the window's memory)."""


class SampleRateMeter:
    """Completed rollout units per minute over a sliding window.

    Fed the cumulative completed-unit count (``runner.mixture.total``) after
    anything that may complete a unit. Completions within ``resolution_s`` of
    the newest entry share it, and entries older than the window are dropped on
    every observation: memory is bounded by ``window / resolution`` entries,
    whatever the rate and whether or not anyone reads ``/status`` (a soak at
    800 units/s with nobody polling grew by one entry per unit before this).
    """

    def __init__(self, started_at: float, resolution_s: float = SAMPLE_RATE_RESOLUTION_S) -> None:
        self._started_at = started_at
        self._resolution_s = resolution_s
        self._events: deque[list[float]] = deque()  # [first time, units]
        self._last_total = 0

    def observe(self, total: int, now: float, window_s: float) -> None:
        if total > self._last_total:
            units = total - self._last_total
            if self._events and now - self._events[-1][0] < self._resolution_s:
                self._events[-1][1] += units
            else:
                self._events.append([now, units])
        self._last_total = total
        self._trim(now, window_s)

    def per_minute(self, now: float, window_s: float) -> float:
        self._trim(now, window_s)
        span = min(window_s, now - self._started_at)
        if span <= 0:
            return 0.0
        return sum(n for _, n in self._events) * SECONDS_PER_MINUTE / span

    def entries(self) -> int:
        return len(self._events)

    def _trim(self, now: float, window_s: float) -> None:
        while self._events and self._events[0][0] < now - window_s:
            self._events.popleft()


class EngineStatus(BaseModel):
    id: str
    healthy: bool
    in_flight: int = Field(description="Requests this router has in flight on the engine.")
    kv_capacity_tokens: int
    kv_usage: float = Field(description="vllm:kv_cache_usage_perc at the last scrape (0..1).")
    running: int
    waiting: int
    prefix_hit_rate: float | None = Field(
        description="Cumulative prefix-cache hits / queries the engine reports; null before any query."
    )
    preemptions_total: float
    last_scrape_age_s: float | None
    last_error: str | None
    draining: bool = Field(False, description="Takes no new sessions (config engines.draining).")
    handing_back: bool = Field(
        False,
        description="Handed back to a returning shard: this shard only finishes its sessions there "
        "(shards.handback_idle_s); the new owner reports it in full.",
    )
    sessions: int = Field(0, description="Live sessions pinned to the engine.")
    weight_version: str | None = Field(
        None, description="Weight version recorded for the engine (/admin/resume?weight_version=, "
        "/admin/engines/call with weight_version); null until known."
    )
    restarts: int = Field(0, description="Restarts seen: the engine's cumulative vLLM counters went back.")
    frozen: bool = Field(
        False, description="A keep pause froze the engine's requests in flight (/admin/pause?mode=keep); "
        "they go on at /admin/resume."
    )
    held: str | None = Field(
        None, description="Why the engine, though healthy, takes no new work: it restarted, or joined the pool, after "
        "a weight version was recorded, and serves its start-up weights until a weight update through "
        "/admin/engines/call reaches it; null otherwise."
    )


class KvAllocation(BaseModel):
    engine: str
    workload_class: str
    sessions: int | None
    cap: int | None = Field(description="K_{w,b}: sessions the class may hold on the engine.")
    budget_tokens: float | None = Field(description="M_{w,b}: the class's KV budget on the engine.")
    used_tokens: float | None = Field(description="Live sessions x the class's footprint k_b.")
    reason: str | None = Field(None, description="Why the class has this budget and cap, in words (MISA, MISA-T).")


class ClassStatus(BaseModel):
    name: str
    target_share: float = Field(description="Target fraction of completed units (0..1).")
    consumed_share: float = Field(description="Fraction of completed units so far (0..1).")
    completed_units: int
    active_sessions: int
    held_requests: int
    kv_budget_tokens: float | None = Field(description="Sum over engines of the class budget.")
    kv_used_tokens: float | None


class ShardStatus(BaseModel):
    """This router as one of several shards (``config.shards``; docs/router.md, "Router shards")."""

    index: int = Field(description="This shard's index (its StatefulSet ordinal).")
    count: int = Field(description="Shards in the pool (len(shards.peers)).")
    live: list[int] = Field(description="Shards this one sees alive (itself included).")
    owned_engines: list[str] = Field(description="Engines this shard owns and admits against.")
    handing_back: list[str] = Field(
        default_factory=list,
        description="Engines handed back to a returning shard that still finish this shard's sessions "
        "on them (continuations only; shards.handback_idle_s).",
    )
    known_engines: int = Field(description="Engines of the whole pool (config or DNS).")


class RouterStatus(BaseModel):
    generation: int
    config_hash: str
    model: str
    policy: str
    paused: bool
    pause_mode: str | None = Field(
        None, description="How the router was paused: wait, abort or keep; null when running.")
    ready: bool
    draining: bool
    healthy_engines: int
    requests_in_flight: int
    held_requests: int
    held_by_reason: dict[str, int] = Field(
        default_factory=dict, description="Held requests per hold reason (session_cap, class_cap, paused, ...)."
    )
    oldest_hold_s: float | None = Field(
        None, description="Seconds the longest-held request has waited; null when none."
    )
    classes: list[ClassStatus]
    engines: list[EngineStatus]
    kv: list[KvAllocation]
    mixture_tv_points: float = Field(description="TV distance target vs consumed, points (0..100).")
    sample_rate_per_min: float = Field(description="Completed units per minute, sliding window.")
    prefix_hit_rate: float | None = Field(description="Engine-reported hits / queries, all engines.")
    sessions_ended_idle: int
    last_reload_error: str | None
    policy_state: dict[str, Any] = Field(description="policy.describe(), verbatim.")
    prefix_queries_total: float = Field(0.0, description="Prompt tokens queried against prefix caches, all engines "
                                        "(so shards' hit rates combine by counts).")
    prefix_hits_total: float = Field(0.0, description="Of those, tokens found cached.")
    shard: ShardStatus | None = Field(None, description="Set when this router is one of several shards.")


def _num(v: object) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def kv_allocations(describe: Mapping[str, Any]) -> list[KvAllocation]:
    """Per engine and class KV rows from ``policy.describe()`` (empty for baselines)."""
    engines = describe.get("engines")
    if not isinstance(engines, Mapping):
        return []
    rows = []
    for engine, info in sorted(engines.items()):
        classes = info.get("classes") if isinstance(info, Mapping) else None
        if not isinstance(classes, Mapping):
            continue
        for cls, row in sorted(classes.items()):
            if not isinstance(row, Mapping):
                continue
            sessions, cap = _num(row.get("sessions")), _num(row.get("cap"))
            rows.append(
                KvAllocation(
                    engine=str(engine),
                    workload_class=str(cls),
                    sessions=None if sessions is None else int(sessions),
                    cap=None if cap is None else int(cap),
                    budget_tokens=_num(row.get("budget_tokens")),
                    used_tokens=_num(row.get("used_tokens")),
                    reason=row["reason"] if isinstance(row.get("reason"), str) else None,
                )
            )
    return rows


def _sum_or_none(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def build_status(
    *,
    config: RouterConfig,
    config_hash: str,
    runner: PolicyRunner,
    registry: EngineRegistry,
    in_flight_per_engine: Mapping[str, int],
    requests_in_flight: int,
    sample_rate_per_min: float,
    draining: bool,
    last_reload_error: str | None,
    now: float,
    weight_versions: Mapping[str, str | None] | None = None,
    pause_mode: str | None = None,
    frozen_engines: Collection[str] = (),
    shard: ShardStatus | None = None,
) -> RouterStatus:
    describe = runner.policy.describe()
    # An engine being handed back is its new owner's to budget: counted here too, a pool's
    # class budgets would hold its capacity twice.
    kv = [row for row in kv_allocations(describe) if row.engine not in registry.handing_back]
    active = runner.active_sessions()
    consumed = runner.mixture.consumed()
    classes = [
        ClassStatus(
            name=spec.name,
            target_share=runner.mixture.target.get(spec.name, 0.0),
            consumed_share=consumed.get(spec.name, 0.0),
            completed_units=runner.mixture.completed.get(spec.name, 0),
            active_sessions=active.get(spec.name, 0),
            held_requests=runner.held_count(spec.name),
            kv_budget_tokens=_sum_or_none(
                [r.budget_tokens for r in kv if r.workload_class == spec.name]
            ),
            kv_used_tokens=_sum_or_none([r.used_tokens for r in kv if r.workload_class == spec.name]),
        )
        for spec in runner.mix.classes
    ]
    engines = []
    hits = queries = 0.0
    draining_ids = config.engines.draining_ids()
    sessions_per_engine = runner.sessions_per_engine()
    for eid in registry.ids():
        st = registry.get(eid)
        assert st is not None
        m = st.metrics
        handing_back = eid in registry.handing_back
        if m is not None and not handing_back:  # counted by its owner
            hits += m.prefix_hits_total
            queries += m.prefix_queries_total
        engines.append(
            EngineStatus(
                id=eid,
                healthy=st.healthy,
                in_flight=in_flight_per_engine.get(eid, 0),
                kv_capacity_tokens=m.kv_capacity_tokens if m else 0,
                kv_usage=m.kv_usage if m else 0.0,
                running=m.num_running if m else 0,
                waiting=m.num_waiting if m else 0,
                prefix_hit_rate=(
                    m.prefix_hits_total / m.prefix_queries_total
                    if m and m.prefix_queries_total > 0 else None
                ),
                preemptions_total=m.preemptions_total if m else 0.0,
                last_scrape_age_s=(now - st.scraped_at) if m else None,
                last_error=st.last_error,
                draining=eid in draining_ids,
                handing_back=handing_back,
                sessions=sessions_per_engine.get(eid, 0),
                weight_version=(weight_versions or {}).get(eid),
                restarts=st.restarts,
                frozen=eid in frozen_engines,
                held=st.held,
            )
        )
    healthy = registry.healthy_count()
    held = runner.held()
    return RouterStatus(
        generation=config.generation,
        config_hash=config_hash,
        model=config.model,
        policy=config.policy.name.value,
        paused=runner.paused,
        pause_mode=pause_mode if runner.paused else None,
        ready=healthy > 0 and not draining,
        draining=draining,
        healthy_engines=healthy,
        requests_in_flight=requests_in_flight,
        held_requests=runner.held_count(),
        held_by_reason=dict(Counter(e.reason.value for e in held)),
        oldest_hold_s=round(now - min(e.held_at for e in held), 3) if held else None,
        classes=classes,
        engines=engines,
        kv=kv,
        mixture_tv_points=runner.mixture.tv_points(),
        sample_rate_per_min=sample_rate_per_min,
        prefix_hit_rate=hits / queries if queries > 0 else None,
        sessions_ended_idle=runner.sessions_ended_idle,
        last_reload_error=last_reload_error,
        policy_state=describe,
        prefix_queries_total=queries,
        prefix_hits_total=hits,
        shard=shard,
    )
