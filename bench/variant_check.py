"""Policy variants on benchmark v2's matrix, against the oracle points that matrix found (not a test).

Why: the whole suite (``misat bench``) sweeps every cell's oracle again, about
five CPU-hours on the project's 2-core machine. Its sweeps are deterministic,
so once they have run, judging another policy variant needs only that
variant's runs and, per cell and seed, the one oracle ceiling the sweep
chose: this tool re-runs that ceiling (and tuned-once's on the changing
workloads) through the suite's own run function and cache keys, so a later
``misat bench`` with the same ``--out`` reuses every run, and each oracle
point can be checked against the published table.

``python -P -m misat_bench.variant_check --policies session-admission,misa-t``
prints, per cell, the mixture-constrained rate's paired ratio to the oracle
and to tuned-once (mean and 95% interval over the seeds), prefix hit against
the ideal, TV against the sampling noise, and the mean (with its interval,
paired by seed) and worst cell, each said met or not against the issue's
goal: the inputs of the rule that picks the default (docs/policy.md). When the default
(``session-admission``) is listed with other variants, a last table pairs
each with it, cell by cell: whether two candidates tie under the rule.

``--against-default CELLS`` (e.g. the 16-engine family, whose oracle sweeps cost CPU-hours):
each variant and the default (``session-admission``) at the cell's high ceiling on the same
seeded sessions, and each variant's ratio to the default paired by seed; no oracle point runs.

``--held-out SEEDS`` (seeds other than 0, 1, 2): every tuned value was chosen on seeds 0, 1, 2 (each
cell's oracle ceiling, tuned-once, the request limit, and the default policy by docs/policy.md's
rule), so each is the best of several noisy candidates there, and its figures on those seeds carry
that selection. On new seeds (new sessions) the cell's oracle ceiling and tuned-once run beside the
variants, and every ratio is out of sample: what a user who tuned on earlier runs gets.

The oracle is the cell's (``misat bench``'s ``oracle`` row): the ceiling with
the best mean over seeds. v2's sweeps refined around each seed's best point,
so here every seed runs at each of the three per-seed best ceilings v2 found,
then at midpoints around the best of their means (``refine_ceilings``) inside
their span, to steps of 8: if each seed's rate is concave in the ceiling, the
best ceiling of the mean lies between the seeds' own best ones. The per-seed
oracle (each seed at its own v2 best) is reported beside it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from pathlib import Path

from misat_bench.cluster_runs import RunCache, RunMetrics, RunRecord, run_all
from misat_bench.goals import EVERY_CELL_VS_ORACLE, MEAN_VS_ORACLE, paired_mean, rounds_onto
from misat_bench.stats import Interval, Verdict, paired_ratio, verdict
from misat_bench.steady_state import measured_steady
from misat_bench.suite import (
    CHANGING_WORKLOADS,
    POLICY_VARIANTS,
    Baseline,
    BenchSettings,
    Cell,
    RunSpec,
    _spec,
    best_on_mean,
    cache_aware,
    means_over_seeds,
    plan_sweep_points,
    refine_ceilings,
    sweep_run,
)

V2_ORACLE_CEILINGS: dict[str, tuple[int, ...]] = {
    "steady@paper:4": (200, 192, 200),
    "steady@agentic70:4": (184, 176, 176),
    "steady@rlvr70:4": (440, 320, 240),
    "steady@rlhf70:4": (288, 280, 288),
    "steady@agentic10:4": (488, 272, 288),
    "steady@rlvr10:4": (232, 240, 216),
    "steady@rlhf10:4": (192, 224, 192),
    "length-drift@paper:4": (288, 144, 176),
    "mix-shift@paper:4": (160, 160, 176),
    "iterations@paper:4": (224, 336, 224),
    "kv-half@paper:4": (96, 104, 112),
    "kv-double@paper:4": (408, 448, 416),
    # The large fleet's seven steady cells (docs/benchmark.md, "The oracle per cell"): only with
    # --cells, since the twelve above are the matrix the rule is read on.
    "steady@paper:16": (816, 776, 768),
    "steady@rlvr70:16": (1008, 920, 1504),
    "steady@rlhf70:16": (1240, 1216, 1192),
    "steady@agentic10:16": (928, 1152, 1536),
    "steady@rlhf10:16": (848, 800, 800),
    "steady@rlvr10:16": (864, 872, 880),
    "steady@agentic70:16": (744, 784, 704),
}
"""Each cell's oracle ceiling per seed (0, 1, 2) as benchmark v2 found it (docs/benchmark.md,
"Results (v2)": the oracle rows' "each seed's best")."""
CELL_ORACLE_CEILINGS: dict[str, int] = {
    "steady@paper:4": 200,
    "steady@agentic70:4": 176,
    "steady@rlvr70:4": 240,
    "steady@rlhf70:4": 280,
    "steady@agentic10:4": 272,
    "steady@rlvr10:4": 232,
    "steady@rlhf10:4": 192,
    "length-drift@paper:4": 152,
    "mix-shift@paper:4": 160,
    "kv-half@paper:4": 112,
    "kv-double@paper:4": 416,
    "iterations@paper:4": 224,
    "steady@paper:16": 816,
    "steady@rlvr70:16": 952,
    "steady@rlhf70:16": 1240,
    "steady@agentic10:16": 1152,
    "steady@rlhf10:16": 800,
    "steady@rlvr10:16": 880,
    "steady@agentic70:16": 712,
}
"""Each cell's oracle as ``--cell-oracle`` found it on the seeds of ``V2_ORACLE_CEILINGS`` (0, 1, 2):
the ``cache_aware`` ceiling with the best mean over them (docs/benchmark.md, "The oracle per cell"
and "The default on 16 engines"). ``--held-out`` runs it on other seeds."""
TUNED_SEEDS: tuple[int, ...] = (0, 1, 2)
"""The seeds every tuned value here was chosen on: the oracle ceilings, tuned-once, the request
limit, and the default policy itself (docs/policy.md's rule read the matrix on them)."""
MATRIX_ENGINES = 4
"""The cells the default is chosen on (without ``--cells``): the twelve on this many engines."""
V2_TUNED_ONCE_CEILING = 200
"""tuned-once in v2: steady@paper:4's best ceiling on the mean over seeds."""
V2_TUNED_REQUEST_LIMIT = 256
"""request-limit in v2: the router request limit (cache_aware at the high ceiling) that was best on
steady@paper:4's mean over seeds, then run unchanged on every cell."""
TUNED_REQUEST_LIMITS: dict[int, int] = {MATRIX_ENGINES: V2_TUNED_REQUEST_LIMIT, 16: 1024}
"""request-limit per fleet size: tuned on that fleet's steady@paper (16 engines: ``misat bench
--cells steady@paper:16``, docs/benchmark.md), as the suite's request-limit row runs it."""


