"""Benchmark figures: per-cell rows with seed intervals, the result JSON model, tables and plots.

Why apart from the runners: the arithmetic that turns runs into claims (which
sweep point is each seed's oracle, every ratio against it, which intervals
straddle 1.0) is pure and unit-tested, and the JSON schema is one pydantic
model that tests and docs can point to.

The **oracle** is per cell: the sweep ceiling with the best mean over the
cell's seeds (among those every seed ran), each seed's run at it, the one
value a tuner could have set. The **oracle per seed** (each seed's own best
ceiling) is reported beside it: stricter, since it also picks the luckiest
ceiling of each seed's noise. Every ratio is taken per seed, against the run
of the same seed (same sessions), then averaged with a Student-t interval
over seeds (``misat_bench.stats``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from misat_bench.cluster_runs import RunRecord
from misat_bench.stats import Interval, Verdict, mean_interval, paired_ratio, verdict
from misat_bench.suite import (
    BASELINES_VLLM,
    Baseline,
    BenchSettings,
    Cell,
    RunSpec,
    best_on_mean,
    pick_oracle,
    workload_case,
)

SCHEMA_VERSION: int = 3
"""Bumped when a field of ``BenchResult`` changes meaning (2: cells, seeds, intervals, goals; 3: the
``oracle`` row is the cell's best ceiling on the mean over seeds, ``oracle-per-seed`` each seed's best)."""

NOT_A_COMPARISON: str = "not a comparison"
"""How a figure from engines that could not keep up is marked in the table."""

RATIO_AGAINST: tuple[Baseline, ...] = (Baseline.ORACLE, Baseline.ORACLE_PER_SEED, Baseline.TUNED_ONCE,
                                       Baseline.REQUEST_LIMIT, Baseline.HIGH_LOAD)
"""The baselines each policy under test is compared with (ratios of the headline rate)."""


class SummaryRow(BaseModel):
    """One line of the HTTP layer's table (one run, no seeds)."""

    model_config = ConfigDict(extra="forbid")
    layer: str = "cluster"
    workload: str
    baseline: str
    label: str
    router: str
    ceiling: int | None
    sample_rate_per_min: float
    ratio_to_oracle: float | None = Field(description="sample rate / the reference run's")
    prefix_hit_rate: float | None
    tv_points: float | None
    preemptions: int | None
    mean_iteration_s: float | None = None
    mean_kv_usage: float | None = None
    keep_up: float | None = Field(None, description="HTTP layer: the lowest engine keep-up of the run "
                                  "(modelled time advanced / wall time x time scale while busy); None in virtual time")
    comparison: bool = Field(True, description="False: the engines ran too far under modelled speed (keep-up "
                             "under the HTTP layer's KEEP_UP_COMPARABLE) for the figure to compare routers")

    @property
    def note(self) -> str:
        """``not a comparison`` for a row whose engines could not keep up, else empty."""
        return "" if self.comparison else NOT_A_COMPARISON


class SeedFigures(BaseModel):
    """One run of a row: the figures of one seed."""

    model_config = ConfigDict(extra="forbid")
    seed: int
    key: str
    label: str
    ceiling: int
    mixture_rate_per_min: float
    sample_rate_per_min: float
    requests_per_min: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    prefix_hit_rate: float
    ideal_prefix_hit_rate: float
    tv_points: float
    tv_noise_points: float
    preemptions: int
    mean_kv_usage: float
    mean_iteration_s: float | None
    converged: bool | None
    warmup_ok: bool | None
    window_start_s: float
    measured_s: float


class RatioSummary(BaseModel):
    """A ratio of headline rates, per seed and as mean with its interval."""

    model_config = ConfigDict(extra="forbid")
    against: str
    per_seed: dict[int, float]
    interval: Interval
    verdict: Verdict


