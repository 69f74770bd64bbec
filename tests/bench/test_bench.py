"""The benchmark suite: the matrix, seeded sessions, the staged planner, the pipeline to result files.

Kept to seconds: the planner runs against synthetic records (a unimodal sweep),
so ``--quick`` and the full matrix are planned to the end without running the
cluster; one smoke test makes one real, very short cluster run; the HTTP smoke
sends one completion through the real ``vllm-router`` binary (skipped, with
the reason, only when it is absent).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import aiohttp
import pytest

import misat_bench.main as bench_main
from misat_bench.cluster_runs import RunMetrics, RunRecord, run_spec
from misat_bench.http_layer import engine_fleet, find_vllm_router, router_process, vllm_router_command
from misat_bench.main import run_stages
from misat_bench.report import BenchResult, summarise
from misat_bench.steady_state import SteadyStateSettings
from misat_bench.suite import (
    CEILING_ROUNDING,
    DEFAULT_POLICY,
    MIXTURE_FAMILY,
    PAPER_MIXTURE,
    POLICY_VARIANTS,
    QUICK,
    Baseline,
    BenchSettings,
    Cell,
    RunSpec,
    WorkloadName,
    cluster_config,
    parse_cells,
    pick_oracle,
    refine_ceilings,
)
from misat_router.policy.settings import PolicyName
from misat_sim.config import SimEngineConfig
from misat_sim.workload import DEFAULT_MIXTURE_PERCENT, RolloutClass, normalise_mixture

PEAK_PER_ENGINE: float = 50.0
"""The synthetic sweep peaks at this ceiling per engine (between grid points, so refinement has work)."""


def synthetic_rate(spec: RunSpec, s: BenchSettings) -> float:
    """A unimodal sweep in log-ceiling, a little different per seed; policies a constant above it."""
    engines = spec.engines or s.engines
    if spec.baseline is Baseline.POLICY:
        return 110.0 + spec.seed_of(s)
    x = math.log2(spec.ceiling / engines) - math.log2(PEAK_PER_ENGINE)
    return 100.0 - 10.0 * x * x + spec.seed_of(s) - (5.0 if spec.policy.concurrency_limit else 0.0)


def synthetic_record(spec: RunSpec, s: BenchSettings) -> RunRecord:
    rate = synthetic_rate(spec, s)
    metrics = RunMetrics(
        mixture_rate_per_min=rate, sample_rate_per_min=rate * 1.1, requests_per_min=10 * rate,
        prefill_tokens_per_s=1000.0, decode_tokens_per_s=500.0, prefix_hit_rate=0.85, ideal_prefix_hit_rate=0.9,
        tv_points=1.5, tv_noise_points=1.0, preemptions=3, mean_kv_usage=0.7, units_completed={"rlvr": 10},
        measured_s=360.0, window_start_s=600.0, converged=True, warmup_ok=True, window_s=60.0,
        class_series=[(0.0, {"rlvr": 3}), (60.0, {"rlvr": 5})],
    )
    return RunRecord(key=spec.key(s), spec=spec, metrics=metrics, cpu_s=1.0, wall_s=1.0)


def plan_fully(s: BenchSettings, cells: list[Cell] | None = None, policies: tuple[str, ...] | None = None
               ) -> tuple[list[RunSpec], dict[str, RunRecord], list[int]]:
    known: dict[str, RunRecord] = {}
    stages: list[int] = []
    plan = run_stages(s, cells or s.cells(), policies, lambda specs: [synthetic_record(sp, s) for sp in specs],
                      known, lambda _i, n: stages.append(n))
    return plan.runs, known, stages


def test_the_mixture_family_spans_each_class_from_10_to_70_percent() -> None:
    assert len(MIXTURE_FAMILY) >= 7
    assert MIXTURE_FAMILY[PAPER_MIXTURE] == DEFAULT_MIXTURE_PERCENT
    shares = [normalise_mixture(m) for m in MIXTURE_FAMILY.values()]
    for c in RolloutClass:
        assert min(m[c] for m in shares) == pytest.approx(0.10)
        assert max(m[c] for m in shares) == pytest.approx(0.70)
    assert len({tuple(sorted(m.items())) for m in shares}) == len(shares)  # no mixture twice


def test_the_matrix_crosses_the_family_with_steady_and_the_paper_mixture_with_the_changes() -> None:
    s = BenchSettings()
    ids = {c.id for c in s.cells()}
    assert {f"steady@{m}:4" for m in MIXTURE_FAMILY} <= ids
    assert "steady@paper:16" in ids
    for w in ("length-drift", "mix-shift", "kv-half", "kv-double", "iterations"):
        assert f"{w}@paper:4" in ids
    assert len(ids) == len(MIXTURE_FAMILY) + 1 + 5
    assert s.cells()[0].is_reference  # the tuned values come from it: planned first
    assert s.seeds == (0, 1, 2) and s.policies[0] == DEFAULT_POLICY
    assert POLICY_VARIANTS[DEFAULT_POLICY] == type(POLICY_VARIANTS[DEFAULT_POLICY])()  # the untuned default


def test_cells_are_chosen_by_name_and_unknown_names_are_refused_with_the_known_ones() -> None:
    s = BenchSettings()
    assert [c.id for c in parse_cells("steady@paper", s)] == ["steady@paper:4", "steady@paper:16"]
    assert [c.id for c in parse_cells("steady@rlvr70:4, kv-half@paper", s)] == ["steady@rlvr70:4", "kv-half@paper:4"]
    with pytest.raises(ValueError, match=r"steady@rlvr99.*known: steady@paper:4"):
        parse_cells("steady@rlvr99", s)
    with pytest.raises(ValueError, match="workload@mixture"):
        parse_cells("steady", s)
    with pytest.raises(ValueError, match="unknown policy 'misa-x'"):
        BenchSettings(policies=("misa-x",))


def test_every_policy_of_a_cell_and_seed_replays_the_same_sessions() -> None:
    s = BenchSettings()
    runs, _, _ = plan_fully(s)
    by_cell_seed: dict[tuple[str, int], list[RunSpec]] = {}
    for sp in runs:
        by_cell_seed.setdefault((sp.cell(s).id, sp.seed_of(s)), []).append(sp)
    assert {seed for _, seed in by_cell_seed} == set(s.seeds)
    workloads_by_cell: dict[str, set[str]] = {}
    for (cell, seed), specs in by_cell_seed.items():
        cfgs = [cluster_config(sp, s) for sp in specs]
        assert len({c.workload.model_dump_json() for c in cfgs}) == 1, cell
        assert len({c.engine.model_dump_json() for c in cfgs}) == 1, cell
        assert all(c.workload.seed == seed and c.engine.seed == seed for c in cfgs)
        names = {c.policy.name for c in cfgs}
        assert PolicyName.CACHE_AWARE in names and PolicyName.MISA_T in names, cell
        workloads_by_cell.setdefault(cell, set()).add(cfgs[0].workload.model_dump_json())
    assert all(len(v) == len(s.seeds) for v in workloads_by_cell.values())  # seeds differ


def test_cells_shape_the_cluster() -> None:
    s = BenchSettings()

    def cfg(cell: str):  # type: ignore[no-untyped-def]
        (c,) = parse_cells(cell, s)
        return cluster_config(RunSpec(workload=c.workload, mixture=c.mixture, engines=c.engines, seed=1,
                                      baseline=Baseline.SWEEP, policy=POLICY_VARIANTS["misa"], ceiling=64, label="x",
                                      steady_state=True), s)

    # KV changes in tokens, as the engines run them (at the bench's block size, not the profile's).
    def kv_tokens(cell: str) -> int:
        return cfg(cell).with_granularity().engine.resolve().kv_capacity_tokens

    steady = kv_tokens("steady@paper:4")
    assert kv_tokens("kv-half@paper") == pytest.approx(steady / 2, abs=s.block_size)
    assert kv_tokens("kv-double@paper") == pytest.approx(steady * 2, abs=2 * s.block_size)
    it = cfg("iterations@paper")
    assert it.iterations == s.iterations and it.iteration_units == s.iteration_units_per_engine * 4
    shift = cfg("mix-shift@paper").workload
    assert shift.mixture_at(0.0) == normalise_mixture(DEFAULT_MIXTURE_PERCENT)
    assert shift.mixture_at(1e9)[RolloutClass.AGENTIC] == pytest.approx(0.70)
    drift = cfg("length-drift@paper").workload
    assert drift.output_multiplier(RolloutClass.RLVR, 1e9) == pytest.approx(2.5)
    assert cfg("steady@rlvr70:4").workload.mixture_at(0.0)[RolloutClass.RLVR] == pytest.approx(0.70)
    big = cfg("steady@paper:16")
    assert big.engines == 16 and big.duration_s == s.steady_state.max_duration_s


def test_the_cache_key_covers_the_steady_state_settings() -> None:
    s = BenchSettings()
    spec = RunSpec(workload=WorkloadName.STEADY, baseline=Baseline.SWEEP, policy=POLICY_VARIANTS["misa"], ceiling=64,
                   label="x", steady_state=True)
    other = s.model_copy(update={"steady_state": SteadyStateSettings(convergence_tolerance=0.2)})
    assert spec.key(s) != spec.key(other)
    assert spec.key(s) == spec.model_copy(update={"label": "y", "baseline": Baseline.TUNED_ONCE}).key(s)


def test_oracle_picks_the_best_point_and_refines_around_it() -> None:
    points = {64: 100.0, 128: 180.0, 256: 175.0, 512: 90.0}
    assert pick_oracle(points) == 128
    assert pick_oracle({64: 5.0, 128: 5.0}) == 64  # ties: the lower ceiling
    assert refine_ceilings(points) == [96, 192]
    assert refine_ceilings({8: 1.0, 16: 2.0, 24: 1.5}) == []  # already as fine as the rounding
    # A best point at an end of the grid is not bracketed: the sweep goes past it first.
    assert refine_ceilings({96: 3.0, 128: 2.0, 512: 1.0}) == [48, 112]
    assert refine_ceilings({8: 3.0, 16: 2.0}) == []  # as low as the rounding goes
    assert refine_ceilings({96: 1.0, 512: 2.0}) == [1024, 304]
    assert refine_ceilings(points, rounds_left=0) == []


def test_the_oracle_is_refined_to_steps_of_8_per_seed_and_the_whole_sweep_is_kept() -> None:
    s = BenchSettings(mixtures=(PAPER_MIXTURE,), large_fleet_engines=(), changing=())
    runs, _, stages = plan_fully(s)
    for seed in s.seeds:
        ceilings = sorted({sp.ceiling for sp in runs if sp.baseline is Baseline.SWEEP and sp.seed == seed})
        assert set(s.ceilings(4)) < set(ceilings)
        assert all(c % CEILING_ROUNDING == 0 for c in ceilings)
        rates = {c: synthetic_rate(next(sp for sp in runs if sp.baseline is Baseline.SWEEP and sp.seed == seed
                                        and sp.ceiling == c), s) for c in ceilings}
        best = pick_oracle(rates)
        i = ceilings.index(best)
        assert ceilings[i + 1] - best == CEILING_ROUNDING and best - ceilings[i - 1] == CEILING_ROUNDING
    assert len(stages) >= 4  # coarse, refinement rounds, the tuned stage


def seed_peaks_apart(spec: RunSpec, s: BenchSettings) -> float:
    """Seeds whose sweeps peak at different ceilings (36, 50 and 64 per engine)."""
    engines = spec.engines or s.engines
    seed = spec.seed_of(s)
    if spec.baseline is Baseline.POLICY:
        return 100.0
    x = math.log2(spec.ceiling / engines) - math.log2((36.0, 50.0, 64.0)[seed])
    return 100.0 - 10.0 * x * x


def test_the_oracle_is_the_cells_best_ceiling_on_the_mean_refined_on_every_seed_and_each_seeds_best_is_beside_it(
) -> None:
    s = BenchSettings(mixtures=(PAPER_MIXTURE,), large_fleet_engines=(), changing=(), policies=(DEFAULT_POLICY,))
    cell = s.cells()[0]

    def record(spec: RunSpec) -> RunRecord:
        rec = synthetic_record(spec, s)
        rate = seed_peaks_apart(spec, s)
        return rec.model_copy(update={"metrics": rec.metrics.model_copy(update={"mixture_rate_per_min": rate})})

    known: dict[str, RunRecord] = {}
    plan = run_stages(s, [cell], None, lambda specs: [record(sp) for sp in specs], known)
    sweep: dict[int, dict[int, float]] = {}
    for sp in plan.runs:
        if sp.baseline is Baseline.SWEEP:
            sweep.setdefault(sp.seed_of(s), {})[sp.ceiling] = known[sp.key(s)].metrics.mixture_rate_per_min
    common = sorted(set.intersection(*(set(p) for p in sweep.values())))
    means = {c: sum(p[c] for p in sweep.values()) / len(sweep) for c in common}
    best = pick_oracle(means)
    i = common.index(best)
    # Refined on the mean, every seed at every ceiling around it, to the rounding step.
    assert common[i + 1] - best == CEILING_ROUNDING and best - common[i - 1] == CEILING_ROUNDING
    assert plan.tuned[cell.id]["ceiling"] == best  # tuned-once takes the same value

    (summary,) = summarise(plan.runs, known, s, [cell], plan.tuned)
    oracle, per_seed, default = (summary.row(r) for r in ("oracle", "oracle-per-seed", DEFAULT_POLICY))
    assert oracle is not None and per_seed is not None and default is not None
    assert summary.cell_oracle_ceiling == best and {f.ceiling for f in oracle.seeds} == {best}
    assert summary.oracle_ceiling == {seed: pick_oracle(p) for seed, p in sweep.items()}
    assert summary.oracle_ceiling[0] < best < summary.oracle_ceiling[2]  # the seeds' own bests are not the cell's
    # Each seed's best is at least its run at the cell's ceiling: the per-seed oracle is the stricter.
    assert all(r >= 1.0 for r in per_seed.ratios["oracle"].per_seed.values())
    assert per_seed.ratios["oracle"].interval.mean > 1.0
    assert default.ratios["oracle"].interval.mean > default.ratios["oracle-per-seed"].interval.mean


def test_quick_plans_every_row_on_every_cell_without_running() -> None:
    runs, known, _ = plan_fully(QUICK)
    s = QUICK
    assert s.engines == 2 and s.seeds == (0, 1) and len(s.mixtures) == 2
    cells = {sp.cell(s).id for sp in runs}
    assert cells == {"steady@paper:2", "steady@rlvr70:2", "mix-shift@paper:2", "iterations@paper:2"}
    roles = Counter((sp.cell(s).id, sp.baseline, sp.variant) for sp in runs)
    for cell in cells:
        for b in (Baseline.SWEEP, Baseline.REQUEST_LIMIT, Baseline.BALANCE_SMALL):
            assert roles[(cell, b, "")] >= len(s.seeds), (cell, b)
        for name in s.policies:
            assert roles[(cell, Baseline.POLICY, name)] == len(s.seeds)
        if cell != "steady@paper:2":
            assert roles[(cell, Baseline.TUNED_ONCE, "")] == len(s.seeds)
    assert all(sp.steady_state for sp in runs)
    assert len(known) < 100  # minutes, not hours


def test_a_selected_cell_brings_its_reference_cell_but_not_its_policies() -> None:
    s = BenchSettings()
    cells = parse_cells("kv-half@paper", s)
    runs, _, _ = plan_fully(s, cells, ("misa",))
    by_cell = Counter(sp.cell(s).id for sp in runs)
    assert set(by_cell) == {"kv-half@paper:4", "steady@paper:4"}
    ref = [sp for sp in runs if sp.cell(s).id == "steady@paper:4"]
    assert not any(sp.baseline is Baseline.POLICY for sp in ref)
    assert {sp.variant for sp in runs if sp.baseline is Baseline.POLICY} == {"misa"}
    tuned = [sp for sp in runs if sp.baseline is Baseline.TUNED_ONCE]
    assert tuned and all(sp.ceiling == 200 for sp in tuned)  # steady@paper's best mean ceiling (peak 50/engine)


def test_the_pipeline_writes_result_table_and_plots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """main() end to end with synthetic runs: cells, intervals, goals, files; then --report-only from the cache."""
    calls: list[int] = []

    def fake_run_all(specs, s, *, jobs=1, cache=None, on_done=None, cached_only=False):  # type: ignore[no-untyped-def]
        out = []
        for sp in specs:
            hit = cache.get(sp.key(s)) if cache else None
            if hit is None and cached_only:
                continue
            rec = hit or synthetic_record(sp, s)
            if hit is None:
                calls.append(1)
                if cache:
                    cache.put(rec)
            if on_done:
                on_done(rec, hit is not None)
            out.append(rec)
        return out

    monkeypatch.setattr(bench_main, "run_all", fake_run_all)
    args = ["--quick", "--cells", "steady@paper,mix-shift@paper", "--out", str(tmp_path)]
    assert bench_main.main(args) == 0
    result = BenchResult.model_validate_json((tmp_path / "result.json").read_text())
    assert [c.cell for c in result.cells] == ["steady@paper:2", "mix-shift@paper:2"]
    shift = result.cells[1]
    default = shift.row(DEFAULT_POLICY)
    assert default is not None and default.mixture_rate.n == 2
    assert set(default.ratios) == {"oracle", "oracle-per-seed", "tuned-once", "request-limit", "high-load"}
    assert {r.role for r in shift.rows} >= {"oracle", "oracle-per-seed", "tuned-once", "request-limit", "high-load",
                                            "balance-small"}
    assert result.goals and {g.goal for g in result.goals} >= {"x oracle, every cell", "x oracle, mean over cells"}
    assert result.tuned["steady@paper:2"]["ceiling"] == 96
    assert len({p.seed for p in shift.sweep}) == 2
    table = (tmp_path / "table.md").read_text()
    assert "| mix-shift@paper:2 | default |" in table and "| goal |" in table
    assert (tmp_path / "plots" / "mix-shift_paper_2.png").stat().st_size > 0
    raw = json.loads((tmp_path / "result.json").read_text())
    assert {"schema_version", "settings", "cells", "goals", "runs", "tuned", "machine"} <= set(raw)
    ran = len(calls)
    assert ran == len(result.runs)
    assert bench_main.main([*args, "--report-only", "--no-plot"]) == 0
    assert len(calls) == ran  # nothing run again
    again = BenchResult.model_validate_json((tmp_path / "result.json").read_text())
    assert [c.model_dump() for c in again.cells] == [c.model_dump() for c in result.cells]


def test_an_unknown_cell_or_policy_is_a_clear_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert bench_main.main(["--quick", "--cells", "steady@nope", "--out", str(tmp_path)]) == 2
    assert "steady@nope" in capsys.readouterr().out
    assert bench_main.main(["--policies", "misa,nope", "--out", str(tmp_path)]) == 2
    assert "misat bench: unknown policy 'nope'; known: default" in capsys.readouterr().out


def test_one_short_real_run_measures_a_steady_state_window() -> None:
    s = BenchSettings(engines=1, seeds=(0,), steady_state=SteadyStateSettings(
        window_s=10.0, warmup_factor=1.0, warmup_floor_s=10.0, min_class_samples=3, measure_s=20.0,
        convergence_windows=2,
        max_duration_s=60.0))
    spec = RunSpec(workload=WorkloadName.STEADY, baseline=Baseline.SWEEP, policy=POLICY_VARIANTS["misa"], ceiling=16,
                   label="x", engines=1, seed=0, steady_state=True)
    m = run_spec(spec, s).metrics
    assert m.window_start_s >= 10.0 and m.window_start_s % 10.0 == 0
    assert m.measured_s >= 20.0 or m.warmup_ok is False
    assert m.window_start_s + m.measured_s <= 60.0 + 1e-6
    assert m.converged is not None and m.warmup_ok is not None
    in_window = sum(sum(c.values()) for t, c in m.class_series
                    if m.window_start_s <= t < m.window_start_s + m.measured_s)
    assert in_window == sum(m.units_completed.values()) > 0
    assert m.sample_rate_per_min == pytest.approx(60.0 * in_window / m.measured_s)
    assert 0.0 < m.mixture_rate_per_min <= m.sample_rate_per_min + 1e-9
    assert 0.0 <= m.prefix_hit_rate <= m.ideal_prefix_hit_rate <= 1.0
    assert m.tv_noise_points > 0 and m.residency_median_s


def test_a_run_that_never_warms_up_measures_its_last_window_and_is_flagged() -> None:
    s = BenchSettings(engines=1, seeds=(0,), steady_state=SteadyStateSettings(
        window_s=10.0, warmup_factor=1000.0, warmup_floor_s=10.0, min_class_samples=3, measure_s=20.0,
        convergence_windows=2, max_duration_s=60.0))
    spec = RunSpec(workload=WorkloadName.STEADY, baseline=Baseline.SWEEP, policy=POLICY_VARIANTS["misa"], ceiling=16,
                   label="x", engines=1, seed=0, steady_state=True)
    m = run_spec(spec, s).metrics
    assert m.warmup_ok is False
    assert m.window_start_s == 40.0 and m.measured_s == pytest.approx(20.0)


async def test_vllm_router_binary_forwards_a_token_id_completion(tmp_path: Path) -> None:
    binary = find_vllm_router()
    if binary is None:
        pytest.skip("vllm-router binary not installed: pip install -e '.[bench]' (PyPI vllm-router)")
    cfg = SimEngineConfig(time_scale=50.0)
    async with engine_fleet(cfg, 1) as fleet:
        from misat_cli.processes import free_port

        port = free_port()
        cmd = vllm_router_command(binary, fleet.urls, port, time_scale=cfg.time_scale)
        async with router_process(cmd, port, "/health", tmp_path / "router.log") as proc, aiohttp.ClientSession() as s:
            body = {"model": cfg.model_name(), "prompt": list(range(10, 50)), "max_tokens": 4,
                    "ignore_eos": True, "return_token_ids": True}
            async with s.post(f"{proc.url}/v1/completions", json=body, headers={"X-Session-Id": "s"}) as r:
                assert r.status == 200
                data = await r.json()
    assert len(data["choices"][0]["token_ids"]) == 4
    assert data["usage"]["prompt_tokens"] == 40


def test_large_fleet_mixtures_flag_adds_steady_cells_on_the_large_fleet() -> None:
    args = bench_main.build_parser().parse_args(["--large-fleet-mixtures", "paper,rlvr70", "--large-fleet", "16"])
    s = bench_main.settings_from_args(args)
    assert parse_cells("steady@rlvr70:16", s) == [Cell(workload=WorkloadName.STEADY, mixture="rlvr70", engines=16)]
    with pytest.raises(ValueError, match="not in the matrix"):  # without the flag: the paper's mixture only
        parse_cells("steady@rlvr70:16", bench_main.settings_from_args(bench_main.build_parser().parse_args([])))
    bad = bench_main.build_parser().parse_args(["--large-fleet-mixtures", "nope"])
    with pytest.raises(ValueError, match="unknown mixture 'nope'"):
        bench_main.settings_from_args(bad)
