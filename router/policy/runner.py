"""Drives one policy: the HOLD ledger, session lifecycle and mixture accounting.

The runner is what the router service and the simulator both call. It keeps
three promises the policies rely on:

- held work is never dropped, relabelled or resampled: a held request leaves
  the ledger only by being placed or by its own caller cancelling it (client
  gone, deadline passed);
- within a class, held work is released in arrival order, and a new request
  of a class that has older held work queues behind it;
- continuations of a live session are decided at once (the policy admits
  them), never queued behind new sessions;
- a draining engine (about to be removed by a scale-down) gets no new
  session: a request is decided over the other engines, except a
  continuation of a session that lives on a draining engine, which sees all
  of them, so live sessions finish where their KV is (policies that keep
  sessions on their engine place it there).

Pure like the policies: no clock (``now`` is passed in), no I/O.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Set
from dataclasses import dataclass

from .base import Engines, Policy
from .mixture import MixtureTracker
from .settings import PolicySettings, WorkloadMix
from .types import Completion, Decision, Reason, RequestMeta


@dataclass(slots=True)
class HeldEntry:
    req: RequestMeta
    held_at: float
    reason: Reason
    continuation: bool = False
    """Its session was live when it was held (held by a pause or a concurrency limit)."""


@dataclass(slots=True)
class SessionRecord:
    workload_class: str
    multi_turn: bool
    started_at: float
    last_activity: float
    in_flight: int = 0
    engine_id: str | None = None
    samples: int = 1
    """Rollout units the session completes: the most samples of any of its requests."""


class PolicyRunner:
    """One policy plus the state every policy needs around it."""

    def __init__(self, policy: Policy, mix: WorkloadMix) -> None:
        self.policy = policy
        self.mix = mix
        self.mixture = MixtureTracker(mix.target)
        self.paused = False
        # Insertion-ordered: iteration order is arrival order.
        self._held: OrderedDict[str, HeldEntry] = OrderedDict()
        self._held_per_class: dict[str, int] = {}
        self._held_continuations = 0
        self.sessions: dict[str, SessionRecord] = {}
        self.sessions_ended_idle = 0
        self.imply_holds = True
        """Hold without deciding where ``Policy.hold_order`` implies it (speed only; tests turn it
        off to check the answers are the same)."""

    # ---- requests -------------------------------------------------------

    def is_continuation(self, req: RequestMeta) -> bool:
        """A later request of a live session, or of one this runner never saw start (turn > 0:
        it began before a router restart), which must not queue behind new sessions."""
        return req.session_id is not None and (req.session_key in self.sessions or req.turn > 0)

    def submit(
        self, req: RequestMeta, engines: Engines, now: float, draining: Set[str] = frozenset()
    ) -> Decision:
        """Decide a new request. A HOLD puts it in the ledger; a PLACE is applied at once.

        ``draining``: engine ids that take continuations only (see the module docstring).
        """
        if req.request_id in self._held:
            raise ValueError(f"request {req.request_id!r} is already held")
        continuation = self.is_continuation(req)
        if self.paused:
            decision = Decision.hold(Reason.HOLD_PAUSED)
        elif not continuation and (self._held_per_class.get(req.workload_class, 0) or self._behind_longer(req)):
            decision = Decision.hold(Reason.HOLD_QUEUED)
        else:
            decision = self.policy.decide(req, self._view(req, continuation, engines, draining), now)
        if decision.placed:
            assert decision.engine_id is not None
            self._apply_placement(req, decision.engine_id, now)
        else:
            self._held[req.request_id] = HeldEntry(req, now, decision.reason, continuation)
            self._held_continuations += continuation
            self._held_per_class[req.workload_class] = (
                self._held_per_class.get(req.workload_class, 0) + 1
            )
            self.policy.on_hold(req, now)
        return decision

    def release(
        self, engines: Engines, now: float, draining: Set[str] = frozenset()
    ) -> list[tuple[RequestMeta, Decision]]:
        """Re-evaluate held work (once per epoch, or when room appears).

        Returns the requests placed now, in order; each is already applied.
        A class whose oldest held request still does not fit stays blocked for
        this pass, so its order is kept, while other classes may proceed; a hold by
        the global request limit ends the pass (nothing after it could pass).
        """
        if self.paused or not self._held:
            return []
        released: list[tuple[RequestMeta, Decision]] = []
        blocked: set[str] = set()
        classes_held = len(self._held_per_class)
        for_new = _without(engines, draining)
        # The hold_order key of the first new session this pass held, with its reason: a later
        # new session at or above it is held without deciding (Policy.hold_order says why that is
        # the decision's own answer). A full fleet re-checks the head of every held class at
        # each finish, and on a large fleet those checks were most of a pass.
        held_at: tuple[int, float, Reason] | None = None
        # Iterate the ledger itself (no copy: it can be long); entries placed in this
        # pass are unheld at once for the policy's books and popped after the loop.
        for entry in self._release_order():
            req = entry.req
            if req.workload_class in blocked and not entry.continuation:
                if not self._held_continuations and len(blocked) >= classes_held:
                    break  # every class is blocked and nothing else can pass
                continue
            # A held new session whose session went live in this pass (another request of it
            # was placed) is a continuation now: decided, never implied.
            new_session = self.imply_holds and not entry.continuation and req.session_key not in self.sessions
            if new_session and held_at is not None:
                order = self.policy.hold_order(req)
                if order is not None and order[0] >= held_at[0] and order[1] >= held_at[1]:
                    entry.reason = held_at[2]
                    blocked.add(req.workload_class)
                    continue
            decision = self.policy.decide(
                req, engines if self._pinned_to(req, entry.continuation, draining) else for_new, now
            )
            if not decision.placed:
                entry.reason = decision.reason
                if decision.reason is Reason.HOLD_CONCURRENCY_LIMIT:
                    break  # a global limit: nothing after this entry passes in this pass either
                blocked.add(req.workload_class)
                if new_session and held_at is None:
                    # decide() changed nothing, so the key is the one it decided on.
                    first = self.policy.hold_order(req)
                    if first is not None:
                        held_at = (first[0], first[1], decision.reason)
                continue
            self.policy.on_unhold(req, now)
            assert decision.engine_id is not None
            self._apply_placement(req, decision.engine_id, now)
            released.append((req, decision))
        for req, _ in released:
            self._remove_held(req.request_id, now, notify=False)
        return released

    def _held_ranks(self) -> dict[str, float] | None:
        """Each held class's place in the release order (``Policy.release_rank``, lower first);
        None when the policy keeps arrival order."""
        ranks: dict[str, float] = {}
        for c in self._held_per_class:
            rank = self.policy.release_rank(c)
            if rank is None:
                return None
            ranks[c] = rank
        return ranks

    def _release_order(self) -> Iterable[HeldEntry]:
        """The ledger in the order ``release`` tries it: arrival order, or by class rank with
        continuations first and arrival order within a rank."""
        ranks = self._held_ranks()
        if ranks is None:
            return self._held.values()
        return sorted(self._held.values(), key=lambda e: (not e.continuation, ranks[e.req.workload_class]))

    def _behind_longer(self, req: RequestMeta) -> bool:
        """A new session must wait: a class ranked before its own has sessions held."""
        if not self._held_per_class:
            return False
        mine = self.policy.release_rank(req.workload_class)
        if mine is None:
            return False
        ranks = self._held_ranks()
        return ranks is not None and any(r < mine for r in ranks.values())

    def cancel(self, request_id: str, now: float) -> bool:
        """The caller gave up on a held request (client gone, deadline passed)."""
        return self._remove_held(request_id, now) is not None

    def finish(
        self, req: RequestMeta, engine_id: str, completion: Completion, now: float
    ) -> None:
        """A placed request ended (answered, failed, or aborted by its client)."""
        self.policy.on_finished(req, engine_id, completion, now)
        rec = self.sessions.get(req.session_key)
        if rec is None:
            return
        rec.in_flight = max(0, rec.in_flight - 1)
        rec.last_activity = now
        if not rec.multi_turn or (req.end_of_session and rec.in_flight == 0):
            self._end(req.session_key, now, completed=completion.ok)

    def end_session(self, session_key: str, now: float) -> bool:
        """Explicit end of a multi-turn session (``POST /v1/sessions/{id}/end``)."""
        rec = self.sessions.get(session_key)
        if rec is None:
            return False
        self._end(session_key, now, completed=True)
        return True

    # ---- periodic -------------------------------------------------------

    def on_metrics(self, engines: Engines, now: float) -> None:
        self.policy.on_metrics(engines, now)

    def flush_deferred(self) -> None:
        """The bookkeeping placements put off, now (``Policy.flush_deferred``)."""
        self.policy.flush_deferred()

    def epoch(
        self, engines: Engines, now: float, draining: Set[str] = frozenset()
    ) -> list[tuple[RequestMeta, Decision]]:
        """Housekeeping, idle-session expiry, then release of held work."""
        idle_s = self.policy.settings.admission.session_idle_timeout_s
        for key, rec in list(self.sessions.items()):
            if rec.multi_turn and rec.in_flight == 0 and now - rec.last_activity >= idle_s:
                self.sessions_ended_idle += 1
                self._end(key, now, completed=True)
        self.policy.on_epoch(now)
        return self.release(engines, now, draining)

    def remove_engine(self, engine_id: str, now: float) -> None:
        """An engine left the pool: sessions pinned to it are forgotten by the policy."""
        self.policy.on_engine_removed(engine_id, now)
        for rec in self.sessions.values():
            if rec.engine_id == engine_id:
                rec.engine_id = None

    def reset_prefix_caches(self, now: float) -> None:
        """The caller reset every engine's prefix cache (weight update)."""
        self.policy.on_prefix_cache_reset(now)

    def engine_restarted(self, engine_id: str, now: float) -> None:
        """One engine restarted (``EngineRegistry``): its prefix cache is empty; its sessions stay
        pinned to it (their next turns re-prefill wherever they go)."""
        self.policy.on_engine_restarted(engine_id, now)

    def apply_settings(
        self,
        settings: PolicySettings,
        mix: WorkloadMix,
        now: float,
        in_flight: Iterable[tuple[RequestMeta, str]] = (),
    ) -> bool:
        """New policy settings and mixture (hot reload), applied between decisions.

        Knob changes are taken in place, so footprint, residency and hit-rate
        history survive. A change of policy (or adding/removing the static
        concurrency limit) builds a new policy object and hands it the live
        state: held work, live sessions on their engines, and the requests in
        flight (``(request, engine_id)`` pairs, which only the caller knows).
        Returns True when the policy object was rebuilt.
        """
        old = self.policy.settings
        same_shape = (settings.concurrency_limit is None) == (old.concurrency_limit is None)
        if same_shape and self.policy.set_settings(settings):
            self.set_mix(mix)
            return False
        from .registry import build_policy  # the registry imports every policy; keep it off import paths

        policy = build_policy(settings, mix)
        for entry in self._held.values():
            policy.on_hold(entry.req, now)
        for key, rec in self.sessions.items():
            if rec.engine_id is not None:
                policy.adopt_session(key, rec.workload_class, rec.engine_id, rec.started_at, now)
        for req, engine_id in in_flight:
            policy.on_placed(req, engine_id, now)
        self.policy = policy
        self.set_mix(mix)
        return True

    def set_mix(self, mix: WorkloadMix) -> None:
        self.mix = mix
        self.policy.set_mix(mix)
        self.mixture.retarget(mix.target)

    # ---- views ----------------------------------------------------------

    def held(self) -> list[HeldEntry]:
        return list(self._held.values())

    def held_count(self, workload_class: str | None = None) -> int:
        if workload_class is None:
            return len(self._held)
        return self._held_per_class.get(workload_class, 0)

    def sessions_per_engine(self) -> dict[str, int]:
        """Live sessions pinned to each engine (what a draining engine still has to finish)."""
        out: dict[str, int] = {}
        for rec in self.sessions.values():
            if rec.engine_id is not None:
                out[rec.engine_id] = out.get(rec.engine_id, 0) + 1
        return out

    def last_active_per_engine(self, now: float) -> dict[str, float]:
        """Per engine with live sessions pinned to it: when one of them last had a request
        (``now`` while one is in flight)."""
        out: dict[str, float] = {}
        for rec in self.sessions.values():
            if rec.engine_id is not None:
                t = now if rec.in_flight else rec.last_activity
                if t > out.get(rec.engine_id, -math.inf):
                    out[rec.engine_id] = t
        return out

    def active_sessions(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for rec in self.sessions.values():
            out[rec.workload_class] = out.get(rec.workload_class, 0) + 1
        return out

    # ---- internals ------------------------------------------------------

    def _pinned_to(self, req: RequestMeta, continuation: bool, draining: Set[str]) -> bool:
        """A continuation of a session living on a draining engine (it may finish there)."""
        if not continuation or not draining:
            return False
        rec = self.sessions.get(req.session_key)
        return rec is not None and rec.engine_id in draining

    def _view(self, req: RequestMeta, continuation: bool, engines: Engines, draining: Set[str]) -> Engines:
        return engines if self._pinned_to(req, continuation, draining) else _without(engines, draining)

    def _apply_placement(self, req: RequestMeta, engine_id: str, now: float) -> None:
        rec = self.sessions.get(req.session_key)
        if rec is None:
            spec = self.mix.get(req.workload_class)
            multi = bool(spec and spec.multi_turn) and req.session_id is not None
            rec = SessionRecord(req.workload_class, multi, now, now)
            self.sessions[req.session_key] = rec
        rec.in_flight += 1
        rec.last_activity = now
        rec.engine_id = engine_id
        rec.samples = max(rec.samples, req.samples)
        self.policy.on_placed(req, engine_id, now)

    def _remove_held(self, request_id: str, now: float, *, notify: bool = True) -> HeldEntry | None:
        entry = self._held.pop(request_id, None)
        if entry is not None:
            self._held_continuations -= entry.continuation
            if notify:
                self.policy.on_unhold(entry.req, now)
            c = entry.req.workload_class
            self._held_per_class[c] -= 1
            if not self._held_per_class[c]:
                del self._held_per_class[c]
        return entry

    def _end(self, session_key: str, now: float, *, completed: bool) -> None:
        rec = self.sessions.pop(session_key, None)
        if rec is None:
            return
        self.policy.on_session_end(session_key, now)
        if completed:
            self.mixture.record(rec.workload_class, rec.samples)


def _without(engines: Engines, draining: Set[str]) -> Engines:
    """The engines a new session may go to (the mapping itself when nothing drains)."""
    if not draining or draining.isdisjoint(engines):
        return engines
    return {e: snap for e, snap in engines.items() if e not in draining}