class CellRow(BaseModel):
    """A baseline or a policy under test on one cell, over seeds."""

    model_config = ConfigDict(extra="forbid")
    role: str = Field(description="baseline name, or the policy variant's name")
    kind: str = Field(description="baseline | policy")
    router: str
    seeds: list[SeedFigures]
    mixture_rate: Interval
    ratios: dict[str, RatioSummary] = Field(default_factory=dict)

    def mean(self, field: str) -> float | None:
        """Mean over seeds of a ``SeedFigures`` field (None when no seed has it)."""
        values = [getattr(f, field) for f in self.seeds if getattr(f, field) is not None]
        return sum(values) / len(values) if values else None

    @property
    def converged(self) -> bool | None:
        """False if any seed's run failed the convergence check or the warm-up rule; None: iterations."""
        flags = [f.converged for f in self.seeds if f.converged is not None]
        flags += [f.warmup_ok for f in self.seeds if f.warmup_ok is not None]
        return all(flags) if flags else None

    @property
    def label(self) -> str:
        labels = list(dict.fromkeys(f.label for f in self.seeds))
        return labels[0] if len(labels) == 1 else " / ".join(labels)


class SweepPoint(BaseModel):
    """One point of a cell's oracle sweep on one seed."""

    model_config = ConfigDict(extra="forbid")
    seed: int
    value: int
    mixture_rate_per_min: float
    sample_rate_per_min: float
    prefix_hit_rate: float
    tv_points: float
    preemptions: int
    converged: bool | None


class SeriesSummary(BaseModel):
    """A run's per-class completions per window (the time-series plot), with its window marked."""

    model_config = ConfigDict(extra="forbid")
    role: str
    seed: int
    window_s: float
    window_start_s: float
    end_s: float
    points: list[tuple[float, dict[str, int]]]


class CellSummary(BaseModel):
    """Per cell: the whole oracle sweep of every seed and the rows."""

    model_config = ConfigDict(extra="forbid")
    cell: str
    workload: str
    mixture: str
    engines: int
    description: str = ""
    seeds: list[int]
    cell_oracle_ceiling: int | None = Field(
        None, description="the oracle: the best sweep ceiling on the mean over seeds, among those every seed ran")
    oracle_ceiling: dict[int, int] = Field(description="per seed: its own best sweep ceiling (oracle-per-seed)")
    sweep: list[SweepPoint]
    rows: list[CellRow]
    series: list[SeriesSummary] = Field(default_factory=list)

    def row(self, role: str) -> CellRow | None:
        return next((r for r in self.rows if r.role == role), None)


class GoalResult(BaseModel):
    """One of the issue's goals, evaluated on the result."""

    model_config = ConfigDict(extra="forbid")
    goal: str
    target: str
    measured: str
    met: bool | None = Field(description="None: the result holds no cell the goal is about")
    interval: Interval | None = None


class BenchResult(BaseModel):
    """The whole result file (``out/bench/result.json``)."""

    model_config = ConfigDict(extra="forbid")
    schema_version: int = SCHEMA_VERSION
    created_at: str = Field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    command: str = ""
    machine: str = ""
    settings: BenchSettings
    tuned: dict[str, dict[str, Any]] = Field(default_factory=dict, description="reference cell -> values tuned there")
    cells: list[CellSummary] = Field(default_factory=list)
    goals: list[GoalResult] = Field(default_factory=list)
    runs: list[RunRecord] = Field(default_factory=list)
    http: dict[str, Any] | None = None
    cpu_s_total: float = 0.0


def _figures(spec: RunSpec, r: RunRecord, s: BenchSettings) -> SeedFigures:
    m = r.metrics
    return SeedFigures(
        seed=spec.seed_of(s), key=r.key, label=spec.label, ceiling=spec.ceiling,
        mixture_rate_per_min=m.mixture_rate_per_min, sample_rate_per_min=m.sample_rate_per_min,
        requests_per_min=m.requests_per_min, prefill_tokens_per_s=m.prefill_tokens_per_s,
        decode_tokens_per_s=m.decode_tokens_per_s, prefix_hit_rate=m.prefix_hit_rate,
        ideal_prefix_hit_rate=m.ideal_prefix_hit_rate, tv_points=m.tv_points, tv_noise_points=m.tv_noise_points,
        preemptions=m.preemptions, mean_kv_usage=m.mean_kv_usage, mean_iteration_s=m.mean_iteration_s,
        converged=m.converged, warmup_ok=m.warmup_ok, window_start_s=m.window_start_s, measured_s=m.measured_s,
    )


