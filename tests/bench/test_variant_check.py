"""The variant check re-runs exactly the v2 matrix's oracle points, through the suite's own specs."""

from __future__ import annotations

import math

import pytest

from misat_bench.cluster_runs import RunRecord
from misat_bench.suite import CEILING_ROUNDING, Baseline, BenchSettings, Cell, RunSpec, sweep_run
from misat_bench.variant_check import (
    CELL_ORACLE_CEILINGS,
    TUNED_REQUEST_LIMITS,
    TUNED_SEEDS,
    V2_ORACLE_CEILINGS,
    V2_TUNED_ONCE_CEILING,
    V2_TUNED_REQUEST_LIMIT,
    baseline_runs,
    cell_oracle_runs,
    held_out_runs,
    held_out_settings,
    limit_runs,
    report,
    select_cells,
    variant_runs,
)
from tests.support.run_records import run_record


def test_every_cell_of_the_four_engine_matrix_has_an_oracle_ceiling_per_seed() -> None:
    s = BenchSettings(large_fleet_engines=())
    assert {c.id for c in s.cells()} == {c for c in V2_ORACLE_CEILINGS if c.endswith(":4")}
    assert all(len(v) == len(s.seeds) for v in V2_ORACLE_CEILINGS.values())
    _, cells = select_cells([])
    assert [c.id for c in cells] == [c.id for c in s.cells()], "no --cells: the twelve the rule is read on"


def test_a_large_fleet_cell_runs_as_the_suites_large_fleet_invocation_ran_it() -> None:
    """steady@rlvr70:16 ran as `misat bench --cells steady@rlvr70:16 --large-fleet-mixtures paper,rlvr70`:
    the variant check's runs of it have that invocation's cache keys."""
    s, cells = select_cells(["steady@rlvr70:16", "steady@agentic10:4"])
    assert sorted(c.id for c in cells) == ["steady@agentic10:4", "steady@rlvr70:16"]
    suite_s = BenchSettings(large_fleet_engines=(16,), large_fleet_mixtures=("paper", "rlvr70"))
    suite_cell = next(c for c in suite_s.cells() if c.id == "steady@rlvr70:16")
    mine = [r for r in baseline_runs(s, cells) if r.engines == 16]
    assert [r.key(s) for r in mine] == [
        sweep_run(suite_cell, seed, c).key(suite_s)
        for seed, c in zip(s.seeds, V2_ORACLE_CEILINGS["steady@rlvr70:16"], strict=True)
    ]


def test_baseline_runs_share_the_suites_cache_keys() -> None:
    s = BenchSettings(large_fleet_engines=())
    cells = {c.id: c for c in s.cells()}
    runs = baseline_runs(s, [cells["kv-half@paper:4"], cells["steady@paper:4"]])
    oracle = [r for r in runs if r.baseline is Baseline.SWEEP]
    assert [r.key(s) for r in oracle] == [
        sweep_run(cells[cid], seed, c).key(s)
        for cid in ("kv-half@paper:4", "steady@paper:4")
        for seed, c in zip(s.seeds, V2_ORACLE_CEILINGS[cid], strict=True)
    ]
    once = [r for r in runs if r.baseline is Baseline.TUNED_ONCE]
    assert [r.cell(s).id for r in once] == ["kv-half@paper:4"] * len(s.seeds)  # changing workloads only
    assert {r.ceiling for r in once} == {V2_TUNED_ONCE_CEILING}


def test_variants_run_at_the_cells_high_ceiling_under_their_own_name() -> None:
    s = BenchSettings(large_fleet_engines=())
    cell = s.cells()[0]
    runs = variant_runs(s, [cell], ["session-admission", "misa-t"])
    assert len(runs) == 2 * len(s.seeds)
    assert {r.ceiling for r in runs} == {s.high(cell.engines)}
    assert {r.variant for r in runs} == {"session-admission", "misa-t"}