def select_cells(wanted: list[str]) -> tuple[BenchSettings, list[Cell]]:
    """The suite's settings and cells for ``wanted`` cell ids (each in ``V2_ORACLE_CEILINGS``); none
    wanted: the twelve cells on ``MATRIX_ENGINES`` engines. Large-fleet cells come with the settings
    that make them (``--large-fleet`` and ``--large-fleet-mixtures`` in ``misat bench``)."""
    engines = {int(c.rpartition(":")[2]) for c in wanted} - {MATRIX_ENGINES}
    mixtures = {c.partition("@")[2].partition(":")[0] for c in wanted if not c.endswith(f":{MATRIX_ENGINES}")}
    s = BenchSettings(large_fleet_engines=tuple(sorted(engines)),
                      large_fleet_mixtures=tuple(sorted(mixtures)) or ("paper",))
    if not wanted:
        return s, [c for c in s.cells() if c.engines == MATRIX_ENGINES and c.id in V2_ORACLE_CEILINGS]
    return s, [c for c in s.cells() if c.id in wanted]


def baseline_runs(s: BenchSettings, cells: list[Cell]) -> list[RunSpec]:
    """The oracle point of every cell and seed, and tuned-once on the changing workloads."""
    runs: list[RunSpec] = []
    for cell in cells:
        for seed, ceiling in zip(s.seeds, V2_ORACLE_CEILINGS[cell.id], strict=True):
            runs.append(sweep_run(cell, seed, ceiling))
            runs += tuned_once_runs(cell, (seed,))
    return runs


def tuned_once_runs(cell: Cell, seeds: tuple[int, ...]) -> list[RunSpec]:
    """tuned-once (``cache_aware`` at v2's steady@paper:4 best) on ``seeds``; changing workloads only."""
    if cell.workload not in CHANGING_WORKLOADS:
        return []
    return [_spec(cell, seed, Baseline.TUNED_ONCE, cache_aware(), V2_TUNED_ONCE_CEILING,
                  f"cache_aware @{V2_TUNED_ONCE_CEILING} (tuned-once)") for seed in seeds]


