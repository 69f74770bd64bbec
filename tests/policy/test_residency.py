"""T_b, MISA-T's residency estimate: live sessions as censored observations, and the time factor's shape."""

from __future__ import annotations

import pytest

from misat_router.policy.estimators import censored_percentile
from misat_router.policy.settings import PolicyName, PolicySettings, ResidencySettings
from misat_router.policy.types import Completion

from .test_misa_scenarios import engines, fill, make_runner, placed_count, teach


def test_without_censored_observations_it_is_the_step_percentile() -> None:
    assert censored_percentile([4.0, 1.0, 3.0, 2.0], [], 50.0) == 2.0
    assert censored_percentile([4.0, 1.0, 3.0, 2.0], [], 100.0) == 4.0


def test_censored_observations_leave_the_risk_set_without_an_event() -> None:
    # 10 (event): S = 4/5; 15 censored; 20 (event, 3 at risk): S = 4/5 * 2/3 = 0.533.
    assert censored_percentile([10.0, 20.0], [15.0, 30.0, 40.0], 40.0) == 20.0
    # The median is never reached: more than half are still running past every event.
    assert censored_percentile([10.0, 20.0], [15.0, 30.0, 40.0], 50.0) is None
    # At equal times the event counts first (2 at risk at 5: S = 1/2).
    assert censored_percentile([5.0], [5.0], 50.0) == 5.0


def _rlvr_t(censored: bool) -> float:
    """T_rlvr after 4 short RLVR sessions finished while 10 long ones are still running."""
    runner = make_runner(PolicyName.MISA_T, residency=ResidencySettings(min_samples=1, censored=censored))
    teach(runner, "rlvr", 1000, duration=1.0, n=4)  # 4 sessions of 1 s each, done at t = 1
    eng = engines(1, capacity=10**9)
    fill(runner, "rlvr", eng, 10, now=2.0)  # placed at t = 2, still running at t = 102
    runner.on_metrics(eng, 102.0)
    return runner.policy.residency_of("rlvr")  # type: ignore[attr-defined, no-any-return]


def test_live_sessions_keep_start_up_t_from_being_the_short_sessions_residency() -> None:
    # Without censoring only the 4 finished sessions count: 1 s. With it, 10 of 14 sessions have
    # stayed 100 s and counting, so the median is beyond every observation: the oldest, 100 s.
    assert _rlvr_t(censored=False) == pytest.approx(1.0)
    assert _rlvr_t(censored=True) == pytest.approx(100.0)


def test_censored_t_follows_completions_once_the_long_sessions_finish() -> None:
    runner = make_runner(PolicyName.MISA_T, residency=ResidencySettings(min_samples=1, censored=True))
    eng = engines(1, capacity=10**9)
    placed = fill(runner, "rlvr", eng, 4, now=0.0)
    for r, d in placed:
        runner.finish(r, d.engine_id, Completion(prompt_tokens=500, completion_tokens=500), 50.0)
    runner.on_metrics(eng, 60.0)
    assert runner.policy.residency_of("rlvr") == pytest.approx(50.0)  # type: ignore[attr-defined]


@pytest.mark.parametrize(("exponent", "agentic_share"), [(1.0, 0.8), (0.5, 2 / 3), (0.0, 0.5)])
def test_the_time_factor_exponent_shapes_the_budget_split(exponent: float, agentic_share: float) -> None:
    # Equal footprints and demand; agentic sessions stay 4x as long: T^1 -> 4:1, T^0.5 -> 2:1, T^0 -> 1:1.
    runner = make_runner(PolicyName.MISA_T, residency=ResidencySettings(min_samples=1, exponent=exponent))
    teach(runner, "rlvr", 1000, duration=10.0)
    teach(runner, "agentic", 1000, duration=40.0)
    eng = engines(1, capacity=100_000)
    fill(runner, "rlvr", eng, 200)
    fill(runner, "agentic", eng, 200)
    runner.on_metrics(eng, 11.0)
    budgets = runner.policy.describe()["engines"]["e0"]["classes"]  # type: ignore[index]
    share = budgets["agentic"]["budget_tokens"] / (budgets["agentic"]["budget_tokens"] + budgets["rlvr"]["budget_tokens"])
    assert share == pytest.approx(agentic_share, abs=0.02)


