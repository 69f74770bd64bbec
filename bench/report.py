"""Benchmark figures: summary rows, the result JSON model, the rich table and the PNG plot.

Why apart from the runners: the arithmetic that turns runs into claims (which
sweep point is the oracle, every ratio against it) is pure and unit-tested,
and the JSON schema is one pydantic model that tests and docs can point to.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from misat_bench.cluster_runs import RunRecord
from misat_bench.suite import (
    BASELINES_VLLM,
    MISAT_MODES,
    Baseline,
    BenchSettings,
    pick_oracle,
)

SCHEMA_VERSION: int = 1
"""Bumped when a field of ``BenchResult`` changes meaning."""

ROW_ORDER: tuple[Baseline, ...] = (*BASELINES_VLLM, *MISAT_MODES, Baseline.FOOTPRINT)
"""Rows per workload, baselines first, then this router's modes."""


class SummaryRow(BaseModel):
    """One line of the table: a baseline or mode on one workload."""

    model_config = ConfigDict(extra="forbid")
    layer: str = "cluster"
    workload: str
    baseline: str
    label: str
    router: str
    ceiling: int | None
    sample_rate_per_min: float
    ratio_to_oracle: float | None = Field(description="sample rate / this workload's oracle, same run set")
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


NOT_A_COMPARISON: str = "not a comparison"
"""How a figure from engines that could not keep up is marked in the table."""


class SweepPoint(BaseModel):
    """One point of a sweep (trainer ceiling or router request limit)."""

    model_config = ConfigDict(extra="forbid")
    value: int
    sample_rate_per_min: float
    prefix_hit_rate: float
    tv_points: float
    preemptions: int


class WorkloadSummary(BaseModel):
    """Per workload: the oracle sweep in full and the rows."""

    model_config = ConfigDict(extra="forbid")
    workload: str
    description: str = ""
    oracle_ceiling: int | None
    oracle_rate_per_min: float | None
    ceiling_sweep: list[SweepPoint]
    request_limit_sweep: list[SweepPoint] = Field(default_factory=list)
    rows: list[SummaryRow]


class BenchResult(BaseModel):
    """The whole result file (``out/bench/result.json``)."""

    model_config = ConfigDict(extra="forbid")
    schema_version: int = SCHEMA_VERSION
    created_at: str = Field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    command: str = ""
    settings: BenchSettings
    tuned: dict[str, Any] = Field(default_factory=dict, description="values tuned on steady and reused")
    workloads: list[WorkloadSummary] = Field(default_factory=list)
    runs: list[RunRecord] = Field(default_factory=list)
    http: dict[str, Any] | None = None
    cpu_s_total: float = 0.0


def _point(value: int, r: RunRecord) -> SweepPoint:
    m = r.metrics
    return SweepPoint(value=value, sample_rate_per_min=m.sample_rate_per_min, prefix_hit_rate=m.prefix_hit_rate,
                      tv_points=m.tv_points, preemptions=m.preemptions)


def _row(r: RunRecord, baseline: Baseline, oracle_rate: float | None, label: str | None = None) -> SummaryRow:
    m = r.metrics
    return SummaryRow(
        workload=r.spec.workload.value, baseline=baseline.value, label=label or r.spec.label, router=r.spec.router,
        ceiling=r.spec.ceiling, sample_rate_per_min=m.sample_rate_per_min,
        ratio_to_oracle=(m.sample_rate_per_min / oracle_rate) if oracle_rate else None,
        prefix_hit_rate=m.prefix_hit_rate, tv_points=m.tv_points, preemptions=m.preemptions,
        mean_iteration_s=m.mean_iteration_s, mean_kv_usage=m.mean_kv_usage,
    )


def best_by_rate(records: list[RunRecord]) -> RunRecord | None:
    """The record with the highest sample rate (ties: the first listed)."""
    best: RunRecord | None = None
    for r in records:
        if best is None or r.metrics.sample_rate_per_min > best.metrics.sample_rate_per_min:
            best = r
    return best