def held_out_settings(s: BenchSettings, seeds: tuple[int, ...]) -> BenchSettings:
    """``s`` on ``seeds``, which must be new: none of ``TUNED_SEEDS``, where every tuned value was chosen."""
    reused = sorted(set(seeds) & set(TUNED_SEEDS))
    if reused:
        raise ValueError(f"held-out seeds must be new: {', '.join(map(str, reused))} "
                         f"{'is' if len(reused) == 1 else 'are'} among the seeds the oracle ceilings, "
                         f"tuned-once and the default were chosen on ({', '.join(map(str, TUNED_SEEDS))})")
    if not seeds:
        raise ValueError("no held-out seed given")
    return s.model_copy(update={"seeds": tuple(seeds)})


def held_out_runs(s: BenchSettings, cells: list[Cell]) -> list[RunSpec]:
    """Every cell's oracle ceiling (``CELL_ORACLE_CEILINGS``) and tuned-once on each of ``s.seeds``
    (held-out seeds): the tuned baselines as a user gets them, tuned on other sessions."""
    runs: list[RunSpec] = []
    for cell in cells:
        ceiling = CELL_ORACLE_CEILINGS.get(cell.id)
        if ceiling is None:
            raise ValueError(f"no cell oracle for {cell.id!r}; known: {', '.join(CELL_ORACLE_CEILINGS)}")
        runs += [sweep_run(cell, seed, ceiling) for seed in s.seeds]
        runs += tuned_once_runs(cell, s.seeds)
    return runs


CELL_ORACLE_MAX_POINTS = 8
"""Ceilings added around the best mean at most, per cell (each round adds <= 2)."""


def cell_oracle_runs(s: BenchSettings, cell: Cell, rate: Callable[[RunSpec], float | None],
                     max_points: int = CELL_ORACLE_MAX_POINTS) -> tuple[list[RunSpec], int | None]:
    """The runs that find the cell's oracle ceiling (best mean over seeds) from v2's per-seed best
    ceilings, and that ceiling once every run is known (``rate``); call again after running them."""
    candidates = sorted(set(V2_ORACLE_CEILINGS[cell.id]))
    low, high = candidates[0], candidates[-1]
    per_seed: dict[int, dict[int, float]] = {seed: {} for seed in s.seeds}
    specs: list[RunSpec] = []
    if not plan_sweep_points(cell, per_seed, candidates, rate, specs):
        return specs, None
    added = 0
    while added < max_points:
        extra = [c for c in refine_ceilings(means_over_seeds(per_seed)) if low < c < high][: max_points - added]
        if not extra:
            break
        if not plan_sweep_points(cell, per_seed, extra, rate, specs):
            return specs, None
        added += len(extra)
    return specs, best_on_mean(per_seed)


def limit_runs(s: BenchSettings, cells: list[Cell]) -> list[RunSpec]:
    """request-limit (v2's tuned limit) and high-load (no limit) at each cell's high ceiling, every seed:
    the baselines of the 2x goals, paired by seed with the variants (``--limits``)."""
    runs: list[RunSpec] = []
    for cell in cells:
        high = s.high(cell.engines)
        limit = TUNED_REQUEST_LIMITS.get(cell.engines)
        if limit is None:
            raise SystemExit(f"variant_check: no tuned request limit for {cell.engines} engines "
                             f"(known: {', '.join(map(str, TUNED_REQUEST_LIMITS))})")
        for seed in s.seeds:
            runs.append(_spec(cell, seed, Baseline.REQUEST_LIMIT, cache_aware(limit=limit), high,
                              f"cache_aware limit {limit} @{high} (tuned on steady@paper:{cell.engines})"))
            runs.append(_spec(cell, seed, Baseline.HIGH_LOAD, cache_aware(), high, f"cache_aware @{high}"))
    return runs


def variant_runs(s: BenchSettings, cells: list[Cell], policies: list[str]) -> list[RunSpec]:
    """Each policy at the cell's high ceiling, as the suite runs it."""
    return [_spec(cell, seed, Baseline.POLICY, POLICY_VARIANTS[p], s.high(cell.engines), f"{p} @{s.high(cell.engines)}",
                  variant=p)
            for cell in cells for seed in s.seeds for p in policies]


