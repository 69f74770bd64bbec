"""Steady-state windows for cluster runs: when the warm-up ends, when a run has converged, and the
reference figures a row is read against (ideal prefix hit, the mixture's own sampling noise).

Why pure and apart from the runner: these rules decide which part of a run counts, so they are
the claim as much as the figures are. ``BenchCluster`` (``misat_bench.cluster_runs``) feeds them
what it observed; the unit tests feed them synthetic series.

The rules (docs/benchmark.md, "Steady-state windows"):

- **Warm-up** is measured in the run itself. Time is cut into windows of ``window_s``; at each
  window boundary ``t`` the warm-up is over when ``t >= warmup_floor_s`` and
  ``t - phase_s >= warmup_factor x`` the longest class's median residency, where a unit's
  residency is release to completion (time held by the router counts: it is what the trainer
  waits) and ``phase_s`` is when the workload's last phase change took effect (0 if none). The
  median is over the class's completed units *and* the ages of its units still in flight (lower
  bounds of their residency): completed units alone would favour the quick ones early in a run.
  Each class needs ``min_class_samples`` completions first.
- **Convergence**: over the last ``convergence_windows`` windows, split into an early and a late
  half, every class's completions in the two halves agree within ``convergence_tolerance`` of
  their mean, or within ``convergence_z`` standard deviations of counting noise (Poisson: the sd
  of a difference of two counts is ``sqrt(a + b)``), whichever is wider. A run measures at least
  ``measure_s`` after the warm-up and stops at the first converged window boundary; if it reaches
  ``max_duration_s`` first it stops there, flagged ``converged: false``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from misat_sim.workload import RolloutClass, SessionPlan


class SteadyStateSettings(BaseModel):
    """How a cluster run finds and checks its measured window (defaults: the full suite)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    window_s: float = Field(60.0, gt=0, description="virtual seconds per window: the unit of the time series, "
                            "of the convergence check and of the warm-up's granularity")
    warmup_factor: float = Field(5.0, ge=0, description="warm-up: at least this many times the longest class's "
                                 "median residency (the issue's 5x)")
    warmup_floor_s: float = Field(120.0, ge=0, description="warm-up never ends before this (the estimators and "
                                  "the prefix caches fill in the first minutes)")
    min_class_samples: int = Field(20, ge=1, description="completions a class needs before its median residency "
                                   "is trusted")
    measure_s: float = Field(360.0, gt=0, description="least measured time after the warm-up")
    convergence_windows: int = Field(4, ge=2, description="windows the convergence check looks back over (even)")
    convergence_tolerance: float = Field(0.10, ge=0, description="relative agreement of a class's completions in "
                                         "the early and late halves of those windows")
    convergence_z: float = Field(2.0, ge=0, description="or agreement within this many sd of counting noise")
    max_duration_s: float = Field(3600.0, gt=0, description="a run stops here whatever the checks say "
                                  "(then flagged, if they failed)")

    @model_validator(mode="after")
    def _consistent(self) -> SteadyStateSettings:
        if self.convergence_windows % 2:
            raise ValueError(f"convergence_windows must be even, got {self.convergence_windows}")
        if self.measure_s < self.convergence_windows * self.window_s:
            raise ValueError(f"measure_s {self.measure_s} is shorter than the convergence check's "
                             f"{self.convergence_windows} windows of {self.window_s} s")
        if self.max_duration_s < self.warmup_floor_s + self.measure_s:
            raise ValueError(f"max_duration_s {self.max_duration_s} leaves no room for warmup_floor_s + measure_s")
        return self

    @property
    def measure_windows(self) -> int:
        """Whole windows the measured time spans at least."""
        return math.ceil(self.measure_s / self.window_s)


def median_residency(completed: Sequence[float], in_flight_ages: Sequence[float], min_samples: int) -> float | None:
    """Median residency of one class: completed residencies plus in-flight ages (lower bounds).

    None until the class has ``min_samples`` completions.
    """
    if len(completed) < min_samples:
        return None
    return statistics.median([*completed, *in_flight_ages])