def _row(role: str, kind: str, router: str, figs: list[SeedFigures]) -> CellRow | None:
    if not figs:
        return None
    figs = sorted(figs, key=lambda f: f.seed)
    return CellRow(role=role, kind=kind, router=router, seeds=figs,
                   mixture_rate=mean_interval([f.mixture_rate_per_min for f in figs]))


def _best_per_seed(figs: Iterable[SeedFigures], chosen: Mapping[int, int] | None = None,
                   value: Mapping[str, int] | None = None) -> list[SeedFigures]:
    """Per seed: the figures at ``chosen[seed]`` (a ceiling or limit via ``value``), or the best rate."""
    by_seed: dict[int, list[SeedFigures]] = {}
    for f in figs:
        by_seed.setdefault(f.seed, []).append(f)
    out = []
    for seed, group in by_seed.items():
        if chosen is not None and value is not None:
            pick = [f for f in group if value.get(f.key) == chosen.get(seed)]
            if pick:
                out.append(pick[0])
            continue
        out.append(max(group, key=lambda f: (f.mixture_rate_per_min, -f.ceiling)))
    return out


def summarise(specs: list[RunSpec], records: Mapping[str, RunRecord], s: BenchSettings,
              cells: list[Cell], tuned: Mapping[str, Mapping[str, Any]]) -> list[CellSummary]:
    """Rows per cell: each seed's oracle and every other baseline and policy against it."""
    by_cell: dict[Cell, list[tuple[RunSpec, RunRecord]]] = {}
    for sp in specs:
        if sp.steady_state and (k := sp.key(s)) in records:
            by_cell.setdefault(sp.cell(s), []).append((sp, records[k]))
    out: list[CellSummary] = []
    for cell in cells:
        mine = by_cell.get(cell, [])
        out.append(_cell_summary(cell, mine, records, s, tuned.get(cell.reference.id, {})))
    return out


