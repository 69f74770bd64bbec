"""What a trainer-emulator run measured: the paper's figures, always together.

Why a separate module: the accumulator is pure (every event carries its own
timestamp), so the trainer's async shell stays thin and the arithmetic behind
sample rate, hit rate and mixture fidelity is unit-tested without a server.
The report is a pydantic model: JSON for benchmark files, and the same model
serves live progress snapshots.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from typing import TypeVar

from pydantic import BaseModel, Field

from misat_sim.workload import RolloutClass

SECONDS_PER_MINUTE: float = 60.0
"""Sample and request rates are reported per minute, as the paper does."""

ERROR_DETAIL_CHARS: int = 300
"""Error examples are truncated: enough for an engine's error message, not a page."""


ClassKey = TypeVar("ClassKey", bound=str)
"""A class name: a plain ``str`` or a ``RolloutClass``."""


def tv_distance_points(target: Mapping[ClassKey, float], consumed: Mapping[ClassKey, float]) -> float:
    """Total-variation distance in percentage points: ``0.5 * sum |p - q| * 100``.

    Both arguments are shares (any positive scale); each is normalised first.
    """
    keys = set(target) | set(consumed)
    p_total = sum(target.values()) or 1.0
    q_total = sum(consumed.values()) or 1.0
    diff = sum(abs(target.get(k, 0.0) / p_total - consumed.get(k, 0.0) / q_total) for k in keys)
    return 0.5 * diff * 100.0


def mixture_constrained_rate(target: Mapping[ClassKey, float], completed: Mapping[ClassKey, float],
                             minutes: float) -> float | None:
    """Samples per minute a trainer filling batches at ``target`` gets: ``min_b completed_b / share_b``.

    A policy that completes too many of a cheap class inside the window gains
    nothing here: the batch waits for its scarcest class. ``target`` is any
    positive scale (normalised); classes with a zero share are ignored. None
    without a target or a positive window.
    """
    total = sum(v for v in target.values() if v > 0)
    if total <= 0 or minutes <= 0:
        return None
    return min(completed.get(k, 0.0) / (v / total) for k, v in target.items() if v > 0) / minutes


class Usage(BaseModel):
    """The token counts of one completed request (OpenAI ``usage``)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    """``usage.prompt_tokens_details.cached_tokens``; 0 when the engine omits it."""


class SeriesPoint(BaseModel):
    """Units completed in the bucket starting ``t_s`` seconds into the run."""

    t_s: float
    units: int


class ClassFigures(BaseModel):
    """Per-class counters."""

    units: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


class TrainerReport(BaseModel):
    """A run's figures; ``None`` where nothing has been measured yet."""

    elapsed_s: float
    units_released: int
    units_in_flight: int
    units_completed: int
    per_class: dict[RolloutClass, ClassFigures]
    sample_rate_per_min: float = Field(description="completed units per minute (headline)")
    requests: int
    requests_per_min: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    prefill_tokens_per_s: float = Field(description="prompt tokens per second, cached or not")
    uncached_prefill_tokens_per_s: float = Field(description="prompt tokens actually computed")
    decode_tokens_per_s: float
    prefix_hit_rate: float | None = Field(description="cached / prompt tokens, 0..1")
    target_mixture_pct: dict[RolloutClass, float] = Field(
        description="mean target over released units (phases averaged in)"
    )
    consumed_mixture_pct: dict[RolloutClass, float] = Field(description="of completed units")
    mixture_tv_points: float | None
    iterations: int
    iteration_times_s: list[float]
    mean_iteration_s: float | None
    retries: int = Field(description="503 + Retry-After answers that were retried")
    errors: int = Field(description="requests given up on; their unit is not completed")
    errors_by_kind: dict[str, int]
    error_examples: dict[str, str] = Field(description="first message seen per error kind")
    missing_token_ids: int = Field(description="responses without token_ids (synthetic used)")
    bucket_s: float
    throughput_series: list[SeriesPoint]


