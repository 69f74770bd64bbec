"""The variant check re-runs exactly the v2 matrix's oracle points, through the suite's own specs."""

from __future__ import annotations

import math

from misat_bench.suite import CEILING_ROUNDING, Baseline, BenchSettings, RunSpec, sweep_run
from misat_bench.variant_check import (
    TUNED_REQUEST_LIMITS,
    V2_ORACLE_CEILINGS,
    V2_TUNED_ONCE_CEILING,
    V2_TUNED_REQUEST_LIMIT,
    baseline_runs,
    cell_oracle_runs,
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
