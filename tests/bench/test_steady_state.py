"""Steady-state rules on synthetic series: warm-up, convergence, sampling noise, the ideal prefix hit."""

from __future__ import annotations

import random

import pytest

from misat_bench.steady_state import (
    IdealPrefixCache,
    SteadyStateSettings,
    converged,
    counts_agree,
    ideal_cached_tokens,
    median_residency,
    sampling_noise_tv,
    warmup_over,
)
from misat_sim.report import tv_distance_points
from misat_sim.workload import RolloutClass, SessionPlan, Turn

S = SteadyStateSettings()
CLASSES = ["agentic", "rlvr", "rlhf"]


def test_settings_refuse_a_window_that_cannot_hold_the_check() -> None:
    with pytest.raises(ValueError, match="even"):
        SteadyStateSettings(convergence_windows=3, measure_s=600.0)
    with pytest.raises(ValueError, match="shorter than the convergence check"):
        SteadyStateSettings(measure_s=120.0)
    with pytest.raises(ValueError, match="max_duration_s"):
        SteadyStateSettings(max_duration_s=400.0)


def test_the_warm_up_waits_for_5x_the_longest_median_residency_after_the_last_phase() -> None:
    medians = {"agentic": 50.0, "rlvr": 200.0, "rlhf": 40.0}
    assert not warmup_over(960.0, 0.0, medians, S)
    assert warmup_over(1020.0, 0.0, medians, S)  # 5 x 200 = 1000
    assert not warmup_over(1020.0, 100.0, medians, S)  # counted from the phase change
    assert not warmup_over(5000.0, None, medians, S)  # a phase change is still ahead
    assert not warmup_over(5000.0, 0.0, {**medians, "rlhf": None}, S)  # a class without enough samples
    assert not warmup_over(60.0, 0.0, {c: 1.0 for c in CLASSES}, S)  # never before the floor
    assert warmup_over(120.0, 0.0, {c: 1.0 for c in CLASSES}, S)


def test_in_flight_ages_hold_the_median_up() -> None:
    done = [10.0] * 20
    assert median_residency(done, [], 20) == 10.0
    assert median_residency(done, [300.0] * 30, 20) == 300.0  # most of the class is still out, and older
    assert median_residency(done[:5], [1.0], 20) is None


def test_convergence_on_synthetic_series() -> None:
    flat = [{"agentic": 120, "rlvr": 80, "rlhf": 45}] * 4
    assert converged(flat, CLASSES, S)
    rising = [{"agentic": 120, "rlvr": 40 + 15 * i, "rlhf": 45} for i in range(4)]
    assert not converged(rising, CLASSES, S)  # rlvr: 95 vs 155 per two windows
    assert not converged(flat[:3], CLASSES, S)  # fewer windows than the check needs
    # Small counts: counting noise, not the 10% tolerance, decides (3 and 9 in two windows: 2 sd = 6.9).
    assert converged([{"rlhf": 2}, {"rlhf": 1}, {"rlhf": 5}, {"rlhf": 4}], ["rlhf"], S)
    assert not converged([{"rlhf": 0}, {"rlhf": 0}, {"rlhf": 10}, {"rlhf": 10}], ["rlhf"], S)
    # Only the last windows count: an early transient does not block convergence.
    assert converged([{"agentic": 5}, {"agentic": 500}, *flat], CLASSES, S)


def test_counts_agree_uses_the_wider_of_tolerance_and_noise() -> None:
    assert counts_agree(1000, 1090, S)  # within 10%
    assert not counts_agree(1000, 1150, S)  # 14% and 4 sd
    assert counts_agree(10, 18, S)  # 2 sd of sqrt(28) = 10.6


def test_sampling_noise_tv_matches_random_draws() -> None:
    target = {"agentic": 48.6, "rlvr": 33.1, "rlhf": 18.2}
    n = 400
    rng = random.Random(1)
    keys, weights = list(target), list(target.values())
    draws = []
    for _ in range(2000):
        sample = rng.choices(keys, weights, k=n)
        draws.append(tv_distance_points(target, {k: float(sample.count(k)) for k in keys}))
    assert sampling_noise_tv(target, n) == pytest.approx(sum(draws) / len(draws), rel=0.05)
    assert sampling_noise_tv(target, 4 * n) == pytest.approx(sampling_noise_tv(target, n) / 2)
    assert sampling_noise_tv(target, 0) == 0.0


def test_ideal_cached_tokens_counts_full_blocks_and_leaves_the_last_token() -> None:
    assert ideal_cached_tokens(40, 40, 16) == 32  # 39 usable -> 2 blocks
    assert ideal_cached_tokens(33, 33, 16) == 32
    assert ideal_cached_tokens(32, 32, 16) == 16  # the last token is recomputed: one block short
    assert ideal_cached_tokens(100, 50, 16) == 48
    assert ideal_cached_tokens(100, 0, 16) == 0


def _plan(klass: RolloutClass, sid: str, turns: list[tuple[int, int]], group: str | None = None) -> SessionPlan:
    return SessionPlan(klass=klass, session_id=sid, group_id=group, index=0,
                       turns=tuple(Turn(append_len=a, token_key=f"{sid}:{i}", max_tokens=m)
                                   for i, (a, m) in enumerate(turns)))


def test_the_ideal_cache_on_a_hand_made_workload() -> None:
    """A GRPO group of 3 (40-token prompt) and a 3-turn agentic session, block size 16."""
    cache = IdealPrefixCache(16)
    group = [_plan(RolloutClass.RLVR, f"g-s{j}", [(40, 100)], group="g") for j in range(3)]
    agent = _plan(RolloutClass.AGENTIC, "a", [(50, 10), (7, 20), (30, 5)])
    got = [cache.cached(p, 0, 40) for p in group]
    assert got == [0, 32, 32]  # the first computes the prompt; the others reuse 2 full blocks
    # Agentic: turn 0 (50 tokens) has nothing; turn 1's prompt is 50 + 10 + 7 = 67, of which the
    # previous turn computed 59 (its last output token never enters the KV): 3 blocks.
    assert cache.cached(agent, 0, 50) == 0
    assert cache.cached(agent, 1, 67) == 48
    assert cache.cached(agent, 2, 67 + 20 + 30) == 80  # 86 computed -> 5 blocks
    other = _plan(RolloutClass.RLHF, "h-s0", [(40, 10)], group="h")
    assert cache.cached(other, 0, 40) == 0  # another group shares nothing