def test_limit_runs_are_the_suites_request_limit_and_high_load_runs() -> None:
    # high-load is cache_aware at the high ceiling, the same run (cache key) as the sweep's point there;
    # request-limit adds v2's tuned limit at that ceiling.
    s = BenchSettings(large_fleet_engines=())
    cell = next(c for c in s.cells() if c.id == "kv-half@paper:4")
    mine = limit_runs(s, [cell])
    assert len(mine) == 2 * len(s.seeds)
    limit = [r for r in mine if r.baseline is Baseline.REQUEST_LIMIT]
    high = [r for r in mine if r.baseline is Baseline.HIGH_LOAD]
    assert {r.policy.concurrency_limit for r in limit} == {V2_TUNED_REQUEST_LIMIT}
    assert {r.policy.concurrency_limit for r in high} == {None}
    assert {r.ceiling for r in mine} == {s.high(cell.engines)}
    assert [r.key(s) for r in high] == [sweep_run(cell, seed, s.high(cell.engines)).key(s) for seed in s.seeds]


def test_the_cell_oracle_is_searched_between_the_seeds_own_best_ceilings_on_every_seed() -> None:
    """agentic10's seeds peaked at 488, 272 and 288 in v2: every seed runs each of them, then the
    midpoints around the best mean, inside that span, until the neighbours are 8 apart."""
    s, (cell,) = select_cells(["steady@agentic10:4"])
    peaks = {0: 330.0, 1: 300.0, 2: 310.0}

    def rate(spec: RunSpec) -> float:
        return 200.0 - 30.0 * math.log2(spec.ceiling / peaks[spec.seed_of(s)]) ** 2

    known: dict[str, float] = {}
    for _ in range(20):
        specs, best = cell_oracle_runs(s, cell, lambda sp: known.get(sp.key(s)))
        missing = [sp for sp in specs if sp.key(s) not in known]
        if not missing:
            break
        known.update({sp.key(s): rate(sp) for sp in missing})
    assert best is not None
    ceilings = sorted({sp.ceiling for sp in specs})
    assert {272, 288, 488} <= set(ceilings) and min(ceilings) == 272 and max(ceilings) == 488
    assert all(sp.baseline is Baseline.SWEEP for sp in specs)
    for c in ceilings:  # every seed at every ceiling searched
        assert {sp.seed_of(s) for sp in specs if sp.ceiling == c} == set(s.seeds)
    means = {c: sum(rate(sweep_run(cell, seed, c)) for seed in s.seeds) / len(s.seeds) for c in ceilings}
    assert best == max(means, key=lambda c: means[c])
    i = ceilings.index(best)
    assert ceilings[i + 1] - best == CEILING_ROUNDING and best - ceilings[i - 1] == CEILING_ROUNDING
    assert 296 <= best <= 328  # near the mean's own peak (about 313), not at any seed's v2 point


def test_a_large_fleets_request_limit_is_the_one_tuned_on_that_fleet() -> None:
    """On 16 engines request-limit is 1024, the limit `misat bench` tuned on steady@paper:16 (64 per
    engine, as 256 is on 4), not the 4-engine matrix's 256."""
    s, cells = select_cells(["steady@rlvr70:16"])
    limit = [r for r in limit_runs(s, cells) if r.baseline is Baseline.REQUEST_LIMIT]
    assert {r.policy.concurrency_limit for r in limit} == {TUNED_REQUEST_LIMITS[16]} == {1024}
    assert TUNED_REQUEST_LIMITS[4] == V2_TUNED_REQUEST_LIMIT


def test_every_cell_oracle_lies_between_its_seeds_own_best_ceilings() -> None:
    """The search ran inside the span of v2's per-seed best ceilings (the large fleet's from its own sweeps):
    a recorded oracle outside it, or a cell without one, is a typo."""
    assert set(CELL_ORACLE_CEILINGS) == set(V2_ORACLE_CEILINGS)
    for cell, ceiling in CELL_ORACLE_CEILINGS.items():
        per_seed = V2_ORACLE_CEILINGS[cell]
        assert min(per_seed) <= ceiling <= max(per_seed), cell
        assert ceiling % CEILING_ROUNDING == 0, cell


def test_held_out_seeds_must_be_new() -> None:
    s = BenchSettings(large_fleet_engines=())
    assert held_out_settings(s, (3, 4, 5)).seeds == (3, 4, 5)
    with pytest.raises(ValueError, match="2 is among the seeds"):
        held_out_settings(s, (2, 3))
    with pytest.raises(ValueError, match="no held-out seed"):
        held_out_settings(s, ())
    assert set(TUNED_SEEDS) == set(s.seeds), "the tuned seeds are the suite's default seeds"


