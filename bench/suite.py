"""The benchmark suite as data: workloads, baselines and MISA-T modes, seeded alike.

Why a module of its own: the suite's definitions are the claim. Which
workloads, which baselines, at which ceilings, all derived from one
``BenchSettings`` by pure functions, so the unit tests can check that every
workload and baseline is present and that every policy sees the same seeded
sessions, without running anything.

Layers (``docs/benchmark.md``):

- cluster: ``misat_sim.cluster`` in virtual time; the baselines use this
  project's re-implementation of the vLLM Router's ``cache_aware`` policy
  (``router/policy/cache_aware.py``) and of its ``--max-concurrent-requests``
  (``PolicySettings.concurrency_limit``). Sweeps are cheap here.
- http: the same seeded workload through the real ``vllm-router`` binary and
  through this project's router service (``misat_bench.http_layer``).

The oracle sweep is adaptive: a coarse grid of trainer ceilings, then
midpoints around the best point (``refine_ceilings``), so the suite is built
in stages (``stage_runs``) and later stages read earlier results.
"""

from __future__ import annotations

import hashlib
import json
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from misat_router.policy.settings import (
    CacheAwareSettings,
    FootprintSettings,
    PolicyName,
    PolicySettings,
)
from misat_sim.cluster import ClusterConfig
from misat_sim.config import SimEngineConfig
from misat_sim.workload import (
    DEFAULT_MIXTURE_PERCENT,
    RolloutClass,
    WorkloadSpec,
    length_drift_spec,
    mix_shift_spec,
)

_FROZEN = ConfigDict(frozen=True, extra="forbid")

DEFAULT_PROFILE: str = "qwen30b-a3b-h100"
"""The issue's default engine: the 30B-A3B-like profile (docs/simulator.md)."""

DEFAULT_ENGINES: int = 4
"""The issue's default fleet: 4 engines (the paper's Qwen pool is 4 x TP4 H100)."""

CEILING_ROUNDING: int = 8
"""Refined ceilings are multiples of this (the reference model swept in steps of 8)."""

UNITS_PER_ENGINE_MINUTE: float = 50.0
"""Rough sample rate of one ``qwen30b-a3b-h100`` engine on the paper's mixture at scale
1/16 (measured: cache_aware at ceiling 96 on 4 engines, 203 units/min). Used only to
place phase changes (drift span, mix shift) inside a run whose length is given in
seconds while the phases are on the ``units`` axis; the phases' content does not
depend on it."""

DRIFT_SPAN_FRACTION: float = 0.5
"""Length drift grows outputs over this share of the units a run is expected to release,
then holds: the measured window sees growth and the grown plateau."""

DRIFT_GROWTH: float = 2.5
"""RLVR/RLHF outputs grow 1x -> 2.5x (the issue: 2x to 3x; ``length_drift_spec``'s default)."""

MIX_SHIFT_FRACTION: float = 0.4
"""The target mixture changes after this share of the expected units (after warm-up)."""

MIX_SHIFT_AGENTIC_BEFORE: float = 30.0
MIX_SHIFT_AGENTIC_AFTER: float = 70.0
"""Agentic share (percent) before and after the shift (the issue's example); RLVR and
RLHF keep the paper's 33.1 : 18.2 ratio in the remainder."""

KV_HALF: float = 0.5
KV_DOUBLE: float = 2.0
"""KV-change workloads: the engines' KV blocks times these (another model or GPU)."""

SMALL_FLEET_BALANCE: tuple[tuple[int, float], ...] = ((4, 1.2), (16, 1.2))
"""Candidate ``(balance_abs_threshold, balance_rel_threshold)`` pairs for a small fleet.
The defaults (64, 1.5) assume many engines and thousands of requests in flight: with 4
engines and a few hundred in flight the absolute gap rarely exceeds 64, so load
balancing almost never triggers. The best candidate on steady (at the oracle ceiling)
is reported on every workload."""


class WorkloadName(StrEnum):
    """The suite's workloads (the issue's list; kv-change is split in two)."""

    STEADY = "steady"
    LENGTH_DRIFT = "length-drift"
    MIX_SHIFT = "mix-shift"
    KV_HALF = "kv-half"
    KV_DOUBLE = "kv-double"
    ITERATIONS = "iterations"


class Baseline(StrEnum):
    """What a run stands for in the comparison."""

    SWEEP = "sweep"
    """cache_aware at one trainer ceiling of the oracle sweep."""
    ORACLE = "oracle"
    """The best sweep point of this workload (a label on a sweep run, never a run of its own)."""
    TUNED_ONCE = "tuned-once"
    """cache_aware at steady's oracle ceiling, unchanged on this workload."""
    REQUEST_LIMIT = "request-limit"
    """cache_aware with the router's own request limit, trainer ceiling high."""
    HIGH_LOAD = "high-load"
    """cache_aware at the ceiling MISA-T runs at."""
    BALANCE_SMALL = "balance-small"
    """cache_aware at the oracle ceiling with small-fleet balance thresholds."""
    MISA_T = "misa-t"
    MISA = "misa"
    SESSION_ADMISSION = "session-admission"
    FOOTPRINT = "footprint"
    """MISA-T with another footprint estimator (sensitivity)."""