def summarise(records: list[RunRecord], s: BenchSettings, descriptions: dict[str, str] | None = None
              ) -> list[WorkloadSummary]:
    """Rows per workload: the oracle (best sweep point) and every other baseline and mode against it."""
    out: list[WorkloadSummary] = []
    for w in s.workloads:
        mine = [r for r in records if r.spec.workload is w]
        sweep = {r.spec.ceiling: r for r in mine if r.spec.baseline is Baseline.SWEEP}
        oracle_c = pick_oracle({c: r.metrics.sample_rate_per_min for c, r in sweep.items()}) if sweep else None
        oracle_rate = sweep[oracle_c].metrics.sample_rate_per_min if oracle_c is not None else None
        rows: list[SummaryRow] = []
        limits: list[SweepPoint] = []
        for b in ROW_ORDER:
            if b is Baseline.ORACLE:
                if oracle_c is not None:
                    rows.append(_row(sweep[oracle_c], b, oracle_rate, f"cache_aware @{oracle_c} (best of sweep)"))
                continue
            if b is Baseline.HIGH_LOAD:
                if s.high_ceiling in sweep:
                    rows.append(_row(sweep[s.high_ceiling], b, oracle_rate, f"cache_aware @{s.high_ceiling}"))
                continue
            group = [r for r in mine if r.spec.baseline is b]
            if b is Baseline.REQUEST_LIMIT:
                limits = sorted((_point(r.spec.policy.concurrency_limit or 0, r) for r in group),
                                key=lambda p: p.value)
            if b is Baseline.FOOTPRINT:
                rows.extend(_row(r, b, oracle_rate) for r in group)
                continue
            best = best_by_rate(group)
            if best is not None:
                label = best.spec.label + (f" (best of {len(group)})" if len(group) > 1 else "")
                rows.append(_row(best, b, oracle_rate, label))
        out.append(WorkloadSummary(
            workload=w.value, description=(descriptions or {}).get(w.value, ""), oracle_ceiling=oracle_c,
            oracle_rate_per_min=oracle_rate,
            ceiling_sweep=[_point(c, sweep[c]) for c in sorted(sweep)], request_limit_sweep=limits, rows=rows,
        ))
    return out


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def render_table(summaries: list[WorkloadSummary], http_rows: list[SummaryRow] | None = None) -> Any:
    """A rich table of every row (one section per workload)."""
    from rich.table import Table

    table = Table(title="MISA-T vs vLLM Router cache_aware (sample rate in units/min of simulated time)")
    columns = [("layer", "left"), ("workload", "left"), ("baseline / mode", "left"), ("run", "left"),
               ("units/min", "right"), ("x oracle", "right"), ("prefix hit", "right"),
               ("TV pts", "right"), ("preempt", "right"), ("iter s", "right")]
    if http_rows:
        columns.append(("keep-up", "right"))
    for col, justify in columns:
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    tail: list[str] = ["-"] if http_rows else []  # the cluster layer runs in virtual time
    for ws in summaries:
        for i, r in enumerate(ws.rows):
            table.add_row(r.layer, ws.workload if i == 0 else "", r.baseline, r.label,
                          f"{r.sample_rate_per_min:.1f}", _fmt(r.ratio_to_oracle, ".2f"),
                          _fmt(None if r.prefix_hit_rate is None else 100 * r.prefix_hit_rate, ".1f") + "%",
                          _fmt(r.tv_points, ".2f"), _fmt(r.preemptions, "d"), _fmt(r.mean_iteration_s, ".0f"),
                          *tail, end_section=i == len(ws.rows) - 1)
    for r in http_rows or []:
        table.add_row(r.layer, r.workload, r.baseline, r.label, f"{r.sample_rate_per_min:.1f}",
                      r.note or _fmt(r.ratio_to_oracle, ".2f"),
                      _fmt(None if r.prefix_hit_rate is None else 100 * r.prefix_hit_rate, ".1f") + "%",
                      _fmt(r.tv_points, ".2f"), _fmt(r.preemptions, "d"), _fmt(r.mean_iteration_s, ".0f"),
                      _fmt(r.keep_up, ".3f"))
    return table


def markdown_table(summaries: list[WorkloadSummary]) -> str:
    """The same rows as a Markdown table (for docs/benchmark.md)."""
    lines = ["| workload | baseline / mode | run | units/min | x oracle | prefix hit | TV pts | preempt | iter s |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for ws in summaries:
        for r in ws.rows:
            hit = "-" if r.prefix_hit_rate is None else f"{100 * r.prefix_hit_rate:.1f}%"
            lines.append(f"| {ws.workload} | {r.baseline} | {r.label} | {r.sample_rate_per_min:.1f} | "
                         f"{_fmt(r.ratio_to_oracle, '.2f')} | {hit} | {_fmt(r.tv_points, '.2f')} | "
                         f"{_fmt(r.preemptions, 'd')} | {_fmt(r.mean_iteration_s, '.0f')} |")
    return "\n".join(lines)


def plot(summaries: list[WorkloadSummary], path: Path) -> None:
    """PNG: per workload, the cache_aware ceiling sweep with every other row as a marker or line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(summaries)
    cols = min(3, max(1, n))
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    styles = {Baseline.MISA_T.value: ("tab:red", "-"), Baseline.MISA.value: ("tab:orange", "--"),
              Baseline.SESSION_ADMISSION.value: ("tab:green", ":")}
    for ax, ws in zip(axes.flat, summaries, strict=False):
        xs = [p.value for p in ws.ceiling_sweep]
        ys = [p.sample_rate_per_min for p in ws.ceiling_sweep]
        ax.plot(xs, ys, "o-", color="tab:blue", label="cache_aware, trainer ceiling swept")
        for r in ws.rows:
            if r.baseline in styles:
                color, ls = styles[r.baseline]
                ax.axhline(r.sample_rate_per_min, color=color, ls=ls, label=f"{r.baseline} @{r.ceiling}")
            elif r.baseline == Baseline.ORACLE.value:
                ax.plot([r.ceiling], [r.sample_rate_per_min], "*", ms=14, color="tab:blue", label="oracle")
            elif r.baseline == Baseline.TUNED_ONCE.value:
                ax.plot([r.ceiling], [r.sample_rate_per_min], "s", color="black", label="tuned-once")
            elif r.baseline == Baseline.REQUEST_LIMIT.value:
                ax.plot([r.ceiling], [r.sample_rate_per_min], "v", color="purple", label="request-limit")
        ax.set_xscale("log", base=2)
        ax.set_title(ws.workload)
        ax.set_xlabel("trainer ceiling (units in flight)")
        ax.set_ylabel("units / min")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    legend: dict[str, Any] = {}
    for ax in axes.flat:
        for handle, text in zip(*ax.get_legend_handles_labels(), strict=True):
            legend.setdefault(text, handle)
    fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