def test_held_out_runs_are_the_cell_oracle_and_tuned_once_on_the_new_seeds_with_the_suites_keys() -> None:
    s, cells = select_cells(["steady@rlvr70:4", "kv-half@paper:4"])
    held = held_out_settings(s, (3, 4))
    runs = held_out_runs(held, cells)
    by_cell = {c.id: c for c in cells}
    oracle = [r for r in runs if r.baseline is Baseline.SWEEP]
    assert [(r.cell(held).id, r.seed_of(held), r.ceiling) for r in oracle] == [
        (cid, seed, CELL_ORACLE_CEILINGS[cid]) for cid in ("steady@rlvr70:4", "kv-half@paper:4") for seed in (3, 4)]
    assert [r.key(held) for r in oracle] == [
        sweep_run(by_cell[r.cell(held).id], r.seed_of(held), r.ceiling).key(held) for r in oracle]
    once = [r for r in runs if r.baseline is Baseline.TUNED_ONCE]
    assert [(r.cell(held).id, r.seed_of(held)) for r in once] == [("kv-half@paper:4", 3), ("kv-half@paper:4", 4)]
    assert {r.ceiling for r in once} == {V2_TUNED_ONCE_CEILING}


_HELD_OUT_ORACLE = {3: 100.0, 4: 120.0, 5: 80.0}
"""The cell oracle's rate per held-out seed in the report tests (uneven, so a ratio is per seed)."""


def _held_out_kv_half(
    policy_factor: float, limits: bool = False
) -> tuple[BenchSettings, list[Cell], dict[str, RunRecord]]:
    """kv-half@paper:4 on held-out seeds 3-5: the oracle at ``_HELD_OUT_ORACLE``, tuned-once at half of
    it, request-limit and high-load (with ``limits``) at 0.75 and 0.6 of it, the default at
    ``policy_factor`` of it."""
    s, cells = select_cells(["kv-half@paper:4"])
    held = held_out_settings(s, (3, 4, 5))
    factor = {Baseline.SWEEP: 1.0, Baseline.REQUEST_LIMIT: 0.75, Baseline.HIGH_LOAD: 0.6}
    records: dict[str, RunRecord] = {}
    for spec in [*held_out_runs(held, cells), *(limit_runs(held, cells) if limits else [])]:
        rate = _HELD_OUT_ORACLE[spec.seed_of(held)] * factor.get(spec.baseline, 0.5)  # tuned-once: 0.5
        records[spec.key(held)] = run_record(spec, held, rate)
    for spec in variant_runs(held, cells, ["session-admission"]):
        records[spec.key(held)] = run_record(spec, held, policy_factor * _HELD_OUT_ORACLE[spec.seed_of(held)])
    return held, cells, records


def test_the_held_out_report_pairs_each_variant_with_the_cell_oracle_on_the_same_new_seed() -> None:
    held, cells, records = _held_out_kv_half(1.1)
    text = report(held, cells, ["session-admission"], records, cell_oracle=CELL_ORACLE_CEILINGS, held_out=True)
    row = next(line for line in text.splitlines() if line.startswith("| kv-half@paper:4"))
    assert "1.10x" in row and "win" in row  # 1.1 on every seed: a zero-width interval above 1
    assert "2.20x" in row  # against tuned-once (half the oracle's rate on each seed)
    assert "held-out seeds 3, 4, 5" in text
    assert "x oracle per seed" not in text  # v2's per-seed oracles belong to the tuned seeds