BASELINES_VLLM: tuple[Baseline, ...] = (
    Baseline.ORACLE, Baseline.TUNED_ONCE, Baseline.REQUEST_LIMIT, Baseline.HIGH_LOAD, Baseline.BALANCE_SMALL,
)
"""The vLLM Router cache_aware baselines every workload reports."""

MISAT_MODES: tuple[Baseline, ...] = (Baseline.MISA_T, Baseline.MISA, Baseline.SESSION_ADMISSION)
"""This router's modes, all run at the high ceiling without per-workload tuning."""

_MODE_POLICY: dict[Baseline, PolicyName] = {
    Baseline.MISA_T: PolicyName.MISA_T,
    Baseline.MISA: PolicyName.MISA,
    Baseline.SESSION_ADMISSION: PolicyName.SESSION_ADMISSION,
}

FOOTPRINT_VARIANTS: tuple[tuple[str, float], ...] = (("peak", 90.0), ("mean", 50.0))
"""Footprint estimators tried besides the default (peak, p50): the reference model's
p90-of-peak underfill case and the time-average of a linearly growing session."""


class BenchSettings(BaseModel):
    """Everything that shapes a benchmark run (the ``misat bench`` flags)."""

    model_config = _FROZEN
    engines: int = Field(DEFAULT_ENGINES, ge=1)
    profile: str = DEFAULT_PROFILE
    seed: int = 0
    duration_s: float = Field(480.0, gt=0, description="virtual seconds per continuous run")
    warmup_s: float = Field(120.0, ge=0, description="virtual seconds excluded from rates")
    ceilings: tuple[int, ...] = Field(
        (96, 192, 256, 384, 512), min_length=1,
        description="coarse grid of trainer ceilings for the oracle sweep (the last is also high-load "
        "when equal to high_ceiling)",
    )
    other_ceilings: tuple[int, ...] | None = Field(
        (96, 192, 384, 512),
        description="grid for the workloads other than steady (None: ``ceilings``); coarser to save CPU",
    )
    refine_rounds: int = Field(0, ge=0, description="rounds of midpoints around the best sweep point")
    high_ceiling: int = Field(
        512, ge=1,
        description="the ceiling MISA-T and high-load run at: 2-2.7x steady's knee on 4 engines (1024 costs "
        "several times the CPU of a run below the knee, for the same conclusion)",
    )
    request_limits: tuple[int, ...] = Field(
        (64, 128, 256), min_length=1,
        description="router request limits swept on steady (trainer ceiling high)",
    )
    iterations: int = Field(4, ge=1, description="iterations workload: weight updates")
    iteration_units_per_engine: int = Field(96, ge=1, description="iterations workload: units per engine")
    workloads: tuple[WorkloadName, ...] = tuple(WorkloadName)
    footprint_sensitivity: bool = True
    balance_candidates: tuple[tuple[int, float], ...] = SMALL_FLEET_BALANCE

    @property
    def expected_units(self) -> float:
        """Units a continuous run is expected to release (places phase changes only)."""
        return UNITS_PER_ENGINE_MINUTE * self.engines * self.duration_s / 60.0

    def engine_config(self) -> SimEngineConfig:
        """The engines' config (each run builds fresh engines from it)."""
        return SimEngineConfig(profile=self.profile, seed=self.seed)


QUICK = BenchSettings(
    engines=2, duration_s=300.0, warmup_s=60.0, ceilings=(32, 64, 128, 512), other_ceilings=None, refine_rounds=0,
    high_ceiling=512, request_limits=(64, 128), iterations=2, iteration_units_per_engine=48,
    workloads=(WorkloadName.STEADY, WorkloadName.KV_HALF), footprint_sensitivity=False,
    balance_candidates=SMALL_FLEET_BALANCE[:1],
)
"""``--quick``: two engines, short runs, a coarse sweep on steady and kv-half."""


def _split_mixture(agentic: float) -> dict[RolloutClass, float]:
    """A mixture with ``agentic`` percent agentic, RLVR:RLHF kept at the paper's ratio."""
    rest = 100.0 - agentic
    rlvr, rlhf = DEFAULT_MIXTURE_PERCENT[RolloutClass.RLVR], DEFAULT_MIXTURE_PERCENT[RolloutClass.RLHF]
    return {
        RolloutClass.AGENTIC: agentic,
        RolloutClass.RLVR: rest * rlvr / (rlvr + rlhf),
        RolloutClass.RLHF: rest * rlhf / (rlvr + rlhf),
    }


