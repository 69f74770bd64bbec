"""The in-process cluster: real policies on simulated engines, in virtual time."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from misat_router.policy.settings import PolicySettings, PrefixIndexSettings
from misat_sim.cluster import Cluster, ClusterConfig, mix_for, run_cluster
from misat_sim.config import SimEngineConfig
from misat_sim.workload import WorkloadSpec

# Small engines (1,024 blocks of 16 tokens) make KV pressure appear within seconds.
SMALL = SimEngineConfig(num_gpu_blocks=1024, max_model_len=8192)


def cfg(policy: str, ceiling: int, **kw: object) -> ClusterConfig:
    return ClusterConfig(
        engines=2, engine=SMALL, policy=PolicySettings(name=policy), ceiling=ceiling,
        duration_s=kw.pop("duration_s", 150.0), warmup_s=kw.pop("warmup_s", 30.0),  # type: ignore[arg-type]
        workload=WorkloadSpec(seed=3), **kw,  # type: ignore[arg-type]
    )


def test_same_config_same_result() -> None:
    a = run_cluster(cfg("misa-t", 64, duration_s=60.0, warmup_s=10.0)).as_dict()
    b = run_cluster(cfg("misa-t", 64, duration_s=60.0, warmup_s=10.0)).as_dict()
    assert a == b


def test_oversubscribed_cache_aware_collapses_and_misa_t_does_not() -> None:
    """At a ceiling far above what the KV holds, cache_aware thrashes; MISA-T admits what fits."""
    high = run_cluster(cfg("cache-aware", 256, duration_s=240.0, warmup_s=60.0))
    misa = run_cluster(cfg("misa-t", 256, duration_s=240.0, warmup_s=60.0))
    # The collapse: reusable prefixes evicted, recomputation and preemption, the mixture skewed.
    assert high.prefix_hit_rate < 0.05
    assert misa.prefix_hit_rate > 0.7
    assert misa.preemptions * 10 < high.preemptions
    assert misa.tv_points * 4 < high.tv_points
    assert misa.sample_rate_per_min > high.sample_rate_per_min


def test_iterations_drain_and_nothing_leaks() -> None:
    c = Cluster(cfg("misa-t", 64, iterations=2, iteration_units=48))
    result = c.run()
    assert c.iterations_done == 2
    assert result.mean_iteration_s is not None and result.mean_iteration_s > 0
    assert sum(result.units_completed.values()) >= 2 * 48
    runner = c.runner
    assert runner.held_count() == 0
    assert runner.sessions == {}
    assert runner.policy.load.total == 0
    assert all(n == 0 for n in runner.policy.engine_sessions.values())  # type: ignore[attr-defined]


def test_router_classes_follow_the_workload_mixture() -> None:
    mix = mix_for(WorkloadSpec())
    assert abs(sum(c.share for c in mix.classes) - 100.0) < 1e-6
    assert [c.name for c in mix.classes if c.multi_turn] == ["agentic"]


def test_block_size_sets_the_engines_and_the_prefix_index_alike() -> None:
    c = Cluster(cfg("misa-t", 8, block_size=64, duration_s=1.0, warmup_s=0.0))
    assert {e.limits.block_size for e in c.engines.values()} == {64}
    assert c.cfg.policy.prefix.block_size == 64


def test_a_prefix_index_of_another_block_size_is_refused() -> None:
    with pytest.raises(ValidationError, match=re.escape("policy.prefix.block_size 32 differs from the engines' block size 16")):
        ClusterConfig(engine=SMALL, policy=PolicySettings(prefix=PrefixIndexSettings(block_size=32)))
