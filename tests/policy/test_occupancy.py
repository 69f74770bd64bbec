"""k_b as KV occupancy (``footprint.statistic: occupancy``): KV token-seconds over residency."""

from __future__ import annotations

import pytest

from misat_router.policy.estimators import WindowRatio
from misat_router.policy.settings import FootprintSettings, PolicyName
from misat_router.policy.types import Completion

from .test_misa_scenarios import engines, make_runner, req


def test_window_ratio_weights_by_denominator_and_forgets_the_oldest() -> None:
    ratio = WindowRatio(window=2, min_samples=2)
    ratio.add(100.0, 1.0)
    assert ratio.value() is None  # one sample, two needed
    ratio.add(900.0, 3.0)
    assert ratio.value() == pytest.approx(1000.0 / 4.0)  # not the mean of 100 and 300
    ratio.add(50.0, 1.0)  # the first sample leaves the window
    assert ratio.value() == pytest.approx(950.0 / 4.0)
    ratio.reconfigure(window=1, min_samples=1)
    assert ratio.value() == pytest.approx(50.0)


def _occupancy_runner(statistic: str = "occupancy"):  # type: ignore[no-untyped-def]
    return make_runner(PolicyName.SESSION_ADMISSION,
                       footprint=FootprintSettings(statistic=statistic, min_samples=1, bootstrap_tokens=1000))


def _one_rlvr_session(runner) -> None:  # type: ignore[no-untyped-def]
    """A 100-token prompt that generates 1,000 tokens over 10 s on a large engine, then the engine goes."""
    r = req("rlvr", prompt=100)
    d = runner.submit(r, engines(1, capacity=10**9), 0.0)
    runner.finish(r, d.engine_id, Completion(prompt_tokens=100, completion_tokens=1000), 10.0)
    runner.remove_engine("e0", 10.0)


def test_a_single_request_holds_its_prompt_and_half_its_output_on_average() -> None:
    runner = _occupancy_runner()
    _one_rlvr_session(runner)
    assert runner.policy.footprint_of("rlvr") == pytest.approx(100 + 1000 / 2)  # type: ignore[attr-defined]


def test_long_sessions_weigh_by_how_long_they_stay() -> None:
    # Two sessions: 600 tokens on average for 1 s, 6,000 for 9 s. A live session, sampled at a random
    # moment, is the long one 90% of the time: (600 * 1 + 6000 * 9) / 10 = 5,460. The median of the
    # peaks would say 1,100 or 11,000; their mean halved, 3,300.
    runner = _occupancy_runner()
    big = engines(1, capacity=10**9)
    for prompt, output, duration in ((100, 1000, 1.0), (1000, 10_000, 9.0)):
        r = req("rlvr", prompt=prompt)
        d = runner.submit(r, big, 0.0)
        runner.finish(r, d.engine_id, Completion(prompt_tokens=prompt, completion_tokens=output), duration)  # type: ignore[arg-type]
    assert runner.policy.footprint_of("rlvr") == pytest.approx(5460.0)  # type: ignore[attr-defined]


def test_a_multi_turn_session_holds_its_context_through_tool_gaps() -> None:
    runner = _occupancy_runner()
    big = engines(1, capacity=10**9)
    # Turn 0: 1,000-token prompt, 200 out, 0-2 s. Tool gap 2-6 s holding 1,200. Turn 1: 1,500-token
    # prompt, 100 out, 6-8 s. (1,100 * 2 + 1,200 * 4 + 1,550 * 2) / 8 = 1,262.5 tokens.
    r0 = req("agentic", session="a", turn=0, prompt=1000)
    d0 = runner.submit(r0, big, 0.0)
    runner.finish(r0, d0.engine_id, Completion(prompt_tokens=1000, completion_tokens=200), 2.0)  # type: ignore[arg-type]
    r1 = req("agentic", session="a", turn=1, prompt=1500)
    d1 = runner.submit(r1, big, 6.0)
    assert d1.engine_id == d0.engine_id
    runner.finish(r1, d1.engine_id, Completion(prompt_tokens=1500, completion_tokens=100), 8.0)  # type: ignore[arg-type]
    runner.end_session(r1.session_key, 8.0)
    assert runner.policy.footprint_of("agentic") == pytest.approx(1262.5)  # type: ignore[attr-defined]


def test_the_statistic_switches_on_a_hot_reload_without_new_samples() -> None:
    runner = _occupancy_runner(statistic="peak")
    _one_rlvr_session(runner)
    policy = runner.policy
    assert policy.footprint_of("rlvr") == pytest.approx(1100.0)  # type: ignore[attr-defined]
    new = policy.settings.model_copy(
        update={"footprint": FootprintSettings(statistic="occupancy", min_samples=1, bootstrap_tokens=1000)})
    assert policy.set_settings(new)
    assert policy.footprint_of("rlvr") == pytest.approx(600.0)  # type: ignore[attr-defined]


def test_occupancy_sizes_the_session_cap() -> None:
    # k = 600 tokens held on average: a 6,000-token engine takes 10 sessions (the peak, 1,100, gives 5).
    runner = _occupancy_runner()
    _one_rlvr_session(runner)
    eng = engines(1, capacity=6000)
    decisions = [runner.submit(req("rlvr"), eng, 11.0) for _ in range(12)]
    assert sum(1 for d in decisions if d.placed) == 10
