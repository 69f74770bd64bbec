"""Windowed estimators of per-class session footprint (k_b) and residency (T_b)."""

from __future__ import annotations

import bisect
import math
from collections import deque
from typing import Any


def percentile(sorted_values: list[float], pct: float) -> float:
    """Linear-interpolated percentile of an already sorted, non-empty list."""
    if len(sorted_values) == 1:
        return sorted_values[0]
    rank = (pct / 100.0) * (len(sorted_values) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(sorted_values) - 1)
    frac = rank - lo
    return sorted_values[lo] * (1.0 - frac) + sorted_values[hi] * frac


class _Window:
    """The last ``window`` samples of a windowed estimator, and how many it needs before it answers."""

    __slots__ = ("_samples", "min_samples")
    _samples: deque[Any]
    min_samples: int

    @property
    def count(self) -> int:
        return len(self._samples)

    @property
    def ready(self) -> bool:
        return len(self._samples) >= self.min_samples


class WindowPercentile(_Window):
    """A percentile of the last ``window`` samples, kept sorted as samples come and go.

    The value is read on every decision and samples arrive on every session end,
    which for single-turn classes (every GRPO sample) is as often as decisions: so
    the window is kept as a sorted list beside its arrival order (``bisect``: a
    C-level search and move per sample) rather than sorted on read.
    """

    __slots__ = ("_sorted", "_value", "pct")

    def __init__(self, window: int, pct: float, min_samples: int) -> None:
        self._samples: deque[float] = deque(maxlen=window)
        self._sorted: list[float] = []
        self.pct = pct
        self.min_samples = min_samples
        self._value: float | None = None

    def reconfigure(self, window: int, pct: float, min_samples: int) -> None:
        """New window, percentile or sample floor; the newest samples are kept."""
        if window != self._samples.maxlen:
            self._samples = deque(self._samples, maxlen=window)
            self._sorted = sorted(self._samples)
        self.pct = pct
        self.min_samples = min_samples
        self._update()

    def add(self, value: float) -> None:
        value = float(value)
        samples = self._samples
        if len(samples) == samples.maxlen:
            oldest = samples[0]
            del self._sorted[bisect.bisect_left(self._sorted, oldest)]
        samples.append(value)
        bisect.insort(self._sorted, value)
        self._update()

    def _update(self) -> None:
        """Recompute the value after a change (read far more often than changed)."""
        s = self._sorted
        self._value = percentile(s, self.pct) if len(s) >= self.min_samples and s else None

    def value(self) -> float | None:
        """The percentile, or ``None`` until ``min_samples`` samples arrived."""
        return self._value

    def samples(self) -> list[float]:
        """The remembered samples, oldest first."""
        return list(self._samples)


def censored_percentile(events: list[float], censored: list[float], pct: float) -> float | None:
    """Kaplan-Meier percentile of durations, some still running (right-censored).

    ``events`` are finished durations; ``censored`` are the ages of ones still
    running, each known only to exceed its age. The result is the smallest
    event time at which the estimated share still running falls to
    ``1 - pct / 100``, or ``None`` when it never does (too few have finished:
    the percentile lies beyond every observation). At equal times an event
    counts before a censored observation, the usual convention.
    """
    obs = sorted([(t, 0) for t in events] + [(c, 1) for c in censored])
    n = len(obs)
    target = 1.0 - pct / 100.0
    surviving = 1.0
    i = 0
    while i < n:
        t = obs[i][0]
        at_risk = n - i
        d = 0
        while i < n and obs[i] == (t, 0):
            d += 1
            i += 1
        if d:
            surviving *= 1.0 - d / at_risk
            if surviving <= target + 1e-12:
                return t
        while i < n and obs[i][0] == t:
            i += 1
    return None


class WindowRatio(_Window):
    """Sum of numerators over sum of denominators of the last ``window`` samples.

    A weighted mean with the denominators as weights: for KV occupancy, each
    session's KV token-seconds over its residency, so that a long session counts
    for as long as it stays, as it does in the engine's KV.
    """

    __slots__ = ("_den", "_num")

    def __init__(self, window: int, min_samples: int) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)
        self._num = 0.0
        self._den = 0.0
        self.min_samples = min_samples

    def reconfigure(self, window: int, min_samples: int) -> None:
        """New window or sample floor; the newest samples are kept."""
        if window != self._samples.maxlen:
            self._samples = deque(self._samples, maxlen=window)
            self._num = sum(n for n, _ in self._samples)
            self._den = sum(d for _, d in self._samples)
        self.min_samples = min_samples

    def add(self, numerator: float, denominator: float) -> None:
        samples = self._samples
        if len(samples) == samples.maxlen:
            old_n, old_d = samples[0]
            self._num -= old_n
            self._den -= old_d
        samples.append((float(numerator), float(denominator)))
        self._num += numerator
        self._den += denominator

    def value(self) -> float | None:
        """The ratio, or ``None`` until ``min_samples`` samples arrived (or all weights are 0)."""
        if len(self._samples) < self.min_samples or self._den <= 0:
            return None
        return self._num / self._den
