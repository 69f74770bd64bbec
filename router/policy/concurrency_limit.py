"""The vLLM Router's static global ``--max-concurrent-requests``, around any policy.

Algorithm: if the requests in flight through the router (the inner policy's
``load.total``) are at or above ``limit``, hold with
``Reason.HOLD_CONCURRENCY_LIMIT``; otherwise return the inner policy's
decision unchanged. The queue is ``PolicyRunner``'s ledger, which releases
held work in arrival order as requests finish, so this wrapper keeps no state
of its own and every hook goes straight to the inner policy.

Knobs: ``limit`` (>= 1 requests; ``PolicySettings.concurrency_limit``), the
static ceiling the MISA-T paper swept for the baseline.
"""

from __future__ import annotations

from .base import Engines, LoadBook, Policy
from .settings import PolicyName, PolicySettings, WorkloadMix
from .types import Completion, Decision, Reason, RequestMeta


class ConcurrencyLimited(Policy):
    """Holds every request while ``limit`` are in flight; otherwise defers to ``inner``."""

    def __init__(self, inner: Policy, limit: int) -> None:
        # No super().__init__: settings, mix and load are the inner policy's own.
        if limit < 1:
            raise ValueError(f"concurrency limit must be at least 1, got {limit}")
        self.inner = inner
        self.limit = limit

    @property
    def name(self) -> PolicyName:  # type: ignore[override]
        return self.inner.name

    @property
    def settings(self) -> PolicySettings:  # type: ignore[override]
        return self.inner.settings

    @property
    def mix(self) -> WorkloadMix:  # type: ignore[override]
        return self.inner.mix

    @property
    def load(self) -> LoadBook:  # type: ignore[override]
        return self.inner.load

    def decide(self, req: RequestMeta, engines: Engines, now: float) -> Decision:
        if self.inner.load.total >= self.limit:
            return Decision.hold(Reason.HOLD_CONCURRENCY_LIMIT)
        return self.inner.decide(req, engines, now)

    def on_placed(self, req: RequestMeta, engine_id: str, now: float) -> None:
        self.inner.on_placed(req, engine_id, now)

    def release_rank(self, workload_class: str) -> float | None:
        return self.inner.release_rank(workload_class)

    def on_finished(
        self, req: RequestMeta, engine_id: str, completion: Completion, now: float
    ) -> None:
        self.inner.on_finished(req, engine_id, completion, now)

    def on_session_end(self, session_key: str, now: float) -> None:
        self.inner.on_session_end(session_key, now)

    def on_hold(self, req: RequestMeta, now: float) -> None:
        self.inner.on_hold(req, now)

    def on_unhold(self, req: RequestMeta, now: float) -> None:
        self.inner.on_unhold(req, now)

    def on_prefix_cache_reset(self, now: float) -> None:
        self.inner.on_prefix_cache_reset(now)

    def on_engine_restarted(self, engine_id: str, now: float) -> None:
        self.inner.on_engine_restarted(engine_id, now)

    def set_mix(self, mix: WorkloadMix) -> None:
        self.inner.set_mix(mix)

    def set_settings(self, settings: PolicySettings) -> bool:
        if settings.concurrency_limit is None or not self.inner.set_settings(settings):
            return False
        self.limit = settings.concurrency_limit
        return True

    def adopt_session(
        self, session_key: str, workload_class: str, engine_id: str, admitted_at: float, now: float
    ) -> None:
        self.inner.adopt_session(session_key, workload_class, engine_id, admitted_at, now)

    def on_metrics(self, engines: Engines, now: float) -> None:
        self.inner.on_metrics(engines, now)

    def on_epoch(self, now: float) -> None:
        self.inner.on_epoch(now)

    def flush_deferred(self) -> None:
        self.inner.flush_deferred()

    def on_engine_removed(self, engine_id: str, now: float) -> None:
        self.inner.on_engine_removed(engine_id, now)

    def describe(self) -> dict[str, object]:
        out = self.inner.describe()
        out["concurrency_limit"] = self.limit
        return out
