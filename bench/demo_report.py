"""What ``misat demo`` reports: three rows side by side, their ratios, a verdict in plain words.

Pure (no I/O): the runner in ``misat_bench.demo`` hands over measured runs,
this module turns them into the table a person reads, the JSON, and the
verdict. Kept apart so that every case of the verdict is unit-tested.

The rows, on the same seeded workload and the same simulated fleet:

- ``untuned``: this router with its default policy, the trainer at a high
  ceiling: nobody tuned anything;
- ``tuned``: the vLLM Router's ``cache_aware`` at the trainer ceiling a sweep
  found best for this fleet and workload (the yardstick, ratio 1.00);
- ``high``: the same baseline at the high ceiling: what a wrong limit costs;
- ``tuned-once`` (only on a fleet with another KV size, ``--kv-factor``): the
  baseline at the ceiling tuned for the manifest's own fleet, unchanged: a limit
  nobody re-tuned when the fleet changed.

The headline is the mixture-constrained sample rate (``min_b completed_b /
share_b`` per minute, ``misat_sim.report.mixture_constrained_rate``): what a
trainer that fills batches at its target mixture actually gets.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from misat_bench.stats import Interval, mean_interval
from misat_bench.steady_state import SteadyStateSettings, converged

Role = Literal["untuned", "tuned", "high", "tuned-once"]
ROLES: tuple[Role, ...] = ("untuned", "tuned", "high")
"""The rows every report has (``tuned-once`` is optional)."""

KEEP_UP_COMPARABLE: float = 0.9
"""A run with an engine under this keep-up is not a comparison (the engines ran slower than modelled)."""

ROUTER_CPU_SATURATED: float = 0.9
"""This router runs one event loop on one core: a window in which its process used this share of a
core or more measured the machine's CPU, not the policy (the binary is multi-threaded: not judged)."""

ONE_RUN_PARITY: float = 0.05
"""With one run per row (no interval), a ratio within this of 1.0 reads as parity: the spread of
repeated live demo runs on the same seed here (docs/demo.md) is of this order."""

MIXTURE_OFF_POINTS: float = 3.0
"""An untuned row whose consumed mixture is further than this (TV points) from the target gets a sentence
saying so: its units/min then overstates what a trainer at that mixture receives."""

HIT_COLLAPSE_POINTS: float = 10.0
"""The high-ceiling baseline's prefix hit this many points under the tuned one reads as a collapse."""

CONVERGENCE: SteadyStateSettings = SteadyStateSettings()
"""The benchmark's convergence rule, applied to each run's measured window: windows of ``window_s``
modelled seconds, and over the last ``convergence_windows`` of them every class's completions in
the early and the late half agree (docs/benchmark.md, "Steady-state windows")."""


class SeriesSample(BaseModel):
    """One sample of a run's time series (modelled time since the trainer started)."""

    model_config = ConfigDict(extra="forbid")
    t_s: float
    units: int = Field(description="completed rollout units so far")
    units_by_class: dict[str, int]
    prompt_tokens: int
    cached_tokens: int
    kv_usage: float | None = Field(None, description="mean over engines of vllm:kv_cache_usage_perc, 0..1")
    held: int | None = Field(None, description="requests this router held (None: another router)")
    sessions_by_class: dict[str, int] | None = Field(None, description="this router's live sessions per class")


