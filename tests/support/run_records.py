"""Synthetic cluster-run records for tests of what the benchmark's reports make of them."""

from __future__ import annotations

from misat_bench.cluster_runs import RunMetrics, RunRecord
from misat_bench.suite import BenchSettings, RunSpec


def run_record(spec: RunSpec, s: BenchSettings, rate: float, *, steady: bool = True) -> RunRecord:
    """``spec``'s record at mixture-constrained ``rate``; ``steady`` False: stopped by the cap before
    its warm-up rule was met or its classes converged."""
    metrics = RunMetrics(
        mixture_rate_per_min=rate, sample_rate_per_min=rate, requests_per_min=rate, prefill_tokens_per_s=1.0,
        decode_tokens_per_s=1.0, prefix_hit_rate=0.8, ideal_prefix_hit_rate=0.9, tv_points=0.5,
        tv_noise_points=1.0, preemptions=0, mean_kv_usage=0.5, units_completed={"rlvr": 1}, measured_s=360.0,
        window_start_s=600.0, converged=steady, warmup_ok=steady, window_s=60.0, class_series=[])
    return RunRecord(key=spec.key(s), spec=spec, metrics=metrics, cpu_s=1.0, wall_s=1.0)