def warmup_over(now: float, phase_s: float | None, medians: Mapping[str, float | None],
                s: SteadyStateSettings) -> bool:
    """Whether the warm-up may end at ``now`` (a window boundary).

    ``phase_s`` is when the last phase change took effect, None while one is still ahead;
    ``medians`` maps every class with a positive target share to its median residency (None:
    not enough completions yet).
    """
    if phase_s is None or now < s.warmup_floor_s or not medians:
        return False
    if any(m is None for m in medians.values()):
        return False
    longest = max(m for m in medians.values() if m is not None)
    return now - phase_s >= s.warmup_factor * longest


def counts_agree(early: float, late: float, s: SteadyStateSettings) -> bool:
    """Whether two halves' completion counts of one class agree (tolerance or counting noise)."""
    allowed = max(s.convergence_tolerance * (early + late) / 2.0, s.convergence_z * math.sqrt(early + late))
    return abs(late - early) <= allowed


def measured_steady(converged: bool | None, warmup_ok: bool | None) -> bool:
    """Whether a run's measured window is steady state, from its record's two flags: neither
    check failed (None: a run measured whole, where neither applies)."""
    return converged is not False and warmup_ok is not False


def converged(windows: Sequence[Mapping[str, int]], classes: Sequence[str], s: SteadyStateSettings) -> bool:
    """Whether the last ``convergence_windows`` of ``windows`` (per-class completions) agree.

    False when there are fewer windows than that.
    """
    k = s.convergence_windows
    if len(windows) < k:
        return False
    last = windows[-k:]
    half = k // 2
    for c in classes:
        early = sum(w.get(c, 0) for w in last[:half])
        late = sum(w.get(c, 0) for w in last[half:])
        if not counts_agree(early, late, s):
            return False
    return True


def sampling_noise_tv(target: Mapping[str, float], n: int) -> float:
    """Expected TV distance (points) of ``n`` units drawn at random from ``target``: the floor a
    completed mixture is read against.

    Per class the completed share of a multinomial sample has sd ``sqrt(p (1 - p) / n)`` and, to
    the normal approximation, mean absolute deviation ``sqrt(2 p (1 - p) / (pi n))``.
    """
    if n <= 0:
        return 0.0
    total = sum(v for v in target.values() if v > 0)
    if total <= 0:
        return 0.0
    mad = sum(math.sqrt(2.0 * (p / total) * (1.0 - p / total) / (math.pi * n)) for p in target.values() if p > 0)
    return 50.0 * mad


def ideal_cached_tokens(prompt_tokens: int, computed_before: int, block_size: int) -> int:
    """Tokens of a prompt an infinite, perfectly placed prefix cache would serve.

    ``computed_before``: tokens of this prompt's prefix some earlier request computed (a GRPO
    sample after its group's first: the whole shared prompt; agentic turn ``t > 0``: the
    previous turn's prompt and output but its last token, whose KV is never computed; else 0).
    Only full blocks are cached, and the engine recomputes at least the prompt's last token
    (vLLM's cap at ``num_tokens - 1``), as ``misat_sim.kv_cache`` does.
    """
    if prompt_tokens <= 0 or computed_before <= 0:
        return 0
    usable = min(computed_before, prompt_tokens - 1)
    return (usable // block_size) * block_size


class IdealPrefixCache:
    """The ideal cache over a run's requests, in the order they finish: what each could have hit.

    A GRPO sample after the first of its group (the first to finish here) reuses the shared
    prompt; agentic turn ``t > 0`` reuses the previous turn's prompt and output (its prompt
    minus the tokens appended before it, minus the last output token); nothing else is shared
    (token ids are drawn per session). ``ideal_cached_tokens`` turns that into full blocks.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._groups: set[str] = set()

    def cached(self, plan: SessionPlan, turn: int, prompt_tokens: int) -> int:
        """Ideal cached tokens of ``plan``'s request ``turn`` with ``prompt_tokens`` tokens."""
        before = 0
        if plan.klass is RolloutClass.AGENTIC:
            if turn > 0:
                before = prompt_tokens - plan.turns[turn].append_len - 1
        elif plan.group_id is not None:
            if plan.group_id in self._groups:
                before = prompt_tokens
            self._groups.add(plan.group_id)
        return ideal_cached_tokens(prompt_tokens, before, self.block_size)