class WorkloadCase(BaseModel):
    """One workload of the suite: the spec every policy replays, plus its engines and mode."""

    model_config = _FROZEN
    name: WorkloadName
    spec: WorkloadSpec
    kv_factor: float = 1.0
    iterations: int = 0
    iteration_units: int = 512
    description: str = ""


def workload_case(name: WorkloadName, s: BenchSettings) -> WorkloadCase:
    """The seeded workload ``name`` under settings ``s`` (same seed for every policy)."""
    seed = s.seed
    if name is WorkloadName.STEADY:
        return WorkloadCase(name=name, spec=WorkloadSpec(seed=seed), description="paper mixture, stationary")
    if name is WorkloadName.LENGTH_DRIFT:
        span = round(DRIFT_SPAN_FRACTION * s.expected_units)
        return WorkloadCase(
            name=name, spec=length_drift_spec(span=span, growth=DRIFT_GROWTH, seed=seed),
            description=f"RLVR/RLHF outputs 1x -> {DRIFT_GROWTH:g}x over the first {span} units",
        )
    if name is WorkloadName.MIX_SHIFT:
        at = round(MIX_SHIFT_FRACTION * s.expected_units)
        # mix_shift_spec's own ``mixture`` argument is the one after the shift.
        spec = WorkloadSpec(
            seed=seed, mixture=_split_mixture(MIX_SHIFT_AGENTIC_BEFORE),
            mixture_changes=mix_shift_spec(at, _split_mixture(MIX_SHIFT_AGENTIC_AFTER)).mixture_changes,
        )
        return WorkloadCase(
            name=name, spec=spec,
            description=f"agentic {MIX_SHIFT_AGENTIC_BEFORE:g}% -> {MIX_SHIFT_AGENTIC_AFTER:g}% at unit {at}",
        )
    if name is WorkloadName.KV_HALF:
        return WorkloadCase(name=name, spec=WorkloadSpec(seed=seed), kv_factor=KV_HALF,
                            description=f"steady on engines with {KV_HALF:g}x KV")
    if name is WorkloadName.KV_DOUBLE:
        return WorkloadCase(name=name, spec=WorkloadSpec(seed=seed), kv_factor=KV_DOUBLE,
                            description=f"steady on engines with {KV_DOUBLE:g}x KV")
    if name is WorkloadName.ITERATIONS:
        units = s.iteration_units_per_engine * s.engines
        return WorkloadCase(
            name=name, spec=WorkloadSpec(seed=seed), iterations=s.iterations, iteration_units=units,
            description=f"{s.iterations} iterations of {units} units, prefix caches reset between",
        )
    raise ValueError(f"unknown workload {name}")


