"""Workload-aware KV-capacity allocation: split an engine's KV budget across classes.

``M_b = C * R_b / sum(R)`` with optional per-class share bounds, and the class
session caps ``K_b = max(1, floor(M_b / k_b))``. Pure functions of numbers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping


def allocate(
    capacity: float,
    weights: Mapping[str, float],
    min_share: Mapping[str, float] | None = None,
    max_share: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """Split ``capacity`` in proportion to ``weights``, honouring share bounds.

    Bounds are fractions of ``capacity``. A class pinned at a bound keeps it
    and the rest is shared among the others in proportion again, until no
    bound is violated (at most one pass per class). The result never sums
    above ``capacity``; a class with zero weight gets its minimum (else 0).
    Minimum shares are assumed to sum to at most 1 (checked by the config).
    """
    lo = {b: (min_share or {}).get(b) or 0.0 for b in weights}
    hi = {b: (max_share or {}).get(b) for b in weights}
    fixed: dict[str, float] = {}
    free = [b for b in weights]
    while True:
        remaining = capacity - sum(fixed.values())
        total_w = sum(weights[b] for b in free)
        alloc = {
            b: (remaining * weights[b] / total_w) if total_w > 0 else 0.0 for b in free
        }
        violated = False
        for b in list(free):
            bound_hi = hi[b]
            if bound_hi is not None and alloc[b] > bound_hi * capacity + 1e-9:
                fixed[b] = bound_hi * capacity
                free.remove(b)
                violated = True
            elif alloc[b] < lo[b] * capacity - 1e-9:
                fixed[b] = lo[b] * capacity
                free.remove(b)
                violated = True
        if not violated or not free:
            if not violated:
                fixed.update(alloc)
            break
    # Rounding guard: never hand out more than the capacity.
    total = sum(fixed.values())
    if total > capacity > 0:
        scale = capacity / total
        fixed = {b: v * scale for b, v in fixed.items()}
    return {b: fixed.get(b, 0.0) for b in weights}


CAP_ROUNDING_SLACK = 1e-9
"""Sessions a budget holds are rounded down, but a quotient this close below a whole number is
that number: a budget bounded at what n sessions need comes back from fractions of the capacity
as n * k_b less a rounding error, and must still hold n."""


def class_session_cap(budget_tokens: float, footprint_tokens: float) -> int:
    """``K_b = max(1, floor(M_b / k_b))``: at least one session of every class may run."""
    # A session holds at least one token; smaller estimates are noise.
    return max(1, math.floor(budget_tokens / max(footprint_tokens, 1.0) + CAP_ROUNDING_SLACK))
