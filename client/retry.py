"""When to send a held request again, and after how long: pure decisions, no I/O, no clock.

The router holds a request it cannot place yet; past ``hold_deadline_s`` it answers
503 with ``error.code: "hold_deadline_exceeded"`` and ``Retry-After: hold_retry_after_s``
(``docs/router.md``). That answer means "the pool is full, come back later", so a rollout
worker sends the same request again after ``Retry-After``, a bounded number of times. Any
other error is the caller's to handle: a draining router's 503 (no code) is not retried,
since the router is going away.
"""

from __future__ import annotations

import datetime
import email.utils
import math
from dataclasses import dataclass

HOLD_STATUS = 503
HOLD_CODE = "hold_deadline_exceeded"
"""``error.code`` of the router's hold-deadline 503."""


@dataclass(frozen=True, slots=True)
class HoldRetry:
    """How a session retries a held request.

    - ``max_retries`` (default 3): further attempts after the first held answer; 0 never retries.
    - ``fallback_retry_after_s`` (default 5.0, the router's ``hold_retry_after_s`` default):
      the wait when the answer has no usable ``Retry-After``.
    - ``max_retry_after_s`` (default 60.0): the longest single wait honoured; a longer
      ``Retry-After`` is cut to it (the official ``openai`` client does not retry at all above 60 s).
    """

    max_retries: int = 3
    fallback_retry_after_s: float = 5.0
    max_retry_after_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if not 0 <= self.fallback_retry_after_s <= self.max_retry_after_s:
            raise ValueError("need 0 <= fallback_retry_after_s <= max_retry_after_s")

    def delay(self, retry_after: str | None, attempt: int, now: float) -> float | None:
        """Seconds to wait before attempt ``attempt + 1`` after a held answer to attempt ``attempt``
        (1-based), or None when the budget is spent. ``now`` (POSIX seconds) reads a date."""
        if attempt > self.max_retries:
            return None
        seconds = parse_retry_after(retry_after, now)
        if seconds is None:
            seconds = self.fallback_retry_after_s
        return min(seconds, self.max_retry_after_s)


NO_RETRY = HoldRetry(max_retries=0)
"""A policy that surfaces the first held answer as ``HeldTooLong``."""


def is_held(status: int, code: str | None) -> bool:
    """Whether an answer is the router's "held past the deadline, retry later"."""
    return status == HOLD_STATUS and code == HOLD_CODE


def parse_retry_after(value: str | None, now: float) -> float | None:
    """``Retry-After`` in seconds: delta-seconds or an HTTP-date (RFC 9110 10.2.3) counted from
    ``now`` (POSIX seconds); None when absent or unreadable."""
    if value is None:
        return None
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:  # "-0000": UTC by RFC 5322, not local time
            when = when.replace(tzinfo=datetime.UTC)
        seconds = when.timestamp() - now
    if not math.isfinite(seconds):
        return None
    return max(0.0, seconds)