class RunSpec(BaseModel):
    """One run of the cluster layer: a workload, a policy, a trainer ceiling."""

    model_config = _FROZEN
    workload: WorkloadName
    baseline: Baseline
    policy: PolicySettings
    ceiling: int = Field(ge=1)
    label: str

    @property
    def router(self) -> Literal["cache-aware", "misat"]:
        """Which side of the comparison the run is on."""
        return "cache-aware" if self.policy.name is PolicyName.CACHE_AWARE else "misat"

    def key(self, s: BenchSettings) -> str:
        """A digest of everything that determines the result (cache key)."""
        cfg = cluster_config(self, s)
        blob = json.dumps(cfg.model_dump(mode="json"), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cluster_config(run: RunSpec, s: BenchSettings) -> ClusterConfig:
    """The ``ClusterConfig`` of a run: fresh engines, the workload's seeded spec."""
    case = workload_case(run.workload, s)
    engine = s.engine_config()
    if case.kv_factor != 1.0:
        blocks = engine.resolve().num_gpu_blocks
        engine = engine.model_copy(update={"num_gpu_blocks": max(2, round(blocks * case.kv_factor))})
    return ClusterConfig(
        engines=s.engines, engine=engine, policy=run.policy, workload=case.spec, ceiling=run.ceiling,
        duration_s=s.duration_s, warmup_s=s.warmup_s, iterations=case.iterations,
        iteration_units=case.iteration_units,
    )


def cache_aware(limit: int | None = None, balance: tuple[int, float] | None = None) -> PolicySettings:
    """The vLLM Router baseline's settings (defaults unless a balance pair is given)."""
    ca = CacheAwareSettings() if balance is None else CacheAwareSettings(
        balance_abs_threshold=balance[0], balance_rel_threshold=balance[1])
    return PolicySettings(name=PolicyName.CACHE_AWARE, concurrency_limit=limit, cache_aware=ca)


def sweep_run(w: WorkloadName, ceiling: int) -> RunSpec:
    """One point of a workload's oracle sweep."""
    return RunSpec(workload=w, baseline=Baseline.SWEEP, policy=cache_aware(), ceiling=ceiling,
                   label=f"cache_aware @{ceiling}")


def refine_ceilings(points: dict[int, float], rounds_left: int = 1) -> list[int]:
    """Ceilings to add around the best sweep point: midpoints to its neighbours.

    ``points`` maps ceiling -> sample rate. Midpoints are rounded to
    ``CEILING_ROUNDING``; ones already swept (or equal to a neighbour) are
    skipped, so refinement stops by itself once the grid is as fine as that.
    """
    if rounds_left <= 0 or not points:
        return []
    grid = sorted(points)
    best = pick_oracle(points)
    i = grid.index(best)
    out: list[int] = []
    for j in (i - 1, i + 1):
        if 0 <= j < len(grid):
            mid = round((grid[j] + best) / 2 / CEILING_ROUNDING) * CEILING_ROUNDING
            if mid not in points and mid not in out and min(grid[j], best) < mid < max(grid[j], best):
                out.append(mid)
    return out


def pick_oracle(points: dict[int, float]) -> int:
    """The best ceiling of a sweep: highest sample rate; ties go to the lower ceiling."""
    if not points:
        raise ValueError("empty sweep")
    return max(sorted(points), key=lambda c: (points[c], -c))


def fixed_runs(s: BenchSettings) -> list[RunSpec]:
    """Runs that depend on no earlier result: coarse sweeps, high-load, MISA-T modes, steady request limits."""
    runs: list[RunSpec] = []
    for w in s.workloads:
        base = s.ceilings if w is WorkloadName.STEADY or s.other_ceilings is None else s.other_ceilings
        grid = sorted(set(base) | {s.high_ceiling})
        runs.extend(sweep_run(w, c) for c in grid)
        for mode in MISAT_MODES:
            runs.append(RunSpec(workload=w, baseline=mode, policy=PolicySettings(name=_MODE_POLICY[mode]),
                                ceiling=s.high_ceiling, label=f"{mode.value} @{s.high_ceiling}"))
    if WorkloadName.STEADY in s.workloads:
        for limit in s.request_limits:
            runs.append(RunSpec(workload=WorkloadName.STEADY, baseline=Baseline.REQUEST_LIMIT,
                                policy=cache_aware(limit=limit), ceiling=s.high_ceiling,
                                label=f"cache_aware limit {limit} @{s.high_ceiling}"))
        if s.footprint_sensitivity:
            for stat, pct in FOOTPRINT_VARIANTS:
                fp = FootprintSettings(statistic=stat, percentile=pct)
                runs.append(RunSpec(workload=WorkloadName.STEADY, baseline=Baseline.FOOTPRINT,
                                    policy=PolicySettings(name=PolicyName.MISA_T, footprint=fp),
                                    ceiling=s.high_ceiling, label=f"misa-t {stat} p{pct:g} @{s.high_ceiling}"))
    return runs


def run_priority(run: RunSpec) -> int:
    """Order of the fixed runs when CPU is short: steady first, then every workload's sweep and
    MISA-T, then the ablations (a partial suite is then still a full comparison)."""
    if run.workload is WorkloadName.STEADY:
        return 0
    return {Baseline.SWEEP: 1, Baseline.MISA_T: 1, Baseline.SESSION_ADMISSION: 2}.get(run.baseline, 3)


def tuned_runs(s: BenchSettings, oracle: dict[WorkloadName, int], steady_limit: int | None,
               steady_balance: tuple[int, float] | None) -> list[RunSpec]:
    """Runs that need steady's tuned values: tuned-once, request-limit and balance elsewhere."""
    runs: list[RunSpec] = []
    steady = oracle.get(WorkloadName.STEADY)
    for w in s.workloads:
        if steady is not None and w is not WorkloadName.STEADY:
            runs.append(RunSpec(workload=w, baseline=Baseline.TUNED_ONCE, policy=cache_aware(), ceiling=steady,
                                label=f"cache_aware @{steady} (tuned on steady)"))
        if steady_limit is not None and w is not WorkloadName.STEADY:
            runs.append(RunSpec(workload=w, baseline=Baseline.REQUEST_LIMIT, policy=cache_aware(limit=steady_limit),
                                ceiling=s.high_ceiling,
                                label=f"cache_aware limit {steady_limit} @{s.high_ceiling} (tuned on steady)"))
        if w in oracle:
            candidates = s.balance_candidates if w is WorkloadName.STEADY else (
                (steady_balance,) if steady_balance is not None else ())
            for bal in candidates:
                runs.append(RunSpec(workload=w, baseline=Baseline.BALANCE_SMALL, policy=cache_aware(balance=bal),
                                    ceiling=oracle[w],
                                    label=f"cache_aware @{oracle[w]} balance {bal[0]}/{bal[1]:g}"))
    return runs