def test_the_report_pairs_each_variant_with_the_default_per_cell() -> None:
    # The rule's tie (docs/policy.md) is read off this table: a variant that wins or loses a cell,
    # paired by seed with the default, is not tied with it.
    s, cells = select_cells(["kv-half@paper:4", "steady@paper:4"])
    held = held_out_settings(s, (3, 4, 5))
    base_rate = {3: 100.0, 4: 120.0, 5: 80.0}
    factor = {("kv-half@paper:4", "occupancy-budget-0.95"): 0.9, ("steady@paper:4", "occupancy-budget-0.95"): 1.05}
    records: dict[str, RunRecord] = {}
    for spec in held_out_runs(held, cells):
        records[spec.key(held)] = run_record(spec, held, base_rate[spec.seed_of(held)])
    for spec in variant_runs(held, cells, ["session-admission", "occupancy-budget-0.95"]):
        f = factor.get((spec.cell(held).id, spec.variant), 1.0)
        records[spec.key(held)] = run_record(spec, held, f * base_rate[spec.seed_of(held)])
    text = report(held, cells, ["session-admission", "occupancy-budget-0.95"], records,
                  cell_oracle=CELL_ORACLE_CEILINGS, held_out=True)
    paired = text.split("### Paired with session-admission", 1)[1]
    rows = {line.split(" | ")[0][2:]: line for line in paired.splitlines() if line.startswith("| ") and "@" in line}
    assert "0.90x" in rows["kv-half@paper:4"] and "loss" in rows["kv-half@paper:4"]
    assert "1.05x" in rows["steady@paper:4"] and "win" in rows["steady@paper:4"]
    assert "occupancy-budget-0.95: 1 won, 1 lost against session-admission." in paired
    alone = report(held, cells, ["occupancy-budget-0.95"], records, cell_oracle=CELL_ORACLE_CEILINGS, held_out=True)
    assert "Paired with" not in alone  # nothing to pair with


def test_the_in_sample_report_has_the_cell_oracle_and_v2s_per_seed_oracle_beside_it() -> None:
    s, cells = select_cells(["kv-half@paper:4"])
    (cell,) = cells
    records: dict[str, RunRecord] = {}
    for spec in baseline_runs(s, cells):  # v2's per-seed points and tuned-once
        rate = 125.0 if spec.baseline is Baseline.SWEEP else 50.0
        records[spec.key(s)] = run_record(spec, s, rate)
    for seed in s.seeds:  # the cell's oracle ceiling, 112 (seed 2's own v2 point too: the same run)
        spec = sweep_run(cell, seed, CELL_ORACLE_CEILINGS[cell.id])
        records[spec.key(s)] = run_record(spec, s, 100.0)
    for spec in variant_runs(s, cells, ["session-admission"]):
        records[spec.key(s)] = run_record(spec, s, 110.0)
    text = report(s, cells, ["session-admission"], records, cell_oracle=CELL_ORACLE_CEILINGS)
    row = next(line for line in text.splitlines() if line.startswith("| kv-half@paper:4"))
    assert "x oracle per seed" in text and "1.10x" in row and "2.20x" in row
    assert "held-out" not in text


def test_the_report_sets_the_figures_beside_the_rate_against_the_cells_oracle() -> None:
    # Units/min, requests/min and the rest, the policy over the cell's oracle (not over tuned-once,
    # which also runs on the cell), so the rate's ratio can be read against what moved it.
    held, cells, records = _held_out_kv_half(1.1)
    text = report(held, cells, ["session-admission"], records, cell_oracle=CELL_ORACLE_CEILINGS, held_out=True)
    figures = text.split("The figures beside the rate", 1)[1]
    row = next(line for line in figures.splitlines() if line.startswith("| kv-half@paper:4"))
    assert row.startswith("| kv-half@paper:4 | 110.0 / 100.0 | 110 / 100 |")
    assert "| 50% / 50% | - / - |" in row  # KV use as a percentage; no iterations on this cell
    for spec in held_out_runs(held, cells):
        if spec.baseline is Baseline.SWEEP:
            del records[spec.key(held)]
    text = report(held, cells, ["session-admission"], records, cell_oracle=CELL_ORACLE_CEILINGS, held_out=True)
    assert "The figures beside the rate" not in text  # no oracle: the cell is "not run", no figures


def test_the_report_reads_each_static_baseline_against_the_cells_oracle() -> None:
    held, cells, records = _held_out_kv_half(1.0, limits=True)
    text = report(held, cells, ["session-admission"], records, limits=True, cell_oracle=CELL_ORACLE_CEILINGS,
                  held_out=True)
    table = text.split("### The baselines against the cell's oracle", 1)[1]
    row = next(line for line in table.splitlines() if line.startswith("| kv-half@paper:4"))
    assert [cell.split()[0] for cell in row.strip("| ").split(" | ")[1:]] == ["0.50x", "0.75x", "0.60x"]
    without = report(held, cells, ["session-admission"], records, cell_oracle=CELL_ORACLE_CEILINGS, held_out=True)
    assert "request-limit | high-load |" not in without.split("### The baselines", 1)[1]


