"""MISA-T: mix-aware session admission with a time factor, and its ablations.

Algorithm (``docs/misa-t.md`` is the specification):

1. Continuations of a live session are always admitted, on the session's
   engine; if that engine is gone (or the router restarted and the session
   is unknown but ``turn > 0``), on the cheapest healthy engine, caps ignored.
2. A new session of class ``b`` may go to engine ``w`` only if
   - ``w`` is below its new-session cap ``floor(K_w * f_w)``, where
     ``K_w = floor(C_w * budget / k_ref)`` is how many sessions of today's size
     fit in the engine's KV budget (``k_ref``: the footprints ``k_b`` averaged
     over the live population) and ``f_w`` is the hit guard's factor
     (``hit_guard.py``), and
   - (MISA, MISA-T) class ``b`` is below its cap on ``w``:
     ``K_{w,b} = max(1, floor(M_{w,b} / k_b))``, ``M_{w,b} = C_w * budget *
     R_{w,b} / sum R``, ``R_{w,b} = N_{w,b} * k_b * T_b`` (MISA-T) or
     ``N_{w,b} * k_b`` (MISA), with ``N_{w,b}`` the class's live sessions on
     ``w`` plus an even share of its held ones.
   Among the engines that pass, the lowest estimated cost wins:
   ``c = d_w + (L - H_w) / mu`` (``placement`` settings; ``H_w`` from the
   prefix index). No engine passes: HOLD, with the binding reason.
3. Occupancy counts the router's own live sessions plus load the engine
   reports that this router did not place. Requests placed or finished since
   the engine's last scrape are the pending set: they are taken from the
   router's books, not from the stale snapshot, so old metrics never
   over-admit.
4. On completion a session contributes its footprint (peak or mean KV
   tokens, or its KV token-seconds over its residency for the ``occupancy``
   statistic) to ``k_b`` and its residency to ``T_b``: from its first placement
   (its admission; time held before does not count) to its end, tool gaps
   included. With ``residency.censored``, live sessions count too, as
   censored observations (each has stayed at least its age so far), so that
   at start-up ``T_b`` is not the residency of the short sessions that
   finish first.

``session-admission`` mode runs step 2 without class caps.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass

from .base import Engines, Policy, healthy_ids
from .budgets import CAP_ROUNDING_SLACK, allocate, class_session_cap
from .estimators import WindowPercentile, WindowRatio, censored_percentile
from .hit_guard import HitGuard
from .prefix_index import PrefixIndex, PromptKeys, prompt_keys
from .settings import PolicySettings, WorkloadMix
from .types import Completion, Decision, EngineSnapshot, Reason, RequestMeta

BOUND_TOLERANCE = 1e-9
"""A budget share this close to a class's minKvShare / maxKvShare was set by it (float rounding)."""
_KEY_MEMO_LIMIT = 1 << 16
"""Bound on memoised prompt keys (a cache, not a policy constant)."""


@dataclass(slots=True)
class LiveSession:
    workload_class: str
    engine_id: str
    admitted_at: float
    peak_tokens: int = 0
    """Largest prompt + output of a finished request of the session."""
    known_tokens: int = 0
    """Largest size seen so far: the peak, or a placed prompt (a lower bound while it runs)."""
    failed: bool = False
    samples: int = 1
    """Sequences the session runs at once (the most of any of its requests, ``RequestMeta.samples``):
    it takes that many places in the session counts, and its footprint is shared among them."""
    kv_token_s: float = 0.0
    """KV token-seconds the session has held so far (``footprint.statistic: occupancy``): each
    request its prompt plus half its output for as long as it ran (a context that grows
    linearly), each gap between requests its whole context (cached for the next turn)."""
    turn_started_at: float = 0.0
    cached_tokens: int = 0
    """Context of the last finished request, held in the engine's cache until the next turn."""
    cached_since: float = 0.0


