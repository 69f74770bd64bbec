"""The variant check re-runs exactly the v2 matrix's oracle points, through the suite's own specs."""

from __future__ import annotations

from misat_bench.suite import Baseline, BenchSettings, sweep_run
from misat_bench.variant_check import (
    V2_ORACLE_CEILINGS,
    V2_TUNED_ONCE_CEILING,
    V2_TUNED_REQUEST_LIMIT,
    baseline_runs,
    limit_runs,
    select_cells,
    variant_runs,
)


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