class RunStats:
    """Accumulates trainer events; ``report(now)`` turns them into a ``TrainerReport``."""

    def __init__(self, start: float, bucket_s: float = 1.0) -> None:
        if bucket_s <= 0:
            raise ValueError("bucket_s must be > 0")
        self.start = start
        self.bucket_s = bucket_s
        self.per_class = {k: ClassFigures() for k in RolloutClass}
        self.released = 0
        self.in_flight = 0
        self.target_sum: dict[RolloutClass, float] = dict.fromkeys(RolloutClass, 0.0)
        self.retries = 0
        self.errors: Counter[str] = Counter()
        self.error_examples: dict[str, str] = {}
        self.missing_token_ids = 0
        self.iteration_times: list[float] = []
        self.buckets: Counter[int] = Counter()

    def on_released(self, target: dict[RolloutClass, float]) -> None:
        """A unit entered flight while ``target`` (fractions) was the mixture."""
        self.released += 1
        self.in_flight += 1
        for k, share in target.items():
            self.target_sum[k] += share

    def on_request(self, klass: RolloutClass, usage: Usage) -> None:
        """A request completed with ``usage``."""
        fig = self.per_class[klass]
        fig.requests += 1
        fig.prompt_tokens += usage.prompt_tokens
        fig.cached_tokens += usage.cached_tokens
        fig.completion_tokens += usage.completion_tokens

    def on_unit_done(self, klass: RolloutClass, now: float, ok: bool = True) -> None:
        """A unit left flight; counted as completed only when ``ok``."""
        self.in_flight -= 1
        if ok:
            self.per_class[klass].units += 1
            self.buckets[math.floor((now - self.start) / self.bucket_s)] += 1

    def on_retry(self) -> None:
        """A 503 was answered by waiting and retrying."""
        self.retries += 1

    def on_error(self, kind: str, detail: str = "") -> None:
        """A request was given up on (``kind``: e.g. ``http_500``); keeps the first detail."""
        self.errors[kind] += 1
        self.error_examples.setdefault(kind, detail[:ERROR_DETAIL_CHARS])

    def on_missing_token_ids(self) -> None:
        """A response carried no output token ids."""
        self.missing_token_ids += 1

    def on_iteration(self, seconds: float) -> None:
        """An iteration (batch plus weight-update hooks) took ``seconds``."""
        self.iteration_times.append(seconds)

    def report(self, now: float) -> TrainerReport:
        """Figures as of ``now`` (same clock as ``start``)."""
        elapsed = max(now - self.start, 0.0)
        per_s = 1.0 / elapsed if elapsed > 0 else 0.0
        figs = self.per_class.values()
        units = sum(f.units for f in figs)
        requests = sum(f.requests for f in figs)
        prompt = sum(f.prompt_tokens for f in figs)
        cached = sum(f.cached_tokens for f in figs)
        completion = sum(f.completion_tokens for f in figs)
        target = {k: 100.0 * v / self.released for k, v in self.target_sum.items()} if (
            self.released
        ) else {}
        consumed = {k: 100.0 * f.units / units for k, f in self.per_class.items()} if units else {}
        last_bucket = math.floor(elapsed / self.bucket_s)
        series = [
            SeriesPoint(t_s=b * self.bucket_s, units=self.buckets.get(b, 0))
            for b in range(last_bucket + 1)
        ]
        iters = self.iteration_times
        return TrainerReport(
            elapsed_s=elapsed,
            units_released=self.released,
            units_in_flight=self.in_flight,
            units_completed=units,
            per_class={k: f.model_copy() for k, f in self.per_class.items()},
            sample_rate_per_min=units * per_s * SECONDS_PER_MINUTE,
            requests=requests,
            requests_per_min=requests * per_s * SECONDS_PER_MINUTE,
            prompt_tokens=prompt,
            cached_tokens=cached,
            completion_tokens=completion,
            prefill_tokens_per_s=prompt * per_s,
            uncached_prefill_tokens_per_s=(prompt - cached) * per_s,
            decode_tokens_per_s=completion * per_s,
            prefix_hit_rate=cached / prompt if prompt else None,
            target_mixture_pct=target,
            consumed_mixture_pct=consumed,
            mixture_tv_points=tv_distance_points(target, consumed) if target and consumed
            else None,
            iterations=len(iters),
            iteration_times_s=list(iters),
            mean_iteration_s=sum(iters) / len(iters) if iters else None,
            retries=self.retries,
            errors=sum(self.errors.values()),
            errors_by_kind=dict(self.errors),
            error_examples=dict(self.error_examples),
            missing_token_ids=self.missing_token_ids,
            bucket_s=self.bucket_s,
            throughput_series=series,
        )