class MisaPolicy(Policy):
    """MISA-T, MISA or session-admission-only, by ``settings.name``."""

    def __init__(self, settings: PolicySettings, mix: WorkloadMix) -> None:
        super().__init__(settings, mix)
        self.name = settings.name
        self.budgets_on = settings.name.uses_class_budgets
        self.residency_on = settings.name.uses_residency
        self.index = PrefixIndex(settings.prefix)
        self.sessions: dict[str, LiveSession] = {}
        self.engine_sessions: dict[str, int] = {}
        self.engine_class_sessions: dict[str, dict[str, int]] = {}
        self.class_sessions: dict[str, int] = {}
        self.class_known_tokens: dict[str, int] = {}
        self.held_ids: set[str] = set()
        self.held_per_class: dict[str, int] = {}
        self.footprint: dict[str, WindowPercentile] = {}
        self.kv_occupancy: dict[str, WindowRatio] = {}
        """Per class: KV token-seconds over residency of recent sessions (``footprint.statistic:
        occupancy``); kept whatever the statistic, so a hot reload switches at once."""
        self.residency: dict[str, WindowPercentile] = {}
        self._residency_km: dict[str, float] | None = None
        """T_b with live sessions counted as censored, as of the last scrape (``residency.censored``)."""
        self.guards: dict[str, HitGuard] = {}
        self.snapshots: dict[str, EngineSnapshot] = {}
        # (time, +1 placed / -1 finished) per engine since its last scrape.
        self._events: dict[str, deque[tuple[float, int]]] = {}
        # Per engine: the scrape time occupancy() last read, and the sum of the events after it.
        # occupancy() runs for every engine a new session is checked against, and walking the
        # events each time was the policy's largest cost on a large fleet with sessions held
        # (docs/simulator.md). Kept exact by _event: time only moves forward, so the events
        # after a scrape are a suffix of the deque.
        self._since_at: dict[str, float] = {}
        self._since: dict[str, int] = {}
        self._key_memo: dict[str, PromptKeys] = {}
        # Session key -> keys of its last placed prompt, least recently placed first.
        self._last_prompt: OrderedDict[str, PromptKeys] = OrderedDict()
        self._last_prompt_symbols = 0
        self._set_mix_bounds(mix)

    def _set_mix_bounds(self, mix: WorkloadMix) -> None:
        self._min_share = {c.name: c.min_share for c in mix.classes if c.min_share is not None}
        self._max_share = {c.name: c.max_share for c in mix.classes if c.max_share is not None}
        total = sum(c.share for c in mix.classes)
        self._target_share = {c.name: c.share / total for c in mix.classes} if total > 0 else {}
        self._bootstrap = {
            c.name: float(c.bootstrap_footprint_tokens or self.settings.footprint.bootstrap_tokens)
            for c in mix.classes
        }

    # ---- estimates ------------------------------------------------------

    def footprint_of(self, workload_class: str) -> float:
        """k_b in KV tokens."""
        est: WindowPercentile | WindowRatio | None
        if self.settings.footprint.statistic == "occupancy":
            est = self.kv_occupancy.get(workload_class)
        else:
            est = self.footprint.get(workload_class)
        value = est.value() if est is not None else None
        if value is None:
            prior = self._bootstrap.get(workload_class, float(self.settings.footprint.bootstrap_tokens))
            live = self.class_sessions.get(workload_class, 0)
            if live:
                # Before completions arrive, what live sessions already hold is a floor.
                prior = max(prior, self.class_known_tokens.get(workload_class, 0) / live)
            return prior
        return max(1.0, value)

    def residency_of(self, workload_class: str) -> float:
        """T_b in seconds; classes without samples get the mean of those with (1 if none)."""
        km = self._residency_km
        if km is not None:
            value = km.get(workload_class)
            if value is not None:
                return max(value, 1e-6)
            return max(sum(km.values()) / len(km), 1e-6) if km else 1.0
        est = self.residency.get(workload_class)
        value = est.value() if est is not None else None
        if value is not None:
            return max(value, 1e-6)
        known = [v for e in self.residency.values() if (v := e.value()) is not None]
        return max(sum(known) / len(known), 1e-6) if known else 1.0

    def release_rank(self, workload_class: str) -> float | None:
        """``admission.releaseOrder: longest-first``: the longest T_b goes first (its negative)."""
        if self.settings.admission.release_order != "longest-first":
            return None
        return -self.residency_of(workload_class)

    def _refresh_residency(self, now: float) -> None:
        """Recompute T_b with live sessions as censored observations (``residency.censored``).

        Once per scrape rather than per decision: it walks every live session.
        """
        rs = self.settings.residency
        if not (self.residency_on and rs.censored):
            self._residency_km = None
            return
        ages: dict[str, list[float]] = {}
        for live in self.sessions.values():
            if not live.failed:
                ages.setdefault(live.workload_class, []).append(now - live.admitted_at)
        km: dict[str, float] = {}
        for b in ages.keys() | self.residency.keys():
            est = self.residency.get(b)
            done = est.samples() if est is not None else []
            running = ages.get(b, [])
            if len(done) + len(running) < rs.min_samples:
                continue
            value = censored_percentile(done, running, rs.percentile)
            km[b] = value if value is not None else max(done + running)
        self._residency_km = km

    def _time_factor(self, workload_class: str) -> float:
        """T_b ** residency.exponent: the weight MISA-T adds to a session of the class."""
        exponent = self.settings.residency.exponent
        t = self.residency_of(workload_class)
        return t if exponent == 1.0 else t**exponent

    def _demand(self, extra_class: str | None, extra: int = 1) -> dict[str, float]:
        """Unfinished sessions per class (live + held), plus the request being decided (``extra``
        places: its samples)."""
        demand: dict[str, float] = {c.name: 0.0 for c in self.mix.classes}
        for b, n in self.class_sessions.items():
            demand[b] = demand.get(b, 0.0) + n
        for b, n in self.held_per_class.items():
            demand[b] = demand.get(b, 0.0) + n
        if extra_class is not None:
            demand[extra_class] = demand.get(extra_class, 0.0) + extra
        return demand

    def reference_footprint(self, demand: dict[str, float]) -> float:
        """k_ref: footprints averaged over the unfinished population (sessions of today's size)."""
        total = sum(demand.values())
        if total <= 0:
            known = [self.footprint_of(c.name) for c in self.mix.classes]
            return sum(known) / len(known)
        return sum(n * self.footprint_of(b) for b, n in demand.items() if n) / total

    def session_cap(self, snap: EngineSnapshot, k_ref: float) -> int:
        """K_w: sessions of reference size that fit in the engine's KV budget."""
        a = self.settings.admission
        if snap.kv_capacity_tokens <= 0:
            return a.sessions_before_capacity_known
        fit = math.floor(snap.kv_capacity_tokens * self.settings.kv_budget_fraction / k_ref)
        return max(a.min_sessions_per_engine, min(a.max_sessions_per_engine, fit))

    def new_session_cap(self, engine_id: str, snap: EngineSnapshot, k_ref: float) -> int:
        cap = self.session_cap(snap, k_ref)
        guard = self.guards.get(engine_id)
        if guard is None or guard.factor >= 1.0:
            return cap
        return max(self.settings.admission.min_sessions_per_engine, math.floor(cap * guard.factor))

    def class_weights(self, demand: dict[str, float]) -> dict[str, tuple[float, float]]:
        """Per class: (held sessions, demand weight of one session: k_b * T_b, or k_b for MISA)."""
        out = {}
        for b, total in demand.items():
            w = self.footprint_of(b)
            if self.residency_on:
                w *= self._time_factor(b)
            out[b] = (total - self.class_sessions.get(b, 0), w)
        return out

    def class_budgets(
        self, engine_id: str, snap: EngineSnapshot, weights: dict[str, tuple[float, float]], n_engines: int
    ) -> dict[str, float]:
        """M_{w,b} in KV tokens for every class on one engine.

        ``R_{w,b} = N_{w,b} * k_b (* T_b)``, where ``N_{w,b}`` is the class's live
        sessions on the engine plus an even share of its held sessions.
        """
        per_class = self.engine_class_sessions.get(engine_id, {})
        capacity = snap.kv_capacity_tokens * self.settings.kv_budget_fraction
        if self.settings.budget_basis == "target":
            return self._target_budgets(capacity, per_class, weights)
        held_share = 1.0 / max(1, n_engines)
        r = {b: (per_class.get(b, 0) + held * held_share) * w for b, (held, w) in weights.items()}
        if not self._min_share and not self._max_share:
            total_r = sum(r.values())
            if total_r <= 0:
                return dict.fromkeys(r, 0.0)
            return {b: capacity * x / total_r for b, x in r.items()}
        return allocate(capacity, r, self._min_share, self._max_share)

    def _target_budgets(
        self, capacity: float, per_class: dict[str, int], weights: dict[str, tuple[float, float]]
    ) -> dict[str, float]:
        """``budgetBasis: target``: ``R_b = share_b * k_b * T_b^e``, each class capped at its need.

        The need bound is what the class's unfinished sessions could hold here (its live
        sessions on the engine plus every held one); a class pinned at it leaves the rest
        to the others, as a ``maxKvShare`` bound does. Not below ``minKvShare``.
        """
        if capacity <= 0:
            return dict.fromkeys(weights, 0.0)
        r = {b: self._target_share.get(b, 0.0) * w for b, (_, w) in weights.items()}
        upper: dict[str, float] = {}
        for b, (held, _) in weights.items():
            need = (per_class.get(b, 0) + held) * self.footprint_of(b) / capacity
            bound = min(self._max_share.get(b, 1.0), need)
            upper[b] = max(bound, self._min_share.get(b, 0.0))
        return allocate(capacity, r, self._min_share, upper)

    def occupancy(self, engine_id: str, snap: EngineSnapshot) -> int:
        """Sessions on the engine: ours, plus reported load that is not ours."""
        ours = self.engine_sessions.get(engine_id, 0)
        visible = snap.num_running + snap.num_waiting
        if visible <= 0:
            return ours
        if self._since_at.get(engine_id) == snap.scraped_at:
            since = self._since[engine_id]
        else:
            since = 0
            events = self._events.get(engine_id)
            if events:
                for t, delta in reversed(events):
                    if t <= snap.scraped_at:
                        break
                    since += delta
            self._since_at[engine_id] = snap.scraped_at
            self._since[engine_id] = since
        # Our in-flight requests at scrape time = now minus what changed since.
        ours_at_scrape = self.load.get(engine_id) - since
        return ours + max(0, visible - ours_at_scrape)

    # ---- decide ---------------------------------------------------------

    def _keys(self, req: RequestMeta) -> PromptKeys:
        keys = self._key_memo.get(req.request_id)
        if keys is None:
            keys = self._prompt_keys(req)
            if len(self._key_memo) >= _KEY_MEMO_LIMIT:
                self._key_memo.clear()
            self._key_memo[req.request_id] = keys
        return keys

    def _prompt_keys(self, req: RequestMeta) -> PromptKeys:
        """The prompt's keys, those of blocks shared with the session's last prompt reused."""
        last = self._last_prompt.get(req.session_key) if req.session_id is not None else None
        return prompt_keys(req, self.settings.prefix, last)

    def _remember_prompt(self, session_key: str, keys: PromptKeys) -> None:
        self._forget_prompt(session_key)
        self._last_prompt[session_key] = keys
        self._last_prompt_symbols += keys.symbols
        while self._last_prompt_symbols > self.settings.prefix.session_prompt_cache_symbols:
            _, oldest = self._last_prompt.popitem(last=False)
            self._last_prompt_symbols -= oldest.symbols

    def _forget_prompt(self, session_key: str) -> None:
        keys = self._last_prompt.pop(session_key, None)
        if keys is not None:
            self._last_prompt_symbols -= keys.symbols

    def _prompt_len(self, req: RequestMeta) -> float:
        if req.prompt_tokens:
            return float(req.prompt_tokens)
        if req.prompt_token_ids is not None:
            return float(len(req.prompt_token_ids))
        if req.prompt_text:
            return len(req.prompt_text) / self.settings.prefix.chars_per_token
        return 0.0

    def _costs(
        self, req: RequestMeta, engines: Engines, candidates: list[str]
    ) -> Iterator[tuple[float, str, float]]:
        """(cost, engine, expected hit tokens) for every candidate, in the candidates' order."""
        keys = self._keys(req)
        hits = self.index.match(keys, candidates)
        length = self._prompt_len(req)
        p = self.settings.placement
        per_wait, per_flight, rate = p.delay_per_waiting_s, p.delay_per_inflight_s, p.prefill_tokens_per_s
        load = self.load.in_flight_map().get
        for w in candidates:
            hit = hits[w]
            yield engines[w].num_waiting * per_wait + load(w, 0) * per_flight + max(0.0, length - hit) / rate, w, hit

    def _by_cost(
        self, req: RequestMeta, engines: Engines, candidates: list[str]
    ) -> list[tuple[float, str, float]]:
        """(cost, engine, expected hit tokens) for every candidate, cheapest first; ties by id."""
        return sorted(self._costs(req, engines, candidates))

    def _cheapest(self, req: RequestMeta, engines: Engines, candidates: list[str]) -> tuple[float, str, float]:
        """``_by_cost(...)[0]`` without sorting the rest."""
        return min(self._costs(req, engines, candidates))

    def decide(self, req: RequestMeta, engines: Engines, now: float) -> Decision:
        live = self.sessions.get(req.session_key)
        if live is not None:
            snap = engines.get(live.engine_id)
            if snap is not None and snap.healthy:
                return Decision.place(live.engine_id, Reason.CONTINUATION)
        healthy = healthy_ids(engines)
        if not healthy:
            return Decision.hold(Reason.HOLD_NO_ENGINE)
        if live is None and req.engine_hint is not None and req.turn > 0 and req.session_id is not None:
            # A session begun before a restart, or on another shard: its KV is where its client
            # says; the prefix index, which would find it, starts empty.
            snap = engines.get(req.engine_hint)
            if snap is not None and snap.healthy:
                return Decision.place(req.engine_hint, Reason.CONTINUATION_HINTED)
        if live is not None or (req.turn > 0 and req.session_id is not None):
            cost, engine, hit = self._by_cost(req, engines, healthy)[0]
            return Decision.place(engine, Reason.CONTINUATION_MOVED, {"cost": cost, "hit_tokens": hit})

        cls = req.workload_class
        samples = req.samples
        demand = self._demand(None if req.request_id in self.held_ids else cls, samples)
        k_ref = self.reference_footprint(demand)
        k_b = self.footprint_of(cls)
        if self.budgets_on:
            weights = self.class_weights(demand)
            # The inline split below is the demand basis without share bounds; anything else
            # goes through class_budgets (the target basis and minKvShare / maxKvShare).
            fast_budgets = (not self._min_share and not self._max_share
                            and self.settings.budget_basis == "demand")
            held_share = 1.0 / len(healthy)
            held_r = sum(held * w for held, w in weights.values()) * held_share
            w_cls = weights[cls][1]
            held_cls = weights[cls][0] * held_share
        # The loop below inlines session_cap / new_session_cap / occupancy / class caps: it
        # runs once per healthy engine for every new session, and call overhead dominated it.
        adm = self.settings.admission
        budget_fraction = self.settings.kv_budget_fraction
        min_cap, max_cap = adm.min_sessions_per_engine, adm.max_sessions_per_engine
        unknown_cap = adm.sessions_before_capacity_known
        kv_gate = adm.max_kv_usage_for_new_sessions
        guards, engine_sessions = self.guards, self.engine_sessions
        per_engine_class = self.engine_class_sessions
        budgets_on = self.budgets_on
        k_b_floor = max(k_b, 1.0)
        # Caps first on every engine, then costs (the prefix match) for the engines that admit
        # only: most decisions on a full fleet are holds (held sessions re-checked as room
        # appears), and those need no costs at all. The engine placed is the cheapest that
        # admits, ties by id, as a walk in cost order would find it.
        admitting: list[str] = []
        rejected: dict[str, Reason] = {}  # engines refused with a reason of their own
        caps: dict[int, int] = {}  # K_w by KV capacity: a fleet's engines mostly share one
        for w in healthy:
            snap = engines[w]
            if snap.kv_usage > kv_gate:
                rejected[w] = Reason.HOLD_KV_FULL
                continue
            capacity = snap.kv_capacity_tokens
            cap = caps.get(capacity)
            if cap is None:
                cap = caps[capacity] = (max(min_cap, min(max_cap, int(capacity * budget_fraction / k_ref)))
                                        if capacity > 0 else unknown_cap)
            guard = guards.get(w)
            if guard is not None and guard.factor < 1.0:
                cap = max(min_cap, int(cap * guard.factor))
            ours = engine_sessions.get(w, 0)
            occupied = ours if snap.num_running + snap.num_waiting <= 0 else self.occupancy(w, snap)
            # A group larger than the cap still runs alone on an idle engine, or it never would.
            if occupied and occupied + samples > cap:
                continue
            if budgets_on and capacity > 0:
                per = per_engine_class.get(w)
                live_cls = per.get(cls, 0) if per else 0
                if fast_budgets:
                    # M_{w,b} for this class only: C * R_b / sum R, without building the dict.
                    total_r = held_r
                    if per:
                        for b, n in per.items():
                            if n:
                                total_r += n * weights[b][1]
                    mine = (live_cls + held_cls) * w_cls
                    budget = capacity * budget_fraction * mine / total_r if total_r > 0 else 0.0
                else:
                    budget = self.class_budgets(w, snap, weights, len(healthy))[cls]
                # class_session_cap(budget, k_b_floor), inlined (k_b_floor is at least 1).
                if live_cls and live_cls + samples > max(1, math.floor(budget / k_b_floor + CAP_ROUNDING_SLACK)):
                    rejected[w] = Reason.HOLD_CLASS_CAP
                    continue
            admitting.append(w)
        if admitting:
            cost, w, hit = self._cheapest(req, engines, admitting)
            return Decision.place(w, Reason.NEW_SESSION, {"cost": cost, "hit_tokens": hit})
        reason = Reason.HOLD_SESSION_CAP
        if rejected:
            kinds = set(rejected.values())
            # Both kinds: the reason is the costliest such engine's (what the walk in cost order
            # that this loop replaced reported, kept so that the held reasons stay comparable).
            reason = kinds.pop() if len(kinds) == 1 else rejected[self._by_cost(req, engines, list(rejected))[-1][1]]
        return Decision.hold(reason, {"k_ref": k_ref, "k_b": k_b})

    def hold_order(self, req: RequestMeta) -> tuple[int, float] | None:
        """``(samples, k_ref)`` of a held new session when caps do not depend on its class (no
        class budgets): its every engine check is ``occupied + samples > cap(k_ref)`` or the KV
        gate, neither of which reads the class (a held request's demand leaves it out, so its
        ``k_ref`` is the population's). Within a release pass occupancy only grows and snapshots
        and guards stand still, so more samples or a larger ``k_ref`` (smaller caps) is held
        wherever a smaller key was, for the same reason."""
        if self.budgets_on or req.request_id not in self.held_ids:
            return None
        return req.samples, self.reference_footprint(self._demand(None))

    # ---- learning hooks -------------------------------------------------

    def _count(self, engine_id: str, workload_class: str, delta: int) -> None:
        self.engine_sessions[engine_id] = self.engine_sessions.get(engine_id, 0) + delta
        per = self.engine_class_sessions.setdefault(engine_id, {})
        per[workload_class] = per.get(workload_class, 0) + delta
        self.class_sessions[workload_class] = self.class_sessions.get(workload_class, 0) + delta

    def on_hold(self, req: RequestMeta, now: float) -> None:
        if req.request_id not in self.held_ids:
            self.held_ids.add(req.request_id)
            self.held_per_class[req.workload_class] = (
                self.held_per_class.get(req.workload_class, 0) + req.samples
            )

    def on_unhold(self, req: RequestMeta, now: float) -> None:
        if req.request_id in self.held_ids:
            self.held_ids.discard(req.request_id)
            self.held_per_class[req.workload_class] -= req.samples
            if not self.held_per_class[req.workload_class]:
                del self.held_per_class[req.workload_class]

    def on_placed(self, req: RequestMeta, engine_id: str, now: float) -> None:
        super().on_placed(req, engine_id, now)
        self._event(engine_id, now, req.samples)
        keys = self._key_memo.pop(req.request_id, None) or self._prompt_keys(req)
        self.index.insert_later(keys, engine_id)
        if req.session_id is not None and not req.end_of_session:
            self._remember_prompt(req.session_key, keys)
        live = self.sessions.get(req.session_key)
        if live is None:
            live = self.sessions[req.session_key] = LiveSession(
                req.workload_class, engine_id, now, samples=req.samples
            )
            self._count(engine_id, req.workload_class, req.samples)
        elif req.samples > live.samples:
            self._count(live.engine_id, live.workload_class, req.samples - live.samples)
            live.samples = req.samples
        self._know(live, req.prompt_tokens)
        if live.cached_tokens:
            live.kv_token_s += (now - live.cached_since) * live.cached_tokens
            live.cached_tokens = 0
        live.turn_started_at = now
        if live.engine_id != engine_id:
            self._count(live.engine_id, live.workload_class, -live.samples)
            live.engine_id = engine_id
            self._count(engine_id, live.workload_class, live.samples)

    def _event(self, engine_id: str, now: float, delta: int) -> None:
        self._events.setdefault(engine_id, deque()).append((now, delta))
        at = self._since_at.get(engine_id)
        if at is not None and now > at:
            self._since[engine_id] += delta

    def flush_deferred(self) -> None:
        self.index.flush()

    def on_finished(
        self, req: RequestMeta, engine_id: str, completion: Completion, now: float
    ) -> None:
        super().on_finished(req, engine_id, completion, now)
        self._event(engine_id, now, -req.samples)
        live = self.sessions.get(req.session_key)
        if live is None:
            return
        size = completion.prompt_tokens + completion.completion_tokens
        live.peak_tokens = max(live.peak_tokens, size)
        live.kv_token_s += (now - live.turn_started_at) * (
            completion.prompt_tokens + completion.completion_tokens / 2.0)
        live.cached_tokens = size
        live.cached_since = now
        self._know(live, size)
        if not completion.ok:
            live.failed = True

    def _know(self, live: LiveSession, tokens: int) -> None:
        if tokens > live.known_tokens:
            b = live.workload_class
            self.class_known_tokens[b] = self.class_known_tokens.get(b, 0) + tokens - live.known_tokens
            live.known_tokens = tokens

    def _forget(self, live: LiveSession) -> None:
        self._count(live.engine_id, live.workload_class, -live.samples)
        b = live.workload_class
        self.class_known_tokens[b] = self.class_known_tokens.get(b, 0) - live.known_tokens

    def on_session_end(self, session_key: str, now: float) -> None:
        self._forget_prompt(session_key)
        live = self.sessions.pop(session_key, None)
        if live is None:
            return
        self._forget(live)
        if live.failed or live.peak_tokens <= 0:
            return
        fp = self.settings.footprint
        size = live.peak_tokens if fp.statistic != "mean" else live.peak_tokens / 2.0
        # k_b is per sequence: a group's samples share its prompt and split its footprint.
        size /= live.samples
        b = live.workload_class
        stayed = now - live.admitted_at
        # Looked up before built: this runs at the end of every session (every request of a
        # single-turn class), and most of the time the class has its estimators already.
        footprint = self.footprint.get(b)
        if footprint is None:
            footprint = self.footprint[b] = WindowPercentile(fp.window, fp.percentile, fp.min_samples)
        footprint.add(size)
        if stayed > 0:
            held_kv = self.kv_occupancy.get(b)
            if held_kv is None:
                held_kv = self.kv_occupancy[b] = WindowRatio(fp.window, fp.min_samples)
            held_kv.add(live.kv_token_s / live.samples, stayed)
        residency = self.residency.get(b)
        if residency is None:
            rs = self.settings.residency
            residency = self.residency[b] = WindowPercentile(rs.window, rs.percentile, rs.min_samples)
        residency.add(stayed)

    def on_metrics(self, engines: Engines, now: float) -> None:
        pf = self.settings.prefix
        for w, snap in engines.items():
            self.snapshots[w] = snap
            guard = self.guards.get(w)
            if guard is None:
                guard = self.guards[w] = HitGuard(self.settings.admission,
                                                  self.settings.placement.prefill_tokens_per_s)
            guard.observe(snap)
            if snap.kv_capacity_tokens > 0:
                blocks = snap.kv_capacity_tokens / pf.block_size
                self.index.set_limit(w, math.ceil(blocks * pf.capacity_multiple))
            events = self._events.get(w)
            while events and events[0][0] <= snap.scraped_at:
                events.popleft()
            self._since_at.pop(w, None)  # the sums are per scrape: start again from this one
        self._refresh_residency(now)

    def on_prefix_cache_reset(self, now: float) -> None:
        self.index.clear()
        for guard in self.guards.values():
            guard.reset(now)

    def on_engine_restarted(self, engine_id: str, now: float) -> None:
        # What the index says the engine holds is gone, and its hit rate restarts from a cold
        # cache: measured against the level before, the guard would cut new sessions on the
        # engine with the most room.
        self.index.remove_engine(engine_id)
        guard = self.guards.get(engine_id)
        if guard is not None:
            guard.reset(now)

    def on_engine_removed(self, engine_id: str, now: float) -> None:
        super().on_engine_removed(engine_id, now)
        for key, live in list(self.sessions.items()):
            if live.engine_id == engine_id:
                del self.sessions[key]
                self._forget(live)
        self.engine_sessions.pop(engine_id, None)
        self.engine_class_sessions.pop(engine_id, None)
        self.index.remove_engine(engine_id)
        self.guards.pop(engine_id, None)
        self.snapshots.pop(engine_id, None)
        self._events.pop(engine_id, None)
        self._since_at.pop(engine_id, None)
        self._since.pop(engine_id, None)

    def set_mix(self, mix: WorkloadMix) -> None:
        """A new workload mixture (hot reload); live sessions and estimates are kept."""
        self.mix = mix
        self._set_mix_bounds(mix)

    def set_settings(self, settings: PolicySettings) -> bool:
        """New knobs in place: estimates, hit history and live sessions are kept.

        A new prefix block size or chunking invalidates the index's keys, so the
        index starts empty; it refills as prompts are placed.
        """
        if settings.name is not self.settings.name and not (
            settings.name.uses_admission and self.settings.name.uses_admission
        ):
            return False
        old = self.settings
        self.settings = settings
        self.name = settings.name
        self.budgets_on = settings.name.uses_class_budgets
        self.residency_on = settings.name.uses_residency
        if settings.residency != old.residency or settings.name is not old.name:
            self._residency_km = None  # recomputed under the new settings at the next scrape
        if settings.prefix != old.prefix:
            self.index = PrefixIndex(settings.prefix)
            self._key_memo.clear()
            self._last_prompt.clear()
            self._last_prompt_symbols = 0
        for guard in self.guards.values():
            guard.settings = settings.admission
            guard.prefill_tokens_per_s = settings.placement.prefill_tokens_per_s
        for estimators, cfg in ((self.footprint, settings.footprint), (self.residency, settings.residency)):
            for est in estimators.values():
                est.reconfigure(cfg.window, cfg.percentile, cfg.min_samples)
        for ratio in self.kv_occupancy.values():
            ratio.reconfigure(settings.footprint.window, settings.footprint.min_samples)
        self._set_mix_bounds(self.mix)
        return True

    def adopt_session(
        self, session_key: str, workload_class: str, engine_id: str, admitted_at: float, now: float
    ) -> None:
        if session_key not in self.sessions:
            self.sessions[session_key] = LiveSession(workload_class, engine_id, admitted_at)
            self._count(engine_id, workload_class, 1)

    # ---- reporting ------------------------------------------------------

    def _budget_reason(
        self, b: str, snap: EngineSnapshot, live: int, held: float, n_engines: int, budget: float
    ) -> str:
        """Why class ``b`` has this budget and cap on the engine, in words (``/status``)."""
        fraction = self.settings.kv_budget_fraction
        capacity = snap.kv_capacity_tokens * fraction
        share = budget / capacity if capacity > 0 else 0.0
        k = self.footprint_of(b)
        if self.settings.budget_basis == "target":
            basis = f"target share {self._target_share.get(b, 0.0):.0%} x footprint {k:,.0f} tokens"
        else:
            basis = f"{live + held / max(1, n_engines):.1f} sessions x footprint {k:,.0f} tokens"
        if self.residency_on:
            exponent = self.settings.residency.exponent
            basis += f" x residency {self.residency_of(b):.0f} s" + (f" ^ {exponent:g}" if exponent != 1.0 else "")
        # Shares within rounding of a bound were set by it.
        if b in self._max_share and share >= self._max_share[b] - BOUND_TOLERANCE:
            basis += f", held at maxKvShare {self._max_share[b]:.0%}"
        elif b in self._min_share and share <= self._min_share[b] + BOUND_TOLERANCE:
            basis += f", raised to minKvShare {self._min_share[b]:.0%}"
        elif self.settings.budget_basis == "target" and capacity > 0 and budget >= (live + held) * k - BOUND_TOLERANCE:
            basis += f", capped at what its {live + held:.0f} unfinished sessions could use"
        return (f"{share:.0%} of the engine's KV budget ({fraction:.0%} of {snap.kv_capacity_tokens:,} tokens), "
                f"in proportion to {basis}; cap = max(1, floor(budget / footprint))")

    def describe(self) -> dict[str, object]:
        demand = self._demand(None)
        k_ref = self.reference_footprint(demand)
        healthy = healthy_ids(self.snapshots)
        engines: dict[str, object] = {}
        for w in sorted(self.snapshots):
            snap = self.snapshots[w]
            guard = self.guards.get(w)
            per = self.engine_class_sessions.get(w, {})
            weights = self.class_weights(demand)
            budgets = self.class_budgets(w, snap, weights, len(healthy)) if self.budgets_on else {}
            engines[w] = {
                "healthy": snap.healthy,
                "kv_capacity_tokens": snap.kv_capacity_tokens,
                "kv_usage": snap.kv_usage,
                "session_cap": self.session_cap(snap, k_ref),
                "new_session_cap": self.new_session_cap(w, snap, k_ref),
                "occupancy": self.occupancy(w, snap),
                "hit_rate": guard.hit_rate if guard else None,
                "healthy_hit_rate": guard.healthy if guard else None,
                "new_session_factor": guard.factor if guard else 1.0,
                "classes": {
                    b: {
                        "sessions": per.get(b, 0),
                        "budget_tokens": budgets.get(b),
                        "cap": class_session_cap(budgets[b], self.footprint_of(b))
                        if b in budgets else None,
                        "used_tokens": per.get(b, 0) * self.footprint_of(b),
                        "reason": self._budget_reason(b, snap, per.get(b, 0), weights[b][0], len(healthy),
                                                      budgets[b]) if b in budgets else None,
                    }
                    for b in demand
                },
            }
        return {
            "policy": self.name.value,
            "in_flight": dict(self.load.items()),
            "reference_footprint_tokens": k_ref,
            "classes": {
                b: {
                    "footprint_tokens": self.footprint_of(b),
                    "footprint_samples": self.footprint[b].count if b in self.footprint else 0,
                    "residency_s": self.residency_of(b),
                    "active_sessions": self.class_sessions.get(b, 0),
                    "held": self.held_per_class.get(b, 0),
                }
                for b in demand
            },
            "engines": engines,
        }