def _cell_summary(cell: Cell, mine: list[tuple[RunSpec, RunRecord]], records: Mapping[str, RunRecord],
                  s: BenchSettings, ref_tuned: Mapping[str, Any]) -> CellSummary:
    sweep_figs = [(sp, _figures(sp, r, s)) for sp, r in mine if sp.baseline is Baseline.SWEEP]
    sweep_figs = list({(f.seed, f.ceiling): (sp, f) for sp, f in sweep_figs}.values())
    by_seed: dict[int, dict[int, SeedFigures]] = {}
    for _, f in sweep_figs:
        by_seed.setdefault(f.seed, {})[f.ceiling] = f
    rates = {seed: {c: f.mixture_rate_per_min for c, f in pts.items()} for seed, pts in by_seed.items()}
    oracle_c = {seed: pick_oracle(r) for seed, r in rates.items()}
    cell_c = best_on_mean(rates)
    rows: list[CellRow | None] = []
    if cell_c is not None:
        label = f"cache_aware @{cell_c} (best mean over seeds)"
        rows.append(_row(Baseline.ORACLE.value, "baseline", "cache-aware",
                         [pts[cell_c].model_copy(update={"label": label}) for pts in by_seed.values()]))
    per_seed_label = "cache_aware @" + "/".join(str(oracle_c[k]) for k in sorted(oracle_c)) + " (each seed's best)"
    rows.append(_row(Baseline.ORACLE_PER_SEED.value, "baseline", "cache-aware",
                     [by_seed[seed][c].model_copy(update={"label": per_seed_label}) for seed, c in oracle_c.items()]))

    def figs_of(b: Baseline) -> list[SeedFigures]:
        return [_figures(sp, r, s) for sp, r in mine if sp.baseline is b]

    if cell.is_reference:
        c = ref_tuned.get("ceiling")
        rows.append(_row(Baseline.TUNED_ONCE.value, "baseline", "cache-aware",
                         [pts[c] for pts in by_seed.values() if c in pts]))
        limit = ref_tuned.get("request_limit")
        lim_of = {r.key: sp.policy.concurrency_limit or 0 for sp, r in mine
                  if sp.baseline is Baseline.REQUEST_LIMIT}
        rows.append(_row(Baseline.REQUEST_LIMIT.value, "baseline", "cache-aware",
                         _best_per_seed(figs_of(Baseline.REQUEST_LIMIT), dict.fromkeys(by_seed, limit), lim_of)
                         if limit is not None else []))
    else:
        rows.append(_row(Baseline.TUNED_ONCE.value, "baseline", "cache-aware", figs_of(Baseline.TUNED_ONCE)))
        rows.append(_row(Baseline.REQUEST_LIMIT.value, "baseline", "cache-aware",
                         figs_of(Baseline.REQUEST_LIMIT)))
    high = s.high(cell.engines)
    rows.append(_row(Baseline.HIGH_LOAD.value, "baseline", "cache-aware",
                     [pts[high] for pts in by_seed.values() if high in pts]))
    bal = [(sp, r) for sp, r in mine if sp.baseline is Baseline.BALANCE_SMALL]
    pair = ref_tuned.get("balance")
    if pair is not None:
        bal = [(sp, r) for sp, r in bal if (sp.policy.cache_aware.balance_abs_threshold,
                                            sp.policy.cache_aware.balance_rel_threshold) == tuple(pair)]
    rows.append(_row(Baseline.BALANCE_SMALL.value, "baseline", "cache-aware",
                     [_figures(sp, r, s) for sp, r in bal]))
    variants = list(dict.fromkeys(sp.variant for sp, _ in mine if sp.baseline is Baseline.POLICY))
    for name in variants:
        figs = [_figures(sp, r, s) for sp, r in mine if sp.baseline is Baseline.POLICY and sp.variant == name]
        rows.append(_row(name, "policy", "misat", figs))
    kept = [r for r in rows if r is not None]
    by_role = {r.role: r for r in kept}
    for row in kept:
        against = RATIO_AGAINST if row.kind == "policy" else (Baseline.ORACLE,)
        mine_rates = {f.seed: f.mixture_rate_per_min for f in row.seeds}
        for b in against:
            ref = by_role.get(b.value)
            if ref is None:
                continue
            interval = paired_ratio(mine_rates, {f.seed: f.mixture_rate_per_min for f in ref.seeds})
            if interval is not None:
                per_seed = {f.seed: mine_rates[f.seed] / f.mixture_rate_per_min for f in ref.seeds
                            if f.seed in mine_rates and f.mixture_rate_per_min > 0}
                row.ratios[b.value] = RatioSummary(against=b.value, per_seed=per_seed, interval=interval,
                                                   verdict=verdict(interval))
    series = [SeriesSummary(role=row.role, seed=row.seeds[0].seed, window_s=rec.metrics.window_s,
                            window_start_s=rec.metrics.window_start_s,
                            end_s=rec.metrics.window_start_s + rec.metrics.measured_s,
                            points=rec.metrics.class_series)
              for row in kept if row.role in (Baseline.ORACLE.value, *variants)
              for rec in [records[row.seeds[0].key]]]
    case = workload_case(cell, s, s.seeds[0])
    return CellSummary(
        cell=cell.id, workload=cell.workload.value, mixture=cell.mixture, engines=cell.engines,
        description=case.description, seeds=sorted(by_seed), cell_oracle_ceiling=cell_c, oracle_ceiling=oracle_c,
        sweep=sorted((SweepPoint(seed=f.seed, value=f.ceiling, mixture_rate_per_min=f.mixture_rate_per_min,
                                 sample_rate_per_min=f.sample_rate_per_min, prefix_hit_rate=f.prefix_hit_rate,
                                 tv_points=f.tv_points, preemptions=f.preemptions, converged=f.converged)
                      for _, f in sweep_figs), key=lambda p: (p.seed, p.value)),
        rows=kept, series=series,
    )