def _with_verdict(i: Interval | None) -> str:
    return f"{i.describe()} {verdict(i).value}" if i is not None else "-"


def _by_seed(mine: dict[int, float], other: dict[int, float]) -> dict[int, float]:
    """The ratio ``mine / other`` on each seed both have (the pairing of ``paired_ratio``)."""
    return {k: v / other[k] for k, v in mine.items() if k in other and other[k] > 0}


def _seed_interval(per_cell: list[dict[int, float]]) -> str:
    """`` (low-high over n seeds)``: the interval of a mean over cells, paired by seed; empty when
    the cells share fewer than two seeds."""
    i = paired_mean(per_cell)
    return "" if i is None or i.n < 2 else f" ({i.low:.3f}-{i.high:.3f} over {i.n} seeds)"


def _goal_verdict(measured: float, target: float) -> str:
    """``measured`` against a goal of at least ``target``, said with the unrounded figure when rounding
    to the report's three decimals would hide which side of the goal it falls."""
    met = measured >= target
    unrounded = f": {measured:.5f}x" if rounds_onto(measured, target, 3) else ""
    return f"goal >= {target:g}x {'met' if met else 'not met'}{unrounded}"


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def report(s: BenchSettings, cells: list[Cell], policies: list[str], records: dict[str, RunRecord],
           limits: bool = False, cell_oracle: dict[str, int] | None = None, held_out: bool = False) -> str:
    """The per-cell table and the rule's inputs, per policy, as markdown (with ``limits``, the paired
    ratios to request-limit and high-load too; with ``cell_oracle`` (cell id -> ceiling), the oracle
    is each cell's best ceiling on the mean over seeds and v2's per-seed oracle is a column beside it;
    with ``held_out``, ``s.seeds`` are new seeds, ``cell_oracle`` is run on them, and there is no per-seed
    column)."""
    def rates(specs: list[RunSpec]) -> dict[int, float]:
        return {sp.seed_of(s): records[k].metrics.mixture_rate_per_min for sp in specs if (k := sp.key(s)) in records}

    per_cell_oracle = cell_oracle is not None and not held_out
    out: list[str] = []
    for p in policies:
        out += [f"### {p}", "",
                "| cell | mix-rate/min | oracle | x oracle |" + (" x oracle per seed |" if per_cell_oracle else "")
                + " x tuned-once | hit | ideal hit | TV pts | TV noise |"
                + (" x request-limit | x high-load |" if limits else ""),
                "|---|---:|---:|---|" + ("---|" if per_cell_oracle else "") + "---|---:|---:|---:|---:|"
                + ("---|---|" if limits else "")]
        figures: list[str] = []
        ratios: list[tuple[str, Interval]] = []
        per_seed_ratios: list[tuple[str, Interval]] = []
        # Per cell, the ratio on each seed: the means over cells are paired by seed (goals.paired_mean),
        # so each has an interval over the seeds, as the issue's goals ask.
        oracle_by_seed: list[dict[int, float]] = []
        once_by_seed: list[dict[int, float]] = []
        limit_by_seed: dict[Baseline, list[dict[int, float]]] = {Baseline.REQUEST_LIMIT: [], Baseline.HIGH_LOAD: []}
        for cell in cells:
            mine_specs = variant_runs(s, [cell], [p])
            mine = rates(mine_specs)
            per_seed_text = ""
            once = rates(tuned_once_runs(cell, s.seeds))
            # v2's per-seed oracles belong to the tuned seeds: none on held-out ones.
            oracle_specs = [] if held_out else [b for b in baseline_runs(s, [cell]) if b.baseline is Baseline.SWEEP]
            per_seed_oracle = rates(oracle_specs)
            oracle = per_seed_oracle
            if cell_oracle is not None:
                ceiling = cell_oracle.get(cell.id)
                oracle_specs = [sweep_run(cell, seed, ceiling) for seed in s.seeds] if ceiling else []
                oracle = rates(oracle_specs)
                if per_cell_oracle:
                    ps = paired_ratio(mine, per_seed_oracle)
                    if ps is not None:
                        per_seed_ratios.append((cell.id, ps))
                    per_seed_text = f" {_with_verdict(ps)} |"
            r = paired_ratio(mine, oracle)
            if r is None or not mine:
                out.append(f"| {cell.id} | not run | | | | | | | |")
                continue
            ratios.append((cell.id, r))
            oracle_by_seed.append(_by_seed(mine, oracle))
            t = paired_ratio(mine, once) if once else None
            if t is not None:
                once_by_seed.append(_by_seed(mine, once))
            m = [records[sp.key(s)].metrics for sp in mine_specs if sp.key(s) in records]
            figures += _figure_rows(cell.id, m, [records[k].metrics for sp in oracle_specs
                                                 if (k := sp.key(s)) in records])
            extra = ""
            if limits:
                cell_limits = limit_runs(s, [cell])
                for which, by_seed in limit_by_seed.items():
                    limited = rates([b for b in cell_limits if b.baseline is which])
                    lr = paired_ratio(mine, limited)
                    if lr is not None:
                        by_seed.append(_by_seed(mine, limited))
                    extra += f" {_with_verdict(lr)} |"
            out.append(
                f"| {cell.id} | {_mean(list(mine.values())):.1f} | {_mean(list(oracle.values())):.1f} | "
                f"{_with_verdict(r)} |{per_seed_text} {t.describe() if t else '-'} | "
                f"{100 * _mean([x.prefix_hit_rate for x in m]):.1f}% | "
                f"{100 * _mean([x.ideal_prefix_hit_rate for x in m]):.1f}% | "
                f"{_mean([x.tv_points for x in m]):.2f} | {_mean([x.tv_noise_points for x in m]):.2f} |" + extra)
        if ratios:
            worst = min(ratios, key=lambda x: x[1].mean)
            mean = _mean([r.mean for _, r in ratios])
            # The goals' verdicts on the unrounded figures: a mean of 1.02997 prints as 1.030.
            line = (f"Mean over {len(ratios)} cells {mean:.3f}x{_seed_interval(oracle_by_seed)} "
                    f"({_goal_verdict(mean, MEAN_VS_ORACLE)}), "
                    f"worst {worst[0]} {worst[1].mean:.3f}x ({_goal_verdict(worst[1].mean, EVERY_CELL_VS_ORACLE)})")
            if held_out:
                line += (f" (held-out seeds {', '.join(map(str, s.seeds))}; oracle: each cell's ceiling "
                         f"chosen on seeds {', '.join(map(str, TUNED_SEEDS))})")
            if per_seed_ratios:
                ps_worst = min(per_seed_ratios, key=lambda x: x[1].mean)
                line += (f" (oracle: each cell's best ceiling on the mean over seeds); against the per-seed oracle "
                         f"mean {_mean([r.mean for _, r in per_seed_ratios]):.3f}x, worst {ps_worst[0]} "
                         f"{ps_worst[1].mean:.3f}x")
            if once_by_seed:
                once_mean = _mean([_mean(list(d.values())) for d in once_by_seed])
                line += f"; x tuned-once over the changing cells {once_mean:.3f}x{_seed_interval(once_by_seed)}"
            for which, by_seed in limit_by_seed.items():
                if by_seed:
                    line += (f"; x {which.value} over {len(by_seed)} cells "
                             f"{_mean([_mean(list(d.values())) for d in by_seed]):.3f}x{_seed_interval(by_seed)} "
                             "(mean of paired ratios)")
            out += ["", line + "."]
        if figures:
            out += ["", *FIGURES_HEADER, *figures]
        out.append("")
    if cell_oracle is not None:
        out += _baselines_against_oracle(s, cells, cell_oracle, limits, rates)
    out += _paired_with_default(s, cells, policies, rates)
    out += ["", _steadiness_line(s, records)]
    return "\n".join(out)


