"""The benchmark suite: definitions, oracle choice, result schema, a tiny end-to-end run, an HTTP smoke.

Kept to seconds: the end-to-end run uses one engine and half a minute of
virtual time; the HTTP smoke sends one completion through the real
``vllm-router`` binary (skipped, with the reason, only when it is absent).
"""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest

from misat_bench.http_layer import engine_fleet, find_vllm_router, router_process, vllm_router_command
from misat_bench.main import main
from misat_bench.report import BenchResult
from misat_bench.suite import (
    BASELINES_VLLM,
    MISAT_MODES,
    QUICK,
    Baseline,
    BenchSettings,
    WorkloadName,
    cluster_config,
    fixed_runs,
    pick_oracle,
    refine_ceilings,
    tuned_runs,
)
from misat_router.policy.settings import PolicyName
from misat_sim.config import SimEngineConfig


def _all_runs(s: BenchSettings) -> list:
    oracle = dict.fromkeys(s.workloads, s.ceilings[0])
    return fixed_runs(s) + tuned_runs(s, oracle, s.request_limits[0], s.balance_candidates[0])


def test_every_workload_and_baseline_is_in_the_suite() -> None:
    s = BenchSettings()
    runs = _all_runs(s)
    assert {r.workload for r in runs} == set(WorkloadName)
    for w in WorkloadName:
        mine = {r.baseline for r in runs if r.workload is w}
        assert Baseline.SWEEP in mine and set(MISAT_MODES) <= mine
        assert Baseline.REQUEST_LIMIT in mine and Baseline.BALANCE_SMALL in mine
        if w is not WorkloadName.STEADY:
            assert Baseline.TUNED_ONCE in mine
        # high-load is the sweep point at the high ceiling, the oracle the best sweep point.
        assert any(r.baseline is Baseline.SWEEP and r.ceiling == s.high_ceiling for r in runs if r.workload is w)
    assert set(BASELINES_VLLM) >= {Baseline.ORACLE, Baseline.TUNED_ONCE, Baseline.HIGH_LOAD}
    assert any(r.baseline is Baseline.FOOTPRINT for r in runs)


def test_every_policy_sees_the_same_seeded_workload() -> None:
    s = BenchSettings(seed=7)
    runs = _all_runs(s)
    for w in WorkloadName:
        cfgs = [cluster_config(r, s) for r in runs if r.workload is w]
        assert len({c.workload.model_dump_json() for c in cfgs}) == 1, w
        assert len({c.engine.model_dump_json() for c in cfgs}) == 1, w
        assert all(c.workload.seed == 7 for c in cfgs)
        assert {c.policy.name for c in cfgs} >= {PolicyName.CACHE_AWARE, PolicyName.MISA_T}


def test_kv_change_and_iterations_shape_the_cluster() -> None:
    s = BenchSettings()
    runs = {r.workload: r for r in fixed_runs(s)}
    blocks = SimEngineConfig(profile=s.profile).resolve().num_gpu_blocks
    assert cluster_config(runs[WorkloadName.KV_HALF], s).engine.num_gpu_blocks == round(blocks / 2)
    assert cluster_config(runs[WorkloadName.KV_DOUBLE], s).engine.num_gpu_blocks == blocks * 2
    it = cluster_config(runs[WorkloadName.ITERATIONS], s)
    assert it.iterations == s.iterations and it.iteration_units == s.iteration_units_per_engine * s.engines
    mix = cluster_config(runs[WorkloadName.MIX_SHIFT], s).workload
    assert mix.mixture_changes and mix.mixture_at(0.0) != mix.mixture_at(1e9)
    drift = cluster_config(runs[WorkloadName.LENGTH_DRIFT], s).workload
    assert drift.output_multiplier(next(iter(drift.output_drift)), 1e9) > 2


def test_oracle_picks_the_best_point_and_refines_around_it() -> None:
    points = {64: 100.0, 128: 180.0, 256: 175.0, 512: 90.0}
    assert pick_oracle(points) == 128
    assert pick_oracle({64: 5.0, 128: 5.0}) == 64  # ties: the lower ceiling
    assert refine_ceilings(points) == [96, 192]
    assert refine_ceilings({8: 1.0, 16: 2.0}) == []  # already as fine as the rounding
    assert refine_ceilings(points, rounds_left=0) == []


def test_quick_end_to_end_writes_table_json_and_plot(tmp_path: Path) -> None:
    code = main(["--quick", "--layer", "cluster", "--workload", "steady", "--engines", "1", "--duration", "30",
                 "--warmup", "5", "--ceilings", "4,8", "--high", "16", "--request-limits", "4", "--jobs", "1",
                 "--out", str(tmp_path)])
    assert code == 0
    result = BenchResult.model_validate_json((tmp_path / "result.json").read_text())
    assert result.settings.engines == 1 and QUICK.engines == 2
    (steady,) = result.workloads
    assert steady.oracle_ceiling == pick_oracle({p.value: p.sample_rate_per_min for p in steady.ceiling_sweep})
    rows = {r.baseline: r for r in steady.rows}
    assert {"oracle", "high-load", "request-limit", "misa-t", "misa", "session-admission"} <= set(rows)
    assert rows["oracle"].ratio_to_oracle == pytest.approx(1.0)
    for r in steady.rows:
        assert r.sample_rate_per_min >= 0 and r.tv_points is not None and r.prefix_hit_rate is not None
    assert (tmp_path / "bench.png").stat().st_size > 0
    assert "| steady |" in (tmp_path / "table.md").read_text()
    raw = json.loads((tmp_path / "result.json").read_text())
    assert {"schema_version", "settings", "workloads", "runs", "tuned"} <= set(raw)


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
