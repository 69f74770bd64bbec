"""The prefix-hit guard on new sessions, one per engine.

When too many sessions share an engine's KV, reusable prefixes are evicted
and the prefix-hit rate falls before throughput does. The guard compares the
engine's current hit rate ``h`` with a recent healthy level ``h*`` (a decaying
maximum, not a fixed threshold): ``G = max(0, h* - h)``. Only when ``G``
exceeds a tolerance for ``confirm_epochs`` consecutive samples is the
new-session factor cut, to at most ``1 - cut_gain * G / h*`` (floored); each
healthy sample restores it additively. A sample is one or more scrapes
adding up to at least ``min_queries_per_epoch`` looked-up prompt tokens, so a
quiet engine's noise never counts. Continuations are never gated by it.

With ``degradation_cost_tolerance`` a gap must also be worth something: the
prompt tokens it loses per second (``G`` times the sample's looked-up tokens
over its span of time) must exceed that share of the engine's prefill rate.
Why: the hit rate is a proxy for recomputation, and recomputation costs in
proportion to how many prompt tokens the engine sees. Where long decodes
dominate (few prompt tokens per second), a hit gap costs little time, and
cutting new sessions costs the batch size the decodes live on.
"""

from __future__ import annotations

from dataclasses import dataclass

from .settings import SessionAdmissionSettings
from .types import EngineSnapshot


@dataclass(slots=True)
class HitGuard:
    settings: SessionAdmissionSettings
    prefill_tokens_per_s: float
    """mu_w (``placement.prefill_tokens_per_s``): what a lost hit costs is measured against it."""
    factor: float = 1.0
    hit_rate: float | None = None
    healthy: float | None = None
    streak: int = 0
    cuts: int = 0
    _last_queries: float | None = None
    _last_hits: float = 0.0
    _acc_queries: float = 0.0
    _acc_hits: float = 0.0
    _acc_since: float = 0.0
    """Scrape time the accumulating sample starts from."""

    def observe(self, snap: EngineSnapshot) -> None:
        """Feed one scrape's cumulative counters."""
        q, h = snap.prefix_queries_total, snap.prefix_hits_total
        if self._last_queries is None:
            self._last_queries, self._last_hits = q, h
            self._acc_since = snap.scraped_at
            return
        if q < self._last_queries or h < self._last_hits:
            # An engine restart (counters went back): new baseline; what the sample holds so far
            # stays, and so does the time it started from.
            self._last_queries, self._last_hits = q, h
            return
        self._acc_queries += q - self._last_queries
        self._acc_hits += h - self._last_hits
        self._last_queries, self._last_hits = q, h
        if self._acc_queries < max(self.settings.min_queries_per_epoch, 1e-9):
            return
        sample = min(1.0, self._acc_hits / self._acc_queries)
        span = snap.scraped_at - self._acc_since
        # Two scrapes stamped alike give no rate: count the gap as costly (the paper's rule).
        queries_per_s = self._acc_queries / span if span > 0 else float("inf")
        self._acc_queries = self._acc_hits = 0.0
        self._acc_since = snap.scraped_at
        self._update(sample, queries_per_s)

    def _costly(self, gap: float, queries_per_s: float) -> bool:
        """Whether the prompt tokens a gap loses would take more than the tolerated share of prefill time."""
        tolerance = self.settings.degradation_cost_tolerance
        return tolerance <= 0 or gap * queries_per_s / self.prefill_tokens_per_s > tolerance

    def _update(self, sample: float, queries_per_s: float) -> None:
        s = self.settings
        self.hit_rate = (
            sample if self.hit_rate is None
            else s.hit_ewma_alpha * sample + (1.0 - s.hit_ewma_alpha) * self.hit_rate
        )
        self.healthy = (
            self.hit_rate if self.healthy is None
            else max(self.hit_rate, self.healthy * s.healthy_hit_decay)
        )
        gap = max(0.0, self.healthy - self.hit_rate)
        if gap > s.degradation_tolerance and self._costly(gap, queries_per_s):
            self.streak += 1
            if self.streak >= s.confirm_epochs and self.healthy > 0:
                target = 1.0 - s.cut_gain * gap / self.healthy
                cut = max(s.min_new_session_factor, min(self.factor, target))
                if cut < self.factor:
                    self.cuts += 1
                self.factor = cut
        else:
            self.streak = 0
            self.factor = min(1.0, self.factor + s.recovery_per_epoch)

    def reset(self, now: float) -> None:
        """Forget the healthy level (after a prefix-cache reset everything starts cold); the next
        sample counts from ``now``."""
        self.hit_rate = None
        self.healthy = None
        self.streak = 0
        self.factor = 1.0
        self._acc_queries = self._acc_hits = 0.0
        self._acc_since = now

    @property
    def degradation(self) -> float:
        if self.hit_rate is None or self.healthy is None:
            return 0.0
        return max(0.0, self.healthy - self.hit_rate)