def _steadiness_line(s: BenchSettings, records: Mapping[str, RunRecord]) -> str:
    """Whether every run measured steady state; else each one that did not, by name. Their figures
    stay in the tables as measured: a reader weighs them, nothing drops them silently."""
    unsteady = sorted((r.spec.cell(s).id, r.spec.seed_of(s), r.spec.label) for r in records.values()
                      if not measured_steady(r.metrics.converged, r.metrics.warmup_ok))
    if not unsteady:
        return f"Every run's window was steady state ({len(records)} runs)."
    named = "; ".join(f"{cell} seed {seed} {label}" for cell, seed, label in unsteady)
    return (f"NOT CONVERGED: {len(unsteady)} of {len(records)} runs reached the cap before their warm-up rule "
            f"was met or their classes converged (their figures are in the tables as measured): {named}.")


def _baselines_against_oracle(s: BenchSettings, cells: list[Cell], cell_oracle: dict[str, int], limits: bool,
                              rates: Callable[[list[RunSpec]], dict[int, float]]) -> list[str]:
    """What each static setting costs: tuned-once (the changing cells), request-limit and high-load
    (with ``limits``) over the cell's oracle, paired by seed. Empty when none of them ran."""
    rows: list[str] = []
    for cell in cells:
        ceiling = cell_oracle.get(cell.id)
        oracle = rates([sweep_run(cell, seed, ceiling) for seed in s.seeds]) if ceiling else {}
        if not oracle:
            continue
        shown = [paired_ratio(rates(tuned_once_runs(cell, s.seeds)), oracle)]
        if limits:
            cell_limits = limit_runs(s, [cell])
            shown += [paired_ratio(rates([b for b in cell_limits if b.baseline is which]), oracle)
                      for which in (Baseline.REQUEST_LIMIT, Baseline.HIGH_LOAD)]
        if any(r is not None for r in shown):
            rows.append(f"| {cell.id} | " + " | ".join(_with_verdict(r) for r in shown) + " |")
    if not rows:
        return []
    return ["### The baselines against the cell's oracle", "",
            "| cell | tuned-once |" + (" request-limit | high-load |" if limits else ""),
            "|---|---|" + ("---|---|" if limits else ""), *rows, ""]