class RunFigures(BaseModel):
    """One measured run of one row (the window after warm-up, modelled time)."""

    model_config = ConfigDict(extra="forbid")
    seed: int
    window_s: float = Field(description="modelled seconds measured (after warm-up)")
    mixture_rate_per_min: float | None = Field(description="mixture-constrained sample rate")
    units_per_min: float
    requests_per_min: float
    prefix_hit_rate: float | None
    preemptions: int
    tv_points: float | None
    consumed_pct: dict[str, float]
    keep_up: list[float | None] = Field(description="per engine over the window; None: never busy")
    errors: int
    wall_s: float
    trainer_lag_s: float | None = Field(None, description="mean event-loop lag of the trainer's process, wall s")
    router_cpu: float | None = Field(None, description="the router process's CPU seconds per wall second in the "
                                     "window (1.0: one core busy all the time)")
    series: list[SeriesSample] = Field(default_factory=list)
    router_status: dict[str, Any] | None = Field(None, description="this router's /status at the end")
    converged: bool | None = Field(None, description="the measured window passes the benchmark's convergence "
                                   "rule (CONVERGENCE); None without a time series")

    @property
    def engines_kept_up(self) -> bool:
        return all(k is None or k >= KEEP_UP_COMPARABLE for k in self.keep_up)



def window_counts(series: Sequence[SeriesSample], start_s: float, window_s: float) -> list[dict[str, int]]:
    """Completions per class in consecutive windows of ``window_s`` modelled seconds from ``start_s``,
    each cut at the first sample at or after its boundary (samples come about a second apart)."""
    marks: list[SeriesSample] = []
    boundary = start_s
    for p in series:
        if p.t_s >= boundary - 1e-9:
            marks.append(p)
            boundary = p.t_s + window_s
    return [{c: n - a.units_by_class.get(c, 0) for c, n in b.units_by_class.items()}
            for a, b in pairwise(marks)]


def window_converged(series: Sequence[SeriesSample], window_s: float) -> bool | None:
    """Whether the last ``window_s`` modelled seconds of ``series`` pass ``CONVERGENCE``; None when empty."""
    if not series:
        return None
    windows = window_counts(series, series[-1].t_s - window_s, CONVERGENCE.window_s)
    return converged(windows, sorted(series[-1].units_by_class), CONVERGENCE)


class RowSpec(BaseModel):
    """What a row runs."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    role: Role
    label: str = Field(description="what ran, as the table shows it")
    router: Literal["misat", "vllm-router"]
    policy: str = Field(description="the router's policy name as configured")
    ceiling: int = Field(description="the trainer's max rollout units in flight")


class Row(BaseModel):
    """A row and its runs (one per repeat; repeat k of every row uses the same seed)."""

    model_config = ConfigDict(extra="forbid")
    spec: RowSpec
    runs: list[RunFigures] = Field(default_factory=list)

    def mean(self, field: str) -> float | None:
        values = [getattr(r, field) for r in self.runs if getattr(r, field) is not None]
        return sum(values) / len(values) if values else None

    def router_saturated(self, run: RunFigures) -> bool:
        """This router's single event loop was CPU-bound in the run."""
        return self.spec.router == "misat" and run.router_cpu is not None and run.router_cpu >= ROUTER_CPU_SATURATED

    @property
    def comparable(self) -> bool:
        return all(r.engines_kept_up and not self.router_saturated(r) for r in self.runs)


Reading = Literal["win", "parity", "loss", "unknown"]


class Ratio(BaseModel):
    """A row's mixture-constrained rate over the tuned baseline's, paired by repeat."""

    model_config = ConfigDict(frozen=True)
    interval: Interval | None
    reading: Reading


def ratio_to_tuned(row: Row, tuned: Row) -> Ratio:
    """Per repeat ``row / tuned`` (same seed), then the mean and its interval."""
    pairs = [a.mixture_rate_per_min / b.mixture_rate_per_min
             for a, b in zip(row.runs, tuned.runs, strict=False)
             if a.mixture_rate_per_min is not None and b.mixture_rate_per_min]
    if not pairs:
        return Ratio(interval=None, reading="unknown")
    iv = mean_interval(pairs)
    reading: Reading
    if iv.n >= 2:
        reading = "parity" if iv.straddles(1.0) else ("win" if iv.low > 1.0 else "loss")
    else:
        reading = "parity" if abs(iv.mean - 1.0) <= ONE_RUN_PARITY else ("win" if iv.mean > 1.0 else "loss")
    return Ratio(interval=iv, reading=reading)


