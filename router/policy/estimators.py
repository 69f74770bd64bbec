"""Windowed estimators of per-class session footprint (k_b) and residency (T_b)."""

from __future__ import annotations

import math
from collections import deque


def percentile(sorted_values: list[float], pct: float) -> float:
    """Linear-interpolated percentile of an already sorted, non-empty list."""
    if len(sorted_values) == 1:
        return sorted_values[0]
    rank = (pct / 100.0) * (len(sorted_values) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(sorted_values) - 1)
    frac = rank - lo
    return sorted_values[lo] * (1.0 - frac) + sorted_values[hi] * frac


class WindowPercentile:
    """A percentile of the last ``window`` samples; recomputed only after new samples.

    Samples arrive on session completion (rare next to decisions), and the
    value is read on every decision, so the sort happens lazily on read.
    """

    __slots__ = ("_cached", "_dirty", "_samples", "min_samples", "pct")

    def __init__(self, window: int, pct: float, min_samples: int) -> None:
        self._samples: deque[float] = deque(maxlen=window)
        self.pct = pct
        self.min_samples = min_samples
        self._cached: float | None = None
        self._dirty = False

    def reconfigure(self, window: int, pct: float, min_samples: int) -> None:
        """New window, percentile or sample floor; the newest samples are kept."""
        if window != self._samples.maxlen:
            self._samples = deque(self._samples, maxlen=window)
        self.pct = pct
        self.min_samples = min_samples
        self._dirty = True

    def add(self, value: float) -> None:
        self._samples.append(float(value))
        self._dirty = True

    @property
    def count(self) -> int:
        return len(self._samples)

    @property
    def ready(self) -> bool:
        return len(self._samples) >= self.min_samples

    def value(self) -> float | None:
        """The percentile, or ``None`` until ``min_samples`` samples arrived."""
        if not self.ready:
            return None
        if self._dirty or self._cached is None:
            self._cached = percentile(sorted(self._samples), self.pct)
            self._dirty = False
        return self._cached
