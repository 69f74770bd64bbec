"""Means with confidence intervals over repeated runs (seeds, repeats).

Why here and so small: the benchmark and the demo report every ratio as a
mean with a 95% interval, and a cell whose interval straddles 1.0 reads as
parity. Repeats are few (3-10), so the interval is Student's t, not the
normal approximation (which is 30-60% too narrow at n = 3).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from enum import StrEnum

from pydantic import BaseModel, ConfigDict

T_975: tuple[float, ...] = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)
"""Two-sided 95% Student t quantiles for 1..30 degrees of freedom (beyond: 1.96)."""

Z_975: float = 1.96


class Interval(BaseModel):
    """A mean and its two-sided 95% interval; ``low == high == mean`` for one value."""

    model_config = ConfigDict(frozen=True)
    mean: float
    low: float
    high: float
    n: int

    def straddles(self, value: float) -> bool:
        """Whether ``value`` lies inside the interval (parity when ``value`` is 1.0 for a ratio)."""
        return self.low <= value <= self.high

    def describe(self, fmt: str = ".2f", suffix: str = "x") -> str:
        """``1.04x (0.98-1.10, n=3)``, or ``1.04x (one run)``."""
        if self.n < 2:
            return f"{self.mean:{fmt}}{suffix} (one run)"
        return f"{self.mean:{fmt}}{suffix} ({self.low:{fmt}}-{self.high:{fmt}}, n={self.n})"


def t_quantile(df: int) -> float:
    """The 97.5% quantile of Student's t with ``df`` degrees of freedom."""
    if df < 1:
        raise ValueError("at least one degree of freedom")
    return T_975[df - 1] if df <= len(T_975) else Z_975


def mean_interval(values: Sequence[float]) -> Interval:
    """Mean and 95% t interval of ``values`` (at least one)."""
    n = len(values)
    if n == 0:
        raise ValueError("no values")
    mean = sum(values) / n
    if n == 1:
        return Interval(mean=mean, low=mean, high=mean, n=1)
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    half = t_quantile(n - 1) * math.sqrt(var / n)
    return Interval(mean=mean, low=mean - half, high=mean + half, n=n)


class Verdict(StrEnum):
    """How a ratio's interval reads against 1.0."""

    WIN = "win"
    LOSS = "loss"
    PARITY = "parity"
    """The interval straddles 1.0: neither a win nor a loss."""
    ONE_RUN = "one run"
    """No interval (a single replicate): no verdict."""


def verdict(ratio: Interval) -> Verdict:
    """``parity`` when the 95% interval of a ratio straddles 1.0, else a win or a loss."""
    if ratio.n < 2:
        return Verdict.ONE_RUN
    if ratio.straddles(1.0):
        return Verdict.PARITY
    return Verdict.WIN if ratio.low > 1.0 else Verdict.LOSS


def paired_ratio(numerators: Mapping[int, float], denominators: Mapping[int, float]) -> Interval | None:
    """Mean and interval of per-replicate ratios ``num[k] / den[k]`` over the keys both have
    (seeds: the two runs of a ratio replay the same sessions). None without a common key."""
    keys = [k for k in numerators if k in denominators and denominators[k] > 0]
    if not keys:
        return None
    return mean_interval([numerators[k] / denominators[k] for k in keys])