class DemoReport(BaseModel):
    """The demo's result: rows, ratios and the verdict (``result.json``)."""

    model_config = ConfigDict(extra="forbid")
    rows: list[Row]
    baseline: str = Field(description="what the baseline rows ran: the binary or the re-implementation")
    tuning: str = Field(description="where the tuned ceiling came from")
    target_pct: dict[str, float] = Field(description="the trainer's target mixture, % per class")
    ratios: dict[str, Ratio] = Field(default_factory=dict)
    verdict: list[str] = Field(default_factory=list)

    def row(self, role: Role) -> Row:
        return next(r for r in self.rows if r.spec.role == role)

    def find(self, role: Role) -> Row | None:
        return next((r for r in self.rows if r.spec.role == role), None)


def build_report(rows: Sequence[Row], *, baseline: str, tuning: str, target_pct: dict[str, float]) -> DemoReport:
    """Ratios to the tuned row and the verdict."""
    report = DemoReport(rows=list(rows), baseline=baseline, tuning=tuning, target_pct=target_pct)
    tuned = report.row("tuned")
    report.ratios = {r.spec.role: ratio_to_tuned(r, tuned) for r in report.rows}
    once = report.find("tuned-once")
    if once is not None:
        report.ratios["untuned/tuned-once"] = ratio_to_tuned(report.row("untuned"), once)
    report.verdict = verdict(report)
    return report


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def verdict(report: DemoReport) -> list[str]:
    """Two or three sentences: what won, by how much, and why. Says so when this router lost."""
    untuned, tuned, high = (report.row(r) for r in ROLES)
    if not all(r.comparable for r in report.rows):
        why = []
        for r in report.rows:
            if not all(run.engines_kept_up for run in r.runs):
                why.append(f"the simulated engines fell behind the wall clock (keep-up under {KEEP_UP_COMPARABLE}) "
                           f"in {r.spec.label}")
            if any(r.router_saturated(run) for run in r.runs):
                why.append(f"this router's process was CPU-bound (one core {ROUTER_CPU_SATURATED:.0%} busy or more) "
                           f"in {r.spec.label}")
        return [f"Not a comparison: {'; '.join(why)}, so the figures measure this machine's CPU, not the "
                "policies; rerun with a lower --time-scale or fewer other programs running."]
    ratio = report.ratios["untuned"]
    if ratio.interval is None:
        return ["No verdict: a row completed no samples in its window; see the logs."]
    x = ratio.interval.describe()
    hits = (f"prefix hit {_pct(untuned.mean('prefix_hit_rate'))} against {_pct(tuned.mean('prefix_hit_rate'))}, "
            f"{untuned.mean('preemptions') or 0:.0f} preemptions against {tuned.mean('preemptions') or 0:.0f}")
    name = untuned.spec.label
    base = f"{tuned.spec.label}"
    if ratio.reading == "win":
        first = (f"{name} beat {base} without any tuning: {x} its mixture-constrained sample rate "
                 f"({hits}).")
    elif ratio.reading == "parity":
        first = (f"{name} matched {base} without any tuning: {x} its mixture-constrained sample rate, "
                 f"within the run-to-run spread ({hits}); the tuned limit is right for this workload, and this "
                 "router needs no one to find it.")
    else:
        first = (f"{name} lost to {base}: {x} its mixture-constrained sample rate ({hits}); on this workload "
                 "the tuned static limit does better than this router's admission.")
    out = [first]
    mix = _mixture_sentence(report, untuned, tuned)
    if mix:
        out.append(mix)
    high_ratio = report.ratios["high"]
    if high_ratio.interval is not None:
        drop = (tuned.mean("prefix_hit_rate") or 0.0) - (high.mean("prefix_hit_rate") or 0.0)
        hx = high_ratio.interval.describe()
        if drop * 100 >= HIT_COLLAPSE_POINTS:
            out.append(f"At the high ceiling ({high.spec.ceiling}) the same baseline gets {hx} of its tuned "
                       f"rate: prefix hit falls to {_pct(high.mean('prefix_hit_rate'))} with "
                       f"{high.mean('preemptions') or 0:.0f} preemptions, as too many sessions evict each "
                       "other's KV; a static limit must be re-tuned whenever the workload changes.")
        else:
            out.append(f"At the high ceiling ({high.spec.ceiling}) the same baseline gets {hx} of its tuned "
                       f"rate (prefix hit {_pct(high.mean('prefix_hit_rate'))}): on this fleet a wrong limit "
                       "costs little.")
    once = report.find("tuned-once")
    once_ratio, against_once = report.ratios.get("tuned-once"), report.ratios.get("untuned/tuned-once")
    if once is not None and once_ratio is not None and once_ratio.interval is not None \
            and against_once is not None and against_once.interval is not None:
        out.append(f"The limit tuned for the standard fleet and left unchanged ({once.spec.label}) gets "
                   f"{once_ratio.interval.describe()} of this fleet's tuned rate (prefix hit "
                   f"{_pct(once.mean('prefix_hit_rate'))}, {once.mean('preemptions') or 0:.0f} preemptions); "
                   f"this router untuned gets {against_once.interval.describe()} of that limit's rate "
                   f"({against_once.reading}).")
    return out


