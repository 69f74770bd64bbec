"""The benchmark suite as data: cells, seeds, baselines and the policies under test.

Why a module of its own: the suite's definitions are the claim. Which mixtures,
which workloads, which baselines at which ceilings, all derived from one
``BenchSettings`` by pure functions, so the unit tests can check that every
class spans the mixture family, that every policy of a cell replays the same
seeded sessions, and which runs ``--quick`` would make, without running anything.

A **cell** is (workload, target mixture, engines); **seeds** are its replicates
(the workload's seed and the engines' seed alike). Every run of a cell and seed
replays the same sessions whatever the policy. The suite is built in stages
(``plan_suite``): later runs depend on earlier results (the oracle's refinement,
the values tuned on steady), so the planner is called again with what is known
until it asks for nothing new.

Layers (``docs/benchmark.md``): this module plans the cluster layer
(``misat_sim.cluster``, virtual time); ``misat_bench.http_layer`` reuses
``BenchSettings`` and ``RunSpec`` for its agreement check.
"""

from __future__ import annotations

import hashlib
import json
import re
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, model_validator

from misat_bench.steady_state import SteadyStateSettings
from misat_router.policy.settings import (
    CacheAwareSettings,
    FootprintSettings,
    PolicyName,
    PolicySettings,
    ResidencySettings,
    SessionAdmissionSettings,
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

LARGE_FLEET_ENGINES: tuple[int, ...] = (16,)
"""The issue's second fleet size for steady cells."""

DEFAULT_SEEDS: tuple[int, ...] = (0, 1, 2)
"""Replicates per cell (the issue: at least 3)."""

CEILING_ROUNDING: int = 8
"""Refined ceilings are multiples of this (the issue: steps of 8 around the best point)."""

PAPER_MIXTURE: str = "paper"
"""Name of the paper's mixture in ``MIXTURE_FAMILY``."""

BENCH_BLOCK_SIZE: int = 64
"""Simulated KV block of the benchmark's cluster runs, 4x the engines' 16: per-block work is
most of the simulator's cost, and at 64 a run takes 0.45x the CPU. What it moves, measured
on the same runs at 16 and 64 (4 engines, the paper's mixture, 1,500 s, seeds 0 and 1,
docs/simulator.md "Block granularity"): mixture-constrained rates by -0.05% to -2.7%, the
ratios the benchmark reports (a row over tuned cache_aware) by at most 1.1 points for MISA and
MISA-T and 2.0 for high-load's collapse, prefix hits by -0.5 to -2.2 points."""

MIXTURE_FAMILY: dict[str, dict[RolloutClass, float]] = {
    PAPER_MIXTURE: dict(DEFAULT_MIXTURE_PERCENT),
    "agentic70": {RolloutClass.AGENTIC: 70.0, RolloutClass.RLVR: 20.0, RolloutClass.RLHF: 10.0},
    "rlvr70": {RolloutClass.AGENTIC: 10.0, RolloutClass.RLVR: 70.0, RolloutClass.RLHF: 20.0},
    "rlhf70": {RolloutClass.AGENTIC: 20.0, RolloutClass.RLVR: 10.0, RolloutClass.RLHF: 70.0},
    "agentic10": {RolloutClass.AGENTIC: 10.0, RolloutClass.RLVR: 45.0, RolloutClass.RLHF: 45.0},
    "rlvr10": {RolloutClass.AGENTIC: 45.0, RolloutClass.RLVR: 10.0, RolloutClass.RLHF: 45.0},
    "rlhf10": {RolloutClass.AGENTIC: 45.0, RolloutClass.RLVR: 45.0, RolloutClass.RLHF: 10.0},
}
"""Target mixtures (percent) of the steady cells, fixed in code before any v2 result was seen
(2026-12-01): the paper's, the three corners where one class is 70% (the other two 20/10,
rotated so each class is the 10% once), and the three edges where one class is 10% and the
other two share the rest evenly. Every class's share spans 10%..70% across the family."""

MIX_SHIFT_AGENTIC_AFTER: float = 70.0
"""mix-shift: the agentic share (percent) after the shift."""


def _agentic_share(agentic: float) -> dict[RolloutClass, float]:
    """``agentic`` percent agentic, RLVR:RLHF kept at the paper's ratio."""
    rlvr, rlhf = DEFAULT_MIXTURE_PERCENT[RolloutClass.RLVR], DEFAULT_MIXTURE_PERCENT[RolloutClass.RLHF]
    rest = 100.0 - agentic
    return {RolloutClass.AGENTIC: agentic, RolloutClass.RLVR: rest * rlvr / (rlvr + rlhf),
            RolloutClass.RLHF: rest * rlhf / (rlvr + rlhf)}


MIX_SHIFT_AFTER: dict[RolloutClass, float] = _agentic_share(MIX_SHIFT_AGENTIC_AFTER)
"""mix-shift: the cell's mixture until the shift, then agentic 70% (RLVR:RLHF at the paper's
33.1 : 18.2), the issue's example of a trainer turning agentic-heavy."""

DRIFT_GROWTH: float = 2.5
"""length-drift: RLVR/RLHF outputs grow 1x -> 2.5x (the issue: 2x to 3x; ``length_drift_spec``'s default)."""

KV_HALF: float = 0.5
KV_DOUBLE: float = 2.0
"""KV-change cells: the engines' KV blocks times these (another model or GPU)."""

SMALL_FLEET_BALANCE: tuple[tuple[int, float], ...] = ((4, 1.2), (16, 1.2))
"""Candidate ``(balance_abs_threshold, balance_rel_threshold)`` pairs for a small fleet.
The defaults (64, 1.5) assume many engines and thousands of requests in flight: with 4
engines and a few hundred in flight the absolute gap rarely exceeds 64, so load
balancing almost never triggers. The best candidate on steady@paper (at its oracle
ceiling, mean over seeds) is run on every other cell."""

DEFAULT_POLICY: str = "default"
"""The variant the goals are about: the untuned ``PolicySettings()``."""

SHORT_MEMORY_GUARD = SessionAdmissionSettings(healthy_hit_decay=0.98, degradation_cost_tolerance=0.0)
"""The hit guard as it was the default until 2026-12-04: h* forgets 2% a sample and every gap over
the tolerance counts. The variants that ran with it keep it, so that their published rows reproduce
after the default moved on (docs/policy.md, "The long memory with the cost check")."""

PEAK_P25 = FootprintSettings(statistic="peak", percentile=25.0)
"""k_b as the p25 of recent sessions' peak KV: the default footprint until 2026-12-05. The variants
that ran with it keep it, so that their published rows reproduce (docs/policy.md, "Caps sized by
KV occupancy")."""

OCCUPANCY = FootprintSettings(statistic="occupancy")
"""k_b as the KV a live session holds on average: the default footprint since 2026-12-05, spelled out
so that the variants that chose it keep it whatever the default becomes."""

POLICY_VARIANTS: dict[str, PolicySettings] = {
    DEFAULT_POLICY: PolicySettings(),
    # Each mode with today's defaults: what a RolloutPool's `policy:` runs.
    "misa-t": PolicySettings(name=PolicyName.MISA_T),
    "misa": PolicySettings(name=PolicyName.MISA),
    "session-admission": PolicySettings(name=PolicyName.SESSION_ADMISSION),
    # The default until 2026-12-05 (the p25 peak footprint, the long-memory guard with the cost
    # check), and what `policy: misa-t` ran until then.
    "session-admission-peak": PolicySettings(name=PolicyName.SESSION_ADMISSION, footprint=PEAK_P25),
    "misa-t-peak": PolicySettings(name=PolicyName.MISA_T, footprint=PEAK_P25),
    # The paper's policy and MISA with the guard they ran under on the matrix before the default changed.
    "misa-t-short-memory": PolicySettings(name=PolicyName.MISA_T, footprint=PEAK_P25, admission=SHORT_MEMORY_GUARD),
    "misa-short-memory": PolicySettings(name=PolicyName.MISA, footprint=PEAK_P25, admission=SHORT_MEMORY_GUARD),
    "misa-t-cost-check": PolicySettings(
        name=PolicyName.MISA_T, footprint=PEAK_P25,
        admission=SHORT_MEMORY_GUARD.model_copy(update={"degradation_cost_tolerance": 0.05})),
    # Each of the next five is one change to the default as it was when it ran, on that guard.
    "misa-t-censored": PolicySettings(name=PolicyName.MISA_T, residency=ResidencySettings(censored=True),
                                      footprint=PEAK_P25, admission=SHORT_MEMORY_GUARD),
    "misa-t-sqrt": PolicySettings(name=PolicyName.MISA_T, residency=ResidencySettings(exponent=0.5),
                                  footprint=PEAK_P25, admission=SHORT_MEMORY_GUARD),
    "misa-t-target": PolicySettings(name=PolicyName.MISA_T, budget_basis="target", footprint=PEAK_P25,
                                    admission=SHORT_MEMORY_GUARD),
    "footprint-peak-p90": PolicySettings(footprint=FootprintSettings(statistic="peak", percentile=90.0),
                                         admission=SHORT_MEMORY_GUARD),
    "footprint-mean-p50": PolicySettings(footprint=FootprintSettings(statistic="mean", percentile=50.0),
                                         admission=SHORT_MEMORY_GUARD),
    # The next three are one change each to the default as it was before the hit guard's cost check,
    # and keep that form (the short-memory guard) so that their published rows reproduce.
    "session-admission-occupancy": PolicySettings(
        name=PolicyName.SESSION_ADMISSION, footprint=OCCUPANCY,
        admission=SHORT_MEMORY_GUARD),
    "session-admission-longest-first": PolicySettings(
        name=PolicyName.SESSION_ADMISSION, footprint=PEAK_P25,
        admission=SHORT_MEMORY_GUARD.model_copy(update={"release_order": "longest-first"})),
    # The hit guard with a long memory: h* decays 1.2% a minute instead of 2% a sample, so a hit
    # rate that sinks slowly as sessions pile up still reads as degraded (docs/policy.md).
    "session-admission-hit-memory": PolicySettings(
        name=PolicyName.SESSION_ADMISSION, footprint=PEAK_P25,
        admission=SessionAdmissionSettings(healthy_hit_decay=0.9999, degradation_cost_tolerance=0.0)),
    # The default until 2026-12-04 (the short-memory guard, no cost check), and with the cost check
    # alone, as it was the default on 2026-12-03 (docs/policy.md, "The hit guard's cost check").
    "session-admission-no-cost-check": PolicySettings(
        name=PolicyName.SESSION_ADMISSION, footprint=PEAK_P25, admission=SHORT_MEMORY_GUARD),
    "session-admission-cost-check": PolicySettings(
        name=PolicyName.SESSION_ADMISSION, footprint=PEAK_P25,
        admission=SHORT_MEMORY_GUARD.model_copy(update={"degradation_cost_tolerance": 0.05})),
    # The guard's long memory (which kept hits and lost rate where decodes dominate) with the cost
    # check (which lets gaps pass where few prompt tokens are looked up): the default from
    # 2026-12-04 to 2026-12-05, named as it was while it was the candidate.
    "session-admission-hit-memory-cost-check": PolicySettings(
        name=PolicyName.SESSION_ADMISSION, footprint=PEAK_P25,
        admission=SessionAdmissionSettings(healthy_hit_decay=0.9999, degradation_cost_tolerance=0.05)),
    "misa-t-hit-memory-cost-check": PolicySettings(
        name=PolicyName.MISA_T, footprint=PEAK_P25,
        admission=SessionAdmissionSettings(healthy_hit_decay=0.9999, degradation_cost_tolerance=0.05)),
    # Caps sized by what a live session holds on average (Little's law) rather than by the p25 peak,
    # with the long-memory guard and the cost check: the peak's shape changes when outputs grow to
    # the context limit (length drift), the time average does not, and the long-memory guard is what
    # protects the cache that this statistic lost under the short-memory guard. The first is the
    # default since 2026-12-05, named as it was while it was the candidate; the KV budget either side
    # of 0.9 sets how much of the KV the live sessions may hold on average.
    "occupancy": PolicySettings(footprint=OCCUPANCY),
    "occupancy-budget-0.8": PolicySettings(footprint=OCCUPANCY, kv_budget_fraction=0.8),
    "occupancy-budget-0.7": PolicySettings(footprint=OCCUPANCY, kv_budget_fraction=0.7),
    # The same sweep continued above the default (2026-12-05: the mean and the worst cell were still
    # rising at 0.9): the caps then leave less or none of the KV for growth between scrapes, and the
    # hit guard is what stops over-admission.
    "occupancy-budget-0.95": PolicySettings(footprint=OCCUPANCY, kv_budget_fraction=0.95),
    "occupancy-budget-1.0": PolicySettings(footprint=OCCUPANCY, kv_budget_fraction=1.0),
    "misa-t-occupancy": PolicySettings(name=PolicyName.MISA_T, footprint=OCCUPANCY),
}
"""Policies under test by name, each run at the high ceiling with no per-cell tuning. Add a
variant here (a T-shape, a footprint estimator) and name it in ``--policies``; a variant equal
to another (``default`` and ``misa-t`` while MISA-T is the default) runs once (same digest)."""

DEFAULT_POLICIES: tuple[str, ...] = (DEFAULT_POLICY, "misa-t-sqrt", "misa", "session-admission")
"""The variants the full suite runs."""


def default_variant(names: Iterable[str]) -> str | None:
    """The name under which ``names`` runs the default policy: ``default`` itself, else a variant
    with the same settings (``misa-t`` while MISA-T is the default); None when none does."""
    listed = list(names)
    if DEFAULT_POLICY in listed:
        return DEFAULT_POLICY
    return next((n for n in listed if POLICY_VARIANTS.get(n) == POLICY_VARIANTS[DEFAULT_POLICY]), None)


class WorkloadName(StrEnum):
    """The suite's workloads (the issue's list; kv-change is split in two)."""

    STEADY = "steady"
    LENGTH_DRIFT = "length-drift"
    MIX_SHIFT = "mix-shift"
    KV_HALF = "kv-half"
    KV_DOUBLE = "kv-double"
    ITERATIONS = "iterations"


CHANGING_WORKLOADS: tuple[WorkloadName, ...] = (
    WorkloadName.LENGTH_DRIFT, WorkloadName.MIX_SHIFT, WorkloadName.KV_HALF, WorkloadName.KV_DOUBLE,
)
"""Workloads where a value tuned on steady is wrong for the moment (the tuned-once goal)."""


class Baseline(StrEnum):
    """What a run stands for in the comparison."""

    SWEEP = "sweep"
    """cache_aware at one trainer ceiling of the oracle sweep."""
    ORACLE = "oracle"
    """The cell's best sweep ceiling on the mean over its seeds (among the ceilings every seed ran),
    each seed's run at it: the one value a tuner could have set for the cell (a label on sweep runs,
    never a run of its own). The goals' yardstick."""
    ORACLE_PER_SEED = "oracle-per-seed"
    """Each seed's own best sweep point: stricter than any value one could set, since it also picks
    the luckiest ceiling of each seed's noise (a label on sweep runs)."""
    TUNED_ONCE = "tuned-once"
    """cache_aware at steady@paper's oracle ceiling, unchanged on this cell."""
    REQUEST_LIMIT = "request-limit"
    """cache_aware with the router's own request limit, trainer ceiling high."""
    HIGH_LOAD = "high-load"
    """cache_aware at the high ceiling the policies under test run at (a sweep point)."""
    BALANCE_SMALL = "balance-small"
    """cache_aware at the cell's oracle ceiling with small-fleet balance thresholds."""
    POLICY = "policy"
    """A policy under test (``RunSpec.variant`` names it), at the high ceiling."""


BASELINES_VLLM: tuple[Baseline, ...] = (
    Baseline.ORACLE, Baseline.ORACLE_PER_SEED, Baseline.TUNED_ONCE, Baseline.REQUEST_LIMIT, Baseline.HIGH_LOAD,
    Baseline.BALANCE_SMALL,
)
"""The vLLM Router cache_aware baselines every cell reports."""


class Cell(BaseModel):
    """One cell of the matrix; ``id`` is how the CLI and the tables name it."""

    model_config = _FROZEN
    workload: WorkloadName
    mixture: str = PAPER_MIXTURE
    engines: int = Field(DEFAULT_ENGINES, ge=1)

    @property
    def id(self) -> str:
        """``steady@paper:4``."""
        return f"{self.workload.value}@{self.mixture}:{self.engines}"

    @property
    def reference(self) -> Cell:
        """The cell the tuned-once values come from: steady, the paper's mixture, same engines."""
        return Cell(workload=WorkloadName.STEADY, mixture=PAPER_MIXTURE, engines=self.engines)

    @property
    def is_reference(self) -> bool:
        return self == self.reference


_CELL_ID = re.compile(r"^(?P<workload>[a-z-]+)@(?P<mixture>[a-z0-9_-]+)(?::(?P<engines>\d+))?$")


def _grid(per_engine: tuple[int, ...], engines: int) -> tuple[int, ...]:
    return tuple(sorted({p * engines for p in per_engine}))


class BenchSettings(BaseModel):
    """Everything that shapes the benchmark (the ``misat bench`` flags)."""

    model_config = _FROZEN
    engines: int = Field(DEFAULT_ENGINES, ge=1, description="fleet of every cell but the large-fleet ones")
    large_fleet_engines: tuple[int, ...] = LARGE_FLEET_ENGINES
    large_fleet_mixtures: tuple[str, ...] = Field(
        (PAPER_MIXTURE,), description="steady cells also run on the large fleets (each costs engines/4 x CPU)")
    profile: str = DEFAULT_PROFILE
    block_size: int = Field(
        BENCH_BLOCK_SIZE, ge=1,
        description="simulated tokens per KV block, for the engines and the router's index alike")
    seed: int = Field(0, description="seed of a run that names none (the HTTP layer)")
    seeds: tuple[int, ...] = Field(DEFAULT_SEEDS, min_length=1)
    mixtures: tuple[str, ...] = Field(tuple(MIXTURE_FAMILY), min_length=1, description="steady cells' mixtures")
    changing: tuple[WorkloadName, ...] = Field(
        (*CHANGING_WORKLOADS, WorkloadName.ITERATIONS), description="workloads crossed with the paper's mixture")
    policies: tuple[str, ...] = Field(DEFAULT_POLICIES, min_length=1)
    steady_state: SteadyStateSettings = SteadyStateSettings()
    duration_s: float = Field(480.0, gt=0, description="fixed-window runs (the HTTP layer's check): virtual s")
    warmup_s: float = Field(120.0, ge=0, description="fixed-window runs: virtual seconds excluded")
    ceilings_per_engine: tuple[int, ...] = Field(
        (24, 48, 64, 96, 128), min_length=1,
        description="coarse oracle grid, trainer ceiling per engine (x engines; 96..512 on 4 engines)")
    high_per_engine: int = Field(
        128, ge=1, description="the ceiling the policies under test and high-load run at, per engine (512 on 4: "
        "2-2.7x steady's knee; 1024 costs several times the CPU for the same conclusion)")
    request_limits_per_engine: tuple[int, ...] = Field(
        (16, 32, 64), min_length=1, description="router request limits swept on steady@paper, per engine")
    refine_max_points: int = Field(
        12, ge=0, description="refined ceilings per cell and seed at most, and as many again around the best "
        "ceiling on the mean over seeds (each round adds <= 2; steps of 8 from a grid step of 64 take 3 rounds)")
    iterations: int = Field(4, ge=1, description="iterations workload: weight updates")
    iteration_units_per_engine: int = Field(96, ge=1, description="iterations workload: units per engine")
    drift_span_units_per_engine: int = Field(
        100, ge=1, description="length-drift: outputs grow over this many released units per engine, then hold")
    mix_shift_units_per_engine: int = Field(
        100, ge=1, description="mix-shift: the target changes after this many released units per engine")
    balance_candidates: tuple[tuple[int, float], ...] = SMALL_FLEET_BALANCE

    @model_validator(mode="after")
    def _known_names(self) -> BenchSettings:
        unknown = [m for m in (*self.mixtures, *self.large_fleet_mixtures) if m not in MIXTURE_FAMILY]
        if unknown:
            raise ValueError(f"unknown mixture {unknown[0]!r}; known: {', '.join(MIXTURE_FAMILY)}")
        bad = [p for p in self.policies if p not in POLICY_VARIANTS]
        if bad:
            raise ValueError(f"unknown policy {bad[0]!r}; known: {', '.join(POLICY_VARIANTS)}")
        return self

    def engine_config(self, seed: int | None = None) -> SimEngineConfig:
        """The engines' config (each run builds fresh engines from it)."""
        return SimEngineConfig(profile=self.profile, seed=self.seed if seed is None else seed)

    def ceilings(self, engines: int) -> tuple[int, ...]:
        """The coarse grid on ``engines``, the high ceiling included."""
        return tuple(sorted({*_grid(self.ceilings_per_engine, engines), self.high(engines)}))

    def high(self, engines: int) -> int:
        return self.high_per_engine * engines

    def request_limits(self, engines: int) -> tuple[int, ...]:
        return _grid(self.request_limits_per_engine, engines)

    def cells(self) -> list[Cell]:
        """The whole matrix, in the order the suite runs it (the reference cells first)."""
        out = [Cell(workload=WorkloadName.STEADY, mixture=m, engines=self.engines) for m in self.mixtures]
        for e in self.large_fleet_engines:
            out += [Cell(workload=WorkloadName.STEADY, mixture=m, engines=e) for m in self.large_fleet_mixtures]
        out += [Cell(workload=w, mixture=PAPER_MIXTURE, engines=self.engines) for w in self.changing]
        return sorted(dict.fromkeys(out), key=lambda c: (not c.is_reference, c.engines))


QUICK = BenchSettings(
    engines=2, large_fleet_engines=(), seeds=(0, 1), mixtures=(PAPER_MIXTURE, "rlvr70"),
    changing=(WorkloadName.MIX_SHIFT, WorkloadName.ITERATIONS), policies=(DEFAULT_POLICY, "misa"),
    steady_state=SteadyStateSettings(window_s=20.0, warmup_factor=2.0, warmup_floor_s=40.0, min_class_samples=10,
                                     measure_s=80.0, max_duration_s=400.0),
    ceilings_per_engine=(16, 32), high_per_engine=64, request_limits_per_engine=(16,), refine_max_points=2,
    iterations=2, iteration_units_per_engine=24, drift_span_units_per_engine=40, mix_shift_units_per_engine=40,
    balance_candidates=SMALL_FLEET_BALANCE[:1],
)
"""``--quick``: every code path in minutes: 2 engines, 2 seeds, steady on two mixtures, mix-shift
and iterations; a 3-point sweep refined once; a warm-up of 2x the median residency (not 5x) and
20 s windows, still checked."""


def parse_cells(text: str, s: BenchSettings) -> list[Cell]:
    """``steady@paper,steady@rlvr70:16`` -> cells of the matrix (no engines: every fleet of it).

    Names outside the matrix are refused with the list of known ones.
    """
    matrix = s.cells()
    out: list[Cell] = []
    for raw in (t.strip() for t in text.split(",")):
        if not raw:
            continue
        m = _CELL_ID.match(raw)
        if m is None:
            raise ValueError(f"cell {raw!r} is not workload@mixture[:engines], e.g. steady@paper:4")
        hits = [c for c in matrix if c.workload.value == m["workload"] and c.mixture == m["mixture"]
                and (m["engines"] is None or c.engines == int(m["engines"]))]
        if not hits:
            raise ValueError(f"cell {raw!r} is not in the matrix; known: {', '.join(c.id for c in matrix)}")
        out += [c for c in hits if c not in out]
    return out


class WorkloadCase(BaseModel):
    """One cell and seed: the spec every policy replays, plus its engines and mode."""

    model_config = _FROZEN
    cell: Cell
    spec: WorkloadSpec
    kv_factor: float = 1.0
    iterations: int = 0
    iteration_units: int = 512
    description: str = ""


def workload_case(cell: Cell, s: BenchSettings, seed: int) -> WorkloadCase:
    """The seeded workload of ``cell`` (same for every policy of the cell and seed)."""
    mixture = MIXTURE_FAMILY[cell.mixture]
    base = WorkloadSpec(seed=seed, mixture=dict(mixture))
    w = cell.workload
    if w is WorkloadName.STEADY:
        return WorkloadCase(cell=cell, spec=base, description=f"{cell.mixture} mixture, stationary")
    if w is WorkloadName.LENGTH_DRIFT:
        span = s.drift_span_units_per_engine * cell.engines
        spec = length_drift_spec(span=span, growth=DRIFT_GROWTH, seed=seed, mixture=dict(mixture))
        return WorkloadCase(cell=cell, spec=spec,
                            description=f"RLVR/RLHF outputs 1x -> {DRIFT_GROWTH:g}x over the first {span} units")
    if w is WorkloadName.MIX_SHIFT:
        at = s.mix_shift_units_per_engine * cell.engines
        spec = base.model_copy(update={"mixture_changes": mix_shift_spec(at, dict(MIX_SHIFT_AFTER)).mixture_changes})
        return WorkloadCase(cell=cell, spec=spec, description=(
            f"{cell.mixture} mixture, agentic {MIX_SHIFT_AFTER[RolloutClass.AGENTIC]:g}% from unit {at}"))
    if w is WorkloadName.KV_HALF:
        return WorkloadCase(cell=cell, spec=base, kv_factor=KV_HALF,
                            description=f"steady, engines with {KV_HALF:g}x KV")
    if w is WorkloadName.KV_DOUBLE:
        return WorkloadCase(cell=cell, spec=base, kv_factor=KV_DOUBLE,
                            description=f"steady, engines with {KV_DOUBLE:g}x KV")
    if w is WorkloadName.ITERATIONS:
        units = s.iteration_units_per_engine * cell.engines
        return WorkloadCase(cell=cell, spec=base, iterations=s.iterations, iteration_units=units,
                            description=f"{s.iterations} iterations of {units} units, prefix caches reset between")
    raise ValueError(f"unknown workload {w}")


class RunSpec(BaseModel):
    """One run of the cluster layer: a cell, a seed, a policy, a trainer ceiling.

    ``mixture``, ``engines`` and ``seed`` default to the paper's, ``BenchSettings.engines`` and
    ``BenchSettings.seed``; ``steady_state`` False measures the fixed window
    ``[warmup_s, duration_s]`` (the HTTP layer's check; its start rounded up to a whole
    ``window_s``), True the steady-state window of ``misat_bench.steady_state``.
    """

    model_config = _FROZEN
    workload: WorkloadName
    baseline: Baseline
    policy: PolicySettings
    ceiling: int = Field(ge=1)
    label: str
    mixture: str = PAPER_MIXTURE
    engines: int | None = None
    seed: int | None = None
    steady_state: bool = False
    variant: str = Field("", description="policy variant name (Baseline.POLICY)")

    @property
    def router(self) -> str:
        """Which side of the comparison the run is on."""
        return "cache-aware" if self.policy.name is PolicyName.CACHE_AWARE else "misat"

    def cell(self, s: BenchSettings) -> Cell:
        return Cell(workload=self.workload, mixture=self.mixture, engines=self.engines or s.engines)

    def seed_of(self, s: BenchSettings) -> int:
        return s.seed if self.seed is None else self.seed

    def key(self, s: BenchSettings) -> str:
        """A digest of everything that determines the result (cache key)."""
        payload: dict[str, object] = {"cluster": cluster_config(self, s).model_dump(mode="json")}
        if self.steady_state:
            payload["steady_state"] = s.steady_state.model_dump(mode="json")
        blob = json.dumps(payload, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cluster_config(run: RunSpec, s: BenchSettings) -> ClusterConfig:
    """The ``ClusterConfig`` of a run: fresh engines, the cell's seeded spec.

    A steady-state run's duration is the cap (``max_duration_s``): it stops earlier once
    converged (``misat_bench.cluster_runs.BenchCluster``).
    """
    cell, seed = run.cell(s), run.seed_of(s)
    case = workload_case(cell, s, seed)
    engine = s.engine_config(seed)
    if case.kv_factor != 1.0:
        # Blocks at the bench's block size: the cluster applies it to the engines, and a count
        # resolved at the profile's 16 would stand for 4x the tokens at 64.
        blocks = engine.model_copy(update={"block_size": s.block_size}).resolve().num_gpu_blocks
        engine = engine.model_copy(update={"num_gpu_blocks": max(2, round(blocks * case.kv_factor))})
    if run.steady_state:
        duration, warmup = s.steady_state.max_duration_s, s.steady_state.warmup_floor_s
    else:
        duration, warmup = s.duration_s, s.warmup_s
    return ClusterConfig(
        engines=cell.engines, engine=engine, policy=run.policy, workload=case.spec, ceiling=run.ceiling,
        duration_s=duration, warmup_s=warmup, iterations=case.iterations, iteration_units=case.iteration_units,
        block_size=s.block_size,
    )


def cache_aware(limit: int | None = None, balance: tuple[int, float] | None = None) -> PolicySettings:
    """The vLLM Router baseline's settings (defaults unless a balance pair is given)."""
    ca = CacheAwareSettings() if balance is None else CacheAwareSettings(
        balance_abs_threshold=balance[0], balance_rel_threshold=balance[1])
    # cache_aware never reads the admission or footprint settings, but a run's cache key digests
    # all of them: pinned to what the cached baselines ran with, a change of those defaults does
    # not send every oracle sweep (CPU-hours on 16 engines) to be run again for the same figures.
    return PolicySettings(name=PolicyName.CACHE_AWARE, concurrency_limit=limit, cache_aware=ca,
                          admission=SHORT_MEMORY_GUARD, footprint=PEAK_P25)


def _spec(cell: Cell, seed: int, baseline: Baseline, policy: PolicySettings, ceiling: int, label: str,
          variant: str = "") -> RunSpec:
    return RunSpec(workload=cell.workload, mixture=cell.mixture, engines=cell.engines, seed=seed, baseline=baseline,
                   policy=policy, ceiling=ceiling, label=label, steady_state=True, variant=variant)


def sweep_run(cell: Cell, seed: int, ceiling: int) -> RunSpec:
    """One point of a cell's oracle sweep."""
    return _spec(cell, seed, Baseline.SWEEP, cache_aware(), ceiling, f"cache_aware @{ceiling}")


def refine_ceilings(
    points: Mapping[int, float], rounds_left: int = 1, step: int = CEILING_ROUNDING
) -> list[int]:
    """Ceilings to add around the best sweep point: midpoints to its neighbours.

    ``points`` maps ceiling -> rate. Midpoints are rounded to ``step``; ones already swept (or
    equal to a neighbour) are skipped, so refinement stops by itself once the grid around the
    best point is as fine as that. A best point at an end of the grid is not bracketed: the
    sweep first goes past it (half the lowest ceiling, rounded, down to ``step``; twice the
    highest). Called again after each batch is measured (the suite's planner, the demo's tuning).
    """
    if rounds_left <= 0 or not points:
        return []
    grid = sorted(points)
    best = pick_oracle(points)
    i = grid.index(best)
    out: list[int] = []
    if i == 0 and best > step:
        below = max(step, best // 2 // step * step)
        if below not in points:
            out.append(below)
    if i == len(grid) - 1:
        out.append(best * 2)
    for j in (i - 1, i + 1):
        if 0 <= j < len(grid):
            mid = round((grid[j] + best) / 2 / step) * step
            if mid not in points and mid not in out and min(grid[j], best) < mid < max(grid[j], best):
                out.append(mid)
    return out


def pick_oracle(points: Mapping[int, float]) -> int:
    """The best ceiling of a sweep: highest rate; ties go to the lower ceiling."""
    if not points:
        raise ValueError("empty sweep")
    return max(sorted(points), key=lambda c: (points[c], -c))


def means_over_seeds(per_seed: Mapping[int, Mapping[int, float]]) -> dict[int, float]:
    """Per value (ceiling, limit) every seed ran: its mean rate over the seeds."""
    if not per_seed:
        return {}
    common = set.intersection(*(set(p) for p in per_seed.values()))
    return {v: statistics.fmean(p[v] for p in per_seed.values()) for v in common}


def best_on_mean(per_seed: Mapping[int, Mapping[int, float]]) -> int | None:
    """The value (ceiling, limit) with the best mean rate over seeds, among those every seed ran."""
    means = means_over_seeds(per_seed)
    return pick_oracle(means) if means else None


RateOf = Callable[[RunSpec], float | None]
"""The headline rate of a run if it is known (a cache or a finished stage), else None."""


class Plan(BaseModel):
    """What the planner knows: every run it can name now, and the values tuned on the reference cells."""

    model_config = ConfigDict(extra="forbid")
    runs: list[RunSpec] = Field(default_factory=list)
    tuned: dict[str, dict[str, object]] = Field(default_factory=dict, description="reference cell id -> values")


def plan_suite(s: BenchSettings, rate: RateOf, cells: list[Cell] | None = None,
               policies: tuple[str, ...] | None = None) -> Plan:
    """Every run derivable from what is known (``rate``): call again after running the unknown ones.

    Stages per cell and seed: the coarse sweep and the policies under test; then the sweep's
    refinement around that seed's best point; then the cell's own refinement around its best
    ceiling on the mean over seeds, every seed at every new ceiling (``_refine_on_mean``: the
    oracle); once the reference cell (steady@paper, same engines) is refined, the tuned-once
    ceiling, request limit and balance pair it chose (best mean over seeds) are run on every
    other cell. A selected cell brings its reference cell's sweep, request-limit sweep and
    balance runs along.
    """
    chosen = cells if cells is not None else s.cells()
    names = policies if policies is not None else s.policies
    refs = list(dict.fromkeys(c.reference for c in chosen))
    plan = Plan()
    done_sweep: dict[Cell, bool] = {}
    oracle_ceiling: dict[Cell, int] = {}
    for cell in list(dict.fromkeys([*refs, *chosen])):
        complete = True
        per_seed: dict[int, dict[int, float]] = {}
        for seed in s.seeds:
            points, more = _sweep(cell, seed, s, rate, plan)
            complete = complete and not more
            per_seed[seed] = points
        if complete:
            complete = _refine_on_mean(cell, s, rate, plan, per_seed)
        done_sweep[cell] = complete
        best = best_on_mean(per_seed) if complete else None
        if best is not None:
            oracle_ceiling[cell] = best
        if cell in chosen:
            high = s.high(cell.engines)
            for seed in s.seeds:
                for name in names:
                    plan.runs.append(_spec(cell, seed, Baseline.POLICY, POLICY_VARIANTS[name], high,
                                           f"{name} @{high}", variant=name))
    for ref in refs:
        high = s.high(ref.engines)
        limits: dict[int, dict[int, float]] = {}
        for seed in s.seeds:
            for lim in s.request_limits(ref.engines):
                spec = _spec(ref, seed, Baseline.REQUEST_LIMIT, cache_aware(limit=lim), high,
                             f"cache_aware limit {lim} @{high}")
                plan.runs.append(spec)
                r = rate(spec)
                if r is not None:
                    limits.setdefault(seed, {})[lim] = r
        tuned: dict[str, object] = {}
        if done_sweep.get(ref) and ref in oracle_ceiling:
            tuned["ceiling"] = oracle_ceiling[ref]
        if len(limits) == len(s.seeds):
            tuned["request_limit"] = best_on_mean(limits)
        if ref in oracle_ceiling:
            bal: dict[int, dict[int, float]] = {}
            for seed in s.seeds:
                for i, pair in enumerate(s.balance_candidates):
                    spec = _balance(ref, seed, pair, oracle_ceiling[ref])
                    plan.runs.append(spec)
                    r = rate(spec)
                    if r is not None:
                        bal.setdefault(seed, {})[i] = r
            if len(bal) == len(s.seeds):
                best_i = best_on_mean(bal)
                if best_i is not None:
                    tuned["balance"] = list(s.balance_candidates[best_i])
        plan.tuned[ref.id] = tuned
    for cell in chosen:
        if cell.is_reference:
            continue
        tuned = plan.tuned.get(cell.reference.id, {})
        high = s.high(cell.engines)
        for seed in s.seeds:
            c = tuned.get("ceiling")
            if isinstance(c, int):
                plan.runs.append(_spec(cell, seed, Baseline.TUNED_ONCE, cache_aware(), c,
                                       f"cache_aware @{c} (tuned on {cell.reference.id})"))
            tuned_limit = tuned.get("request_limit")
            if isinstance(tuned_limit, int):
                plan.runs.append(_spec(cell, seed, Baseline.REQUEST_LIMIT, cache_aware(limit=tuned_limit), high,
                                       f"cache_aware limit {tuned_limit} @{high} (tuned on {cell.reference.id})"))
            tuned_pair = tuned.get("balance")
            if isinstance(tuned_pair, list) and cell in oracle_ceiling:
                pair = (int(tuned_pair[0]), float(tuned_pair[1]))
                plan.runs.append(_balance(cell, seed, pair, oracle_ceiling[cell]))
    return plan


def _balance(cell: Cell, seed: int, pair: tuple[int, float], ceiling: int) -> RunSpec:
    return _spec(cell, seed, Baseline.BALANCE_SMALL, cache_aware(balance=pair), ceiling,
                 f"cache_aware @{ceiling} balance {pair[0]}/{pair[1]:g}")


def _sweep(cell: Cell, seed: int, s: BenchSettings, rate: RateOf, plan: Plan) -> tuple[dict[int, float], bool]:
    """Add the cell's sweep for ``seed`` to ``plan``; returns the known points and whether more are to come."""
    points: dict[int, float] = {}
    if not plan_sweep_points(cell, {seed: points}, s.ceilings(cell.engines), rate, plan.runs):
        return points, True
    refined = 0
    while refined < s.refine_max_points:
        extra = refine_ceilings(points)[: s.refine_max_points - refined]
        if not extra:
            break
        if not plan_sweep_points(cell, {seed: points}, extra, rate, plan.runs):
            return points, True
        refined += len(extra)
    return points, False


def plan_sweep_points(cell: Cell, per_seed: Mapping[int, dict[int, float]], ceilings: Sequence[int], rate: RateOf,
                      runs: list[RunSpec]) -> bool:
    """Name the sweep run of every ceiling for every seed of ``per_seed`` (appended to ``runs``) and
    record the rates already known in ``per_seed``; True when every one of them is known."""
    done = True
    for c in ceilings:
        for seed, points in per_seed.items():
            spec = sweep_run(cell, seed, c)
            runs.append(spec)
            r = rate(spec)
            if r is None:
                done = False
            else:
                points[c] = r
    return done


def _refine_on_mean(cell: Cell, s: BenchSettings, rate: RateOf, plan: Plan,
                    per_seed: dict[int, dict[int, float]]) -> bool:
    """The cell's refinement: midpoints around its best ceiling on the mean over seeds, each run on
    every seed, until that ceiling's neighbours among the ceilings every seed ran are a rounding step
    away (or ``refine_max_points`` ceilings were added). ``per_seed`` gains the points measured;
    True when nothing more is to come.

    Why besides each seed's refinement: a seed refines around its own best point, so the ceilings
    near the cell's best mean may have run on one seed only, and the mean is taken only where every
    seed ran."""
    refined = 0
    while refined < s.refine_max_points:
        extra = refine_ceilings(means_over_seeds(per_seed))[: s.refine_max_points - refined]
        if not extra:
            return True
        if not plan_sweep_points(cell, per_seed, extra, rate, plan.runs):
            return False
        refined += len(extra)
    return True