ROW_ORDER: tuple[str, ...] = tuple(b.value for b in BASELINES_VLLM)
"""Baseline rows first (in this order), then the policies under test."""


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _ratio(row: CellRow, against: Baseline) -> str:
    r = row.ratios.get(against.value)
    if r is None:
        return "-"
    i = r.interval
    text = f"{i.mean:.2f}" if i.n < 2 else f"{i.mean:.2f} ({i.low:.2f}-{i.high:.2f})"
    return text if r.verdict is Verdict.ONE_RUN else f"{text} {r.verdict.value}"


def _cells_rows(cells: list[CellSummary]) -> list[list[str]]:
    out = []
    for cs in cells:
        for row in cs.rows:
            conv = row.converged
            out.append([
                cs.cell, row.role, row.label,
                f"{row.mixture_rate.mean:.1f}" + (f" ±{row.mixture_rate.high - row.mixture_rate.mean:.1f}"
                                                  if row.mixture_rate.n > 1 else ""),
                *(_ratio(row, b) for b in RATIO_AGAINST),
                _fmt(row.mean("sample_rate_per_min"), ".1f"), _fmt(row.mean("requests_per_min"), ".0f"),
                _fmt(row.mean("prefill_tokens_per_s"), ".0f"), _fmt(row.mean("decode_tokens_per_s"), ".0f"),
                _pct(row.mean("prefix_hit_rate")), _pct(row.mean("ideal_prefix_hit_rate")),
                _fmt(row.mean("preemptions"), ".0f"), _fmt(row.mean("tv_points"), ".2f"),
                _fmt(row.mean("tv_noise_points"), ".2f"), _fmt(row.mean("mean_iteration_s"), ".0f"),
                "-" if conv is None else ("yes" if conv else "NO"), str(len(row.seeds)),
            ])
    return out


TABLE_COLUMNS: tuple[str, ...] = (
    "cell", "row", "run", "mix-rate/min (±95%)", *(f"x {b.value}" for b in RATIO_AGAINST),
    "units/min", "req/min", "prefill tok/s", "decode tok/s", "hit", "ideal hit", "preempt", "TV pts",
    "TV noise", "iter s", "converged", "seeds",
)


def render_table(cells: list[CellSummary], http_rows: list[SummaryRow] | None = None) -> Any:
    """A rich table of every cell row, then the HTTP layer's rows."""
    from rich.table import Table

    table = Table(title="Mixture-constrained sample rate (units/min of simulated time), mean over seeds")
    for col in TABLE_COLUMNS:
        table.add_column(col, justify="left" if col in ("cell", "row", "run") else "right")
    last = ""
    for values in _cells_rows(cells):
        table.add_row(*(values if values[0] != last else ["", *values[1:]]))
        last = values[0]
    if http_rows:
        http = Table(title="HTTP layer (one run each; x ref: against the binary at the tuned ceiling)")
        for col in ("workload", "run", "units/min", "x ref", "prefix hit", "TV pts", "preempt", "keep-up"):
            http.add_column(col, justify="left" if col in ("workload", "run") else "right")
        for r in http_rows:
            http.add_row(r.workload, r.label, f"{r.sample_rate_per_min:.1f}", r.note or _fmt(r.ratio_to_oracle, ".2f"),
                         _pct(r.prefix_hit_rate), _fmt(r.tv_points, ".2f"), _fmt(r.preemptions, "d"),
                         _fmt(r.keep_up, ".3f"))
        from rich.console import Group

        return Group(table, http) if cells else http
    return table


