"""The pool's ``/status`` from its router shards' (pure): one view of several routers.

Each shard reports only what it owns (its engines, its sessions, its held work);
the pool's view sums those, recomputes the consumed mixture from the summed
per-class counts (never an average of the shards' ratios) and counts prefix hits
by their totals. The operator builds ``status.router`` with it, and a shard
answers ``GET /status?scope=pool`` with it (``ops_endpoints.py``), so ``misat
status`` through the proxy shows the whole pool.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .policy.mixture import tv_distance
from .status import ClassStatus, RouterStatus


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
    # Disjoint by ownership, but for an engine being handed back (listed by its owner and by the
    # shard draining its sessions there: the owner's row wins) and for the moment of a re-homing.
    for e in sorted((e for st in up for e in st.engines), key=lambda e: e.handing_back):
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
