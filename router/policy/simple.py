"""Two load-only baselines: round-robin and least-loaded.

``RoundRobinPolicy``: cycles over the healthy engines in sorted-id order. The
cursor is the engine placed last; ``decide`` picks the first healthy id after
it (wrapping), and only ``on_placed`` moves the cursor, so ``decide`` is pure
and engines joining, leaving or failing never skip or repeat a turn for the
others.

``LeastLoadedPolicy``: the healthy engine with the fewest requests the router
has in flight on it (its own count, no engine metrics); ties go to the lowest
engine id.

Knobs: none. Both hold with ``Reason.HOLD_NO_ENGINE`` when no engine is healthy.
"""

from __future__ import annotations

from bisect import bisect_right

from .base import Engines, Policy, healthy_ids
from .settings import PolicyName, PolicySettings, WorkloadMix
from .types import Decision, Reason, RequestMeta


class RoundRobinPolicy(Policy):
    """Each healthy engine in turn, in sorted-id order."""

    name = PolicyName.ROUND_ROBIN

    def __init__(self, settings: PolicySettings, mix: WorkloadMix) -> None:
        super().__init__(settings, mix)
        self._last: str | None = None

    def decide(self, req: RequestMeta, engines: Engines, now: float) -> Decision:
        healthy = healthy_ids(engines)
        if not healthy:
            return Decision.hold(Reason.HOLD_NO_ENGINE)
        if self._last is None:
            return Decision.place(healthy[0], Reason.ROUND_ROBIN)
        i = bisect_right(healthy, self._last)
        return Decision.place(healthy[i % len(healthy)], Reason.ROUND_ROBIN)

    def on_placed(self, req: RequestMeta, engine_id: str, now: float) -> None:
        super().on_placed(req, engine_id, now)
        self._last = engine_id


class LeastLoadedPolicy(Policy):
    """Fewest router in-flight requests; ties by engine id."""

    name = PolicyName.LEAST_LOADED

    def decide(self, req: RequestMeta, engines: Engines, now: float) -> Decision:
        healthy = healthy_ids(engines)
        if not healthy:
            return Decision.hold(Reason.HOLD_NO_ENGINE)
        loads = {e: float(self.load.get(e)) for e in healthy}
        best = min(healthy, key=lambda e: (loads[e], e))
        return Decision.place(best, Reason.LEAST_LOADED, loads)