def test_the_goal_verdicts_read_the_unrounded_mean() -> None:
    # 1.02997 prints as 1.030x; the mean goal (>= 1.03x) is not met, and the line says so with the figure.
    held, cells, records = _held_out_kv_half(1.02997)
    text = report(held, cells, ["session-admission"], records, cell_oracle=CELL_ORACLE_CEILINGS, held_out=True)
    line = next(line for line in text.splitlines() if line.startswith("Mean over"))
    assert "1.030x (1.030-1.030 over 3 seeds) (goal >= 1.03x not met: 1.02997x)" in line
    assert "kv-half@paper:4 1.030x (goal >= 0.97x met)" in line  # far from its goal: no extra digits
    held, cells, records = _held_out_kv_half(0.96)
    text = report(held, cells, ["session-admission"], records, cell_oracle=CELL_ORACLE_CEILINGS, held_out=True)
    line = next(line for line in text.splitlines() if line.startswith("Mean over"))
    assert "0.960x (0.960-0.960 over 3 seeds) (goal >= 1.03x not met)" in line
    assert "0.960x (goal >= 0.97x not met)" in line


def test_the_means_over_cells_carry_an_interval_paired_by_seed() -> None:
    # Two cells on seeds 3-5: per seed, the mean over the cells, then the interval over the seeds.
    s, cells = select_cells(["kv-half@paper:4", "kv-double@paper:4"])
    held = held_out_settings(s, (3, 4, 5))
    factor = {("kv-half@paper:4", 3): 1.0, ("kv-half@paper:4", 4): 1.1, ("kv-half@paper:4", 5): 1.2,
              ("kv-double@paper:4", 3): 1.2, ("kv-double@paper:4", 4): 1.1, ("kv-double@paper:4", 5): 1.0}
    records: dict[str, RunRecord] = {}
    for spec in held_out_runs(held, cells):
        records[spec.key(held)] = run_record(spec, held, 100.0 if spec.baseline is Baseline.SWEEP else 50.0)
    for spec in variant_runs(held, cells, ["session-admission"]):
        records[spec.key(held)] = run_record(spec, held, 100.0 * factor[(spec.cell(held).id, spec.seed_of(held))])
    text = report(held, cells, ["session-admission"], records, cell_oracle=CELL_ORACLE_CEILINGS, held_out=True)
    line = next(line for line in text.splitlines() if line.startswith("Mean over"))
    # Every seed's mean over the two cells is 1.1: the cells' spreads cancel, so the interval is a point.
    assert "Mean over 2 cells 1.100x (1.100-1.100 over 3 seeds)" in line
    assert "x tuned-once over the changing cells 2.200x (2.200-2.200 over 3 seeds)" in line


def test_the_report_names_every_run_that_did_not_reach_steady_state() -> None:
    """A run stopped by the cap before its warm-up rule was met measured a transient: its figure stays
    in the tables, and the report says which run it is; a report whose runs all converged says so."""
    held, cells, records = _held_out_kv_half(1.1)
    text = report(held, cells, ["session-admission"], records, cell_oracle=CELL_ORACLE_CEILINGS, held_out=True)
    assert text.endswith(f"Every run's window was steady state ({len(records)} runs).")
    key, rec = next((k, r) for k, r in records.items() if r.spec.seed_of(held) == 4 and r.spec.variant)
    records[key] = rec.model_copy(update={"metrics": rec.metrics.model_copy(update={"warmup_ok": False})})
    text = report(held, cells, ["session-admission"], records, cell_oracle=CELL_ORACLE_CEILINGS, held_out=True)
    last = text.splitlines()[-1]
    assert last.startswith(f"NOT CONVERGED: 1 of {len(records)} runs")
    assert last.endswith(f"kv-half@paper:4 seed 4 {rec.spec.label}.")