FIGURES_HEADER = (
    "The figures beside the rate, the policy over the oracle on the same seeds (means over seeds; "
    "iteration s on iteration cells only):",
    "",
    "| cell | units/min | requests/min | prefill tok/s | decode tok/s | preemptions per run | mean KV use "
    "| iteration s |",
    "|---|---|---|---|---|---|---|---|",
)


def _figure_rows(cell_id: str, mine: list[RunMetrics], oracle: list[RunMetrics]) -> list[str]:
    """One row of ``FIGURES_HEADER``'s table: each figure as ``policy / oracle`` (the oracle's side
    is ``-`` when its runs are not in the records)."""
    if not mine:
        return []

    def pair(field: Callable[[RunMetrics], float | None], fmt: str, unit: str = "") -> str:
        def avg(ms: list[RunMetrics]) -> str:
            values = [v for x in ms if (v := field(x)) is not None]
            return format(_mean(values), fmt) + unit if values else "-"
        return f"{avg(mine)} / {avg(oracle)}"

    return [f"| {cell_id} | {pair(lambda x: x.sample_rate_per_min, '.1f')} "
            f"| {pair(lambda x: x.requests_per_min, '.0f')} | {pair(lambda x: x.prefill_tokens_per_s, '.0f')} "
            f"| {pair(lambda x: x.decode_tokens_per_s, '.0f')} | {pair(lambda x: x.preemptions, '.0f')} "
            f"| {pair(lambda x: 100 * x.mean_kv_usage, '.0f', '%')} | {pair(lambda x: x.mean_iteration_s, '.0f')} |"]


PAIRED_BASE = "session-admission"
"""What ``--against-default`` and the report's last table pair each variant with: the default's
settings under its variant name, so its runs share the cache keys of the suite's and of this tool's
other modes."""


def _paired_with_default(s: BenchSettings, cells: list[Cell], policies: list[str],
                         rates: Callable[[list[RunSpec]], dict[int, float]]) -> list[str]:
    """Each other variant over the default (``PAIRED_BASE``), per cell and paired by seed: the test of
    the rule's tie (docs/policy.md: two candidates tie on the worst cell when no cell's paired ratio
    between them excludes 1.0). Empty unless the default is among ``policies`` with another."""
    others = [p for p in policies if p != PAIRED_BASE]
    if PAIRED_BASE not in policies or not others:
        return []
    out = [f"### Paired with {PAIRED_BASE}", "", "| cell | " + " | ".join(others) + " |",
           "|---|" + "---|" * len(others)]
    tally = {p: [0, 0] for p in others}
    for cell in cells:
        base = rates(variant_runs(s, [cell], [PAIRED_BASE]))
        shown = []
        for p in others:
            r = paired_ratio(rates(variant_runs(s, [cell], [p])), base)
            if r is not None and verdict(r) is Verdict.WIN:
                tally[p][0] += 1
            elif r is not None and verdict(r) is Verdict.LOSS:
                tally[p][1] += 1
            shown.append(_with_verdict(r))
        out.append(f"| {cell.id} | " + " | ".join(shown) + " |")
    out += ["", "; ".join(f"{p}: {w} won, {lost} lost against {PAIRED_BASE}" for p, (w, lost) in tally.items())
            + ".", ""]
    return out