def markdown_table(cells: list[CellSummary], goals: list[GoalResult] | None = None) -> str:
    """The rows as Markdown (for docs/benchmark.md), the goals first, then the sweeps."""
    lines: list[str] = []
    if goals:
        lines += ["| goal | target | measured | met |", "|---|---|---|---|"]
        lines += [f"| {g.goal} | {g.target} | {g.measured} | {'-' if g.met is None else ('yes' if g.met else 'no')} |"
                  for g in goals]
        lines.append("")
    lines += ["| " + " | ".join(TABLE_COLUMNS) + " |",
              "|" + "|".join("---" if c in ("cell", "row", "run") else "---:" for c in TABLE_COLUMNS) + "|"]
    lines += ["| " + " | ".join(v) + " |" for v in _cells_rows(cells)]
    lines += ["", "Oracle sweeps (mixture-constrained units/min per seed; [oracle] = the cell's best ceiling on "
              "the mean over seeds; * = a seed's own best):", ""]
    for cs in cells:
        ceilings = sorted({p.value for p in cs.sweep})
        lines += [f"{cs.cell}: " + "; ".join(
            f"@{c}{' [oracle]' if c == cs.cell_oracle_ceiling else ''} " + "/".join(
                f"{p.mixture_rate_per_min:.1f}" + ("*" if cs.oracle_ceiling.get(p.seed) == c else "")
                for p in cs.sweep if p.value == c) for c in ceilings)]
    return "\n".join(lines)


PLOT_HEADROOM: float = 1.3
"""The sweep plot's y axis ends this far above its highest point or mean."""


def plot_cell(cs: CellSummary, path: Path) -> None:
    """PNG for one cell: the oracle sweep of every seed with every row on it; the per-class time series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ts) = plt.subplots(1, 2, figsize=(12, 4.2))
    seeds = sorted({p.seed for p in cs.sweep})
    for seed in seeds:
        pts = sorted((p.value, p.mixture_rate_per_min) for p in cs.sweep if p.seed == seed)
        ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", alpha=0.6, color="tab:blue",
                label="cache_aware sweep (one line per seed)" if seed == seeds[0] else None)
    for i, row in enumerate(cs.rows):
        colour = f"C{i % 10}"
        mean = row.mixture_rate
        if row.kind == "policy":
            ax.axhspan(mean.low, mean.high, color=colour, alpha=0.15)
            ax.axhline(mean.mean, color=colour, ls="--", label=f"{row.role} (mean, 95% band)")
        else:
            ax.plot([f.ceiling for f in row.seeds], [f.mixture_rate_per_min for f in row.seeds], "s", color=colour,
                    label=row.role)
    ax.set_xscale("log", base=2)
    ax.set_title(f"{cs.cell}: oracle sweep and rows")
    ax.set_xlabel("trainer ceiling (units in flight)")
    ax.set_ylabel("mixture-constrained units / min")
    points = [p.mixture_rate_per_min for p in cs.sweep] + [r.mixture_rate.mean for r in cs.rows]
    ax.set_ylim(0, PLOT_HEADROOM * max(points, default=1.0) or 1.0)  # a wide band (n = 2) must not flatten the rest
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    styles = ["-", "--", ":", "-."]
    for i, ser in enumerate(cs.series):
        classes = sorted({c for _, counts in ser.points for c in counts})
        for j, c in enumerate(classes):
            ts.plot([t for t, _ in ser.points], [60.0 * counts.get(c, 0) / ser.window_s for _, counts in ser.points],
                    ls=styles[i % len(styles)], color=f"C{j}", label=f"{ser.role} s{ser.seed} {c}")
        ts.axvline(ser.window_start_s, color="grey", ls=styles[i % len(styles)], lw=0.8)
    ts.set_title("completions per class (units/min per window; grey: warm-up end)")
    ts.set_xlabel("simulated s")
    ts.set_ylabel("units / min")
    ts.grid(alpha=0.3)
    ts.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