def test_a_settings_change_drops_the_censored_estimate_until_the_next_scrape() -> None:
    runner = make_runner(PolicyName.MISA_T, residency=ResidencySettings(min_samples=1, censored=True))
    eng = engines(1, capacity=10**9)
    fill(runner, "rlvr", eng, 3, now=0.0)
    runner.on_metrics(eng, 30.0)
    policy = runner.policy
    assert policy.residency_of("rlvr") == pytest.approx(30.0)  # type: ignore[attr-defined]
    new = policy.settings.model_copy(update={"residency": ResidencySettings(min_samples=1, censored=False)})
    assert policy.set_settings(new)
    assert policy.residency_of("rlvr") == 1.0  # type: ignore[attr-defined]  # no completion yet: neutral


def _split(basis: str, rlvr_sessions: int, agentic_sessions: int) -> dict[str, dict[str, float]]:
    """Budgets on one engine with equal footprints and residencies, shares 50/50."""
    runner = make_runner(PolicyName.MISA_T, budget_basis=basis)
    teach(runner, "rlvr", 1000, duration=10.0)
    teach(runner, "agentic", 1000, duration=10.0)
    eng = engines(1, capacity=100_000)
    fill(runner, "rlvr", eng, rlvr_sessions)
    fill(runner, "agentic", eng, agentic_sessions)
    runner.on_metrics(eng, 11.0)
    return runner.policy.describe()["engines"]["e0"]["classes"]  # type: ignore[index, no-any-return]


def test_demand_basis_follows_the_backlog_and_target_basis_the_target_shares() -> None:
    # Three times the RLVR backlog: the paper's demand weighting gives RLVR 3/4 of the KV,
    # the target weighting the 50% share that completes units at the trainer's mixture.
    for basis, rlvr_share in (("demand", 0.75), ("target", 0.5)):
        b = _split(basis, 300, 100)
        share = b["rlvr"]["budget_tokens"] / (b["rlvr"]["budget_tokens"] + b["agentic"]["budget_tokens"])
        assert share == pytest.approx(rlvr_share, abs=0.02), basis


def test_target_basis_caps_a_class_at_what_its_sessions_need_and_gives_the_rest_away() -> None:
    b = _split("target", 300, 2)
    assert b["agentic"]["budget_tokens"] == pytest.approx(2 * 1000)
    assert b["rlvr"]["budget_tokens"] == pytest.approx(100_000 - 2 * 1000)
    assert "capped at what its 2 unfinished sessions could use" in str(b["agentic"]["reason"])


def test_target_basis_needs_misa_t() -> None:
    with pytest.raises(ValueError, match=r"budget_basis\n.*target weighs classes .* the policy is misa"):
        PolicySettings(name=PolicyName.MISA, budget_basis="target")


@pytest.mark.parametrize(("basis", "placed"), [("demand", 30), ("target", 50)])
def test_the_class_caps_a_decision_applies_follow_the_budget_basis(basis: str, placed: int) -> None:
    # One engine of 100 sessions' KV, equal footprints and residencies, shares 50/50. Agentic has
    # 10 live sessions and 60 held (no engine when they came), then 100 RLVR sessions ask. By demand
    # agentic's backlog keeps RLVR to 30 (31 of 101 unfinished sessions is under 31 places); by
    # target RLVR gets its 50% share (agentic wants more than its share, so it keeps its half).
    runner = make_runner(PolicyName.MISA_T, budget_basis=basis, residency=ResidencySettings(min_samples=1))
    teach(runner, "rlvr", 1000, duration=10.0)
    teach(runner, "agentic", 1000, duration=10.0)
    eng = engines(1, capacity=100_000)
    fill(runner, "agentic", eng, 10)
    assert placed_count(fill(runner, "agentic", {}, 60)) == 0
    assert placed_count(fill(runner, "rlvr", eng, 100)) == placed