def against_default(cells_text: str, policies: list[str], jobs: int, out: Path) -> str:
    """``--against-default``: the variants and the default at each cell's high ceiling, every seed;
    a table of each variant's mixture-constrained rate over the default's, paired by seed, with
    both prefix hits and the ideal."""
    ids = [c.strip() for c in cells_text.split(",") if c.strip()]
    large = sorted({int(c.rpartition(":")[2]) for c in ids if ":" in c} - {MATRIX_ENGINES})
    mixtures = sorted({c.partition("@")[2].partition(":")[0] for c in ids})
    s = BenchSettings(large_fleet_engines=tuple(large), large_fleet_mixtures=tuple(mixtures) or ("paper",))
    cells = [c for c in s.cells() if c.id in ids]
    missing = sorted(set(ids) - {c.id for c in cells})
    if missing:
        raise SystemExit(f"variant_check: unknown cell {missing[0]!r}")
    names = [PAIRED_BASE, *(p for p in policies if p != PAIRED_BASE)]

    def done(rec: RunRecord, cached: bool) -> None:
        print(f"{'cached' if cached else 'ran   '} {rec.spec.cell(s).id} seed {rec.spec.seed_of(s)} {rec.spec.label}: "
              f"{rec.metrics.mixture_rate_per_min:.1f}/min, hit {rec.metrics.prefix_hit_rate:.3f} "
              f"({rec.cpu_s:.0f} CPU-s)", flush=True)

    recs = run_all(variant_runs(s, cells, names), s, jobs=jobs, cache=RunCache(out / "cache"), on_done=done)
    by: dict[tuple[str, str], dict[int, RunRecord]] = {}
    for r in recs:
        by.setdefault((r.spec.cell(s).id, r.spec.variant), {})[r.spec.seed_of(s)] = r

    def mean(runs: dict[int, RunRecord], field: Callable[[RunRecord], float]) -> float:
        return sum(field(r) for r in runs.values()) / len(runs)

    lines = []
    for p in names[1:]:
        lines += [f"### {p} against {PAIRED_BASE}", "",
                  "| cell | default mix-rate/min | variant | variant / default | default hit | variant hit "
                  "| ideal hit |",
                  "|---|---:|---:|---|---:|---:|---:|"]
        for c in cells:
            base, var = by[(c.id, PAIRED_BASE)], by[(c.id, p)]
            ratio = paired_ratio({k: r.metrics.mixture_rate_per_min for k, r in var.items()},
                                 {k: r.metrics.mixture_rate_per_min for k, r in base.items()})
            shown = "-" if ratio is None else (f"{ratio.mean:.3f}x ({ratio.low:.2f}-{ratio.high:.2f}, n={ratio.n}) "
                                               f"{verdict(ratio).value}")
            lines.append(
                f"| {c.id} | {mean(base, lambda r: r.metrics.mixture_rate_per_min):.1f} "
                f"| {mean(var, lambda r: r.metrics.mixture_rate_per_min):.1f} | {shown} "
                f"| {100 * mean(base, lambda r: r.metrics.prefix_hit_rate):.1f}% "
                f"| {100 * mean(var, lambda r: r.metrics.prefix_hit_rate):.1f}% "
                f"| {100 * mean(base, lambda r: r.metrics.ideal_prefix_hit_rate):.1f}% |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default="session-admission,misa-t",
                    help=f"variants, comma-separated (known: {', '.join(POLICY_VARIANTS)})")
    ap.add_argument("--cells", default="", help="only these cell ids (default: the twelve of v2)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("out/variant-check"), help="run cache (the suite's format)")
    ap.add_argument("--limits", action="store_true",
                    help="also run request-limit (the limit tuned on the fleet's steady@paper: "
                    + ", ".join(f"{n} engines {lim}" for n, lim in TUNED_REQUEST_LIMITS.items())
                    + ") and high-load at each cell's high ceiling, every seed, and report the variants' paired "
                    "ratios to them")
    ap.add_argument("--cell-oracle", action="store_true",
                    help="the oracle as misat bench has it now: each cell's best ceiling on the mean over seeds, "
                    "searched from v2's per-seed best ceilings (runs every seed at them, then refines); v2's "
                    "per-seed oracle beside it")
    ap.add_argument("--cell-oracle-points", type=int, default=CELL_ORACLE_MAX_POINTS,
                    help="ceilings added around the best mean at most, per cell")
    ap.add_argument("--held-out", default="", metavar="SEEDS",
                    help="instead of the oracle search: new seeds (none of "
                    + ", ".join(map(str, TUNED_SEEDS)) + ", where the oracle ceilings, tuned-once and the default "
                    "were chosen), each cell's oracle ceiling and tuned-once run on them beside the variants: "
                    "every tuned value measured out of sample")
    ap.add_argument("--against-default", default="", metavar="CELLS",
                    help=f"instead: the variants and {PAIRED_BASE} on these cells (any of the suite's, e.g. "
                    "steady@paper:16,steady@rlvr70:16), each variant's ratio to it paired by seed, no oracle")
    args = ap.parse_args()
    policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies if p not in POLICY_VARIANTS]
    if unknown:
        ap.error(f"unknown policy {unknown[0]!r}; known: {', '.join(POLICY_VARIANTS)}")
    if args.against_default and args.held_out:
        ap.error("--against-default and --held-out are two different runs; give one")
    if args.against_default:
        print()
        print(against_default(args.against_default, policies, args.jobs, args.out))
        return
    wanted = [c for c in args.cells.split(",") if c]
    missing = [c for c in wanted if c not in V2_ORACLE_CEILINGS]
    if missing:
        ap.error(f"no v2 oracle for cell {missing[0]!r}; known: {', '.join(V2_ORACLE_CEILINGS)}")
    s, cells = select_cells(wanted)

    def done(rec: RunRecord, cached: bool) -> None:
        print(f"{'cached' if cached else 'ran   '} {rec.spec.cell(s).id} seed {rec.spec.seed_of(s)} {rec.spec.label}: "
              f"{rec.metrics.mixture_rate_per_min:.1f}/min ({rec.cpu_s:.0f} CPU-s)"
              f"{'' if measured_steady(rec.metrics.converged, rec.metrics.warmup_ok) else ' NOT CONVERGED'}",
              flush=True)

    cache = RunCache(args.out / "cache")
    if args.held_out:
        if args.cell_oracle:
            ap.error("--held-out runs the cell oracles found on the tuned seeds; --cell-oracle searches them")
        parts = [x.strip() for x in args.held_out.split(",") if x.strip()]
        if not all(x.isdigit() for x in parts):
            ap.error(f"--held-out: seeds are comma-separated non-negative integers, got {args.held_out!r}")
        try:
            s = held_out_settings(s, tuple(int(x) for x in parts))
        except ValueError as e:
            ap.error(f"--held-out: {e}")
        specs = held_out_runs(s, cells) + (limit_runs(s, cells) if args.limits else []) + variant_runs(
            s, cells, policies)
        by_key = {r.key: r for r in run_all(specs, s, jobs=args.jobs, cache=cache, on_done=done)}
        print()
        print(report(s, cells, policies, by_key, limits=args.limits, cell_oracle=CELL_ORACLE_CEILINGS,
                     held_out=True))
        return
    specs = baseline_runs(s, cells) + (limit_runs(s, cells) if args.limits else []) + variant_runs(s, cells, policies)
    by_key = {r.key: r for r in run_all(specs, s, jobs=args.jobs, cache=cache, on_done=done)}
    cell_oracle: dict[str, int] | None = None
    if args.cell_oracle:
        def rate(spec: RunSpec) -> float | None:
            rec = by_key.get(spec.key(s))
            return None if rec is None else rec.metrics.mixture_rate_per_min

        while True:  # each round names the runs its results so far call for; the cache keeps the rest
            planned = [cell_oracle_runs(s, cell, rate, args.cell_oracle_points) for cell in cells]
            todo = [sp for runs, _ in planned for sp in runs if sp.key(s) not in by_key]
            if not todo:
                break
            by_key |= {r.key: r for r in run_all(todo, s, jobs=args.jobs, cache=cache, on_done=done)}
        cell_oracle = {cell.id: best for cell, (_, best) in zip(cells, planned, strict=True) if best is not None}
        print()
        print("Oracle ceilings (best mean over seeds): "
              + ", ".join(f"{cid} @{c} (v2 per seed {'/'.join(map(str, V2_ORACLE_CEILINGS[cid]))})"
                          for cid, c in cell_oracle.items()))
    print()
    print(report(s, cells, policies, by_key, limits=args.limits, cell_oracle=cell_oracle))


if __name__ == "__main__":
    main()