def _mixture_sentence(report: DemoReport, untuned: Row, tuned: Row) -> str | None:
    """When the untuned row's raw units/min and its mixture-constrained rate tell different stories."""
    u, t = untuned.mean("units_per_min"), tuned.mean("units_per_min")
    tv = untuned.mean("tv_points")
    if not u or not t or tv is None or tv <= MIXTURE_OFF_POINTS or not untuned.runs:
        return None
    consumed = {c: sum(r.consumed_pct.get(c, 0.0) for r in untuned.runs) / len(untuned.runs)
                for c in report.target_pct}
    total = sum(report.target_pct.values()) or 1.0
    scarce = min(consumed, key=lambda c: consumed[c] / (report.target_pct[c] / total * 100) if report.target_pct[c]
                 else float("inf"))
    return (f"It completed {u / t:.2f}x the baseline's units per minute, but off the trainer's mixture "
            f"(TV {tv:.1f} points; {scarce} {consumed[scarce]:.0f}% of completions against a "
            f"{100 * report.target_pct[scarce] / total:.0f}% target), and a trainer that fills batches at its "
            "mixture waits for the scarcest class.")


def table_rows(report: DemoReport) -> list[list[str]]:
    """The table's cells, one list per row (header first); numbers are means over repeats."""
    header = ["row", "ran", "ceiling", "mixture-constrained samples/min", "units/min", "prefix hit",
              "preemptions", "mixture TV pts", "keep-up (min engine)", "router CPU (cores)", "ratio to tuned"]
    out = [header]
    for row in report.rows:
        ratio = report.ratios.get(row.spec.role)
        keep = [k for r in row.runs for k in r.keep_up if k is not None]
        mrate = row.mean("mixture_rate_per_min")
        tv = row.mean("tv_points")
        cpu = row.mean("router_cpu")
        out.append([
            row.spec.role, row.spec.label, str(row.spec.ceiling),
            "-" if mrate is None else f"{mrate:.1f}", f"{row.mean('units_per_min') or 0:.1f}",
            _pct(row.mean("prefix_hit_rate")), f"{row.mean('preemptions') or 0:.0f}",
            "-" if tv is None else f"{tv:.2f}", f"{min(keep):.3f}" if keep else "-",
            "-" if cpu is None else f"{cpu:.2f}",
            ratio.interval.describe() if ratio and ratio.interval else "-",
        ])
    return out
