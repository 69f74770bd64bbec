"""``admission.releaseOrder``: which held new sessions go first when room appears."""

from __future__ import annotations

from typing import Literal

import pytest

from misat_router.policy.runner import PolicyRunner
from misat_router.policy.settings import ClassSpec, PolicyName, SessionAdmissionSettings
from misat_router.policy.types import Completion, EngineSnapshot, Reason, RequestMeta

from .test_misa_scenarios import engines, make_runner, req, teach

ReleaseOrder = Literal["arrival", "longest-first"]
CLASSES = (ClassSpec(name="long", share=50), ClassSpec(name="short", share=50))


def _runner(order: ReleaseOrder) -> PolicyRunner:
    """Both classes 1,000 tokens a session, so an engine of 2,000 tokens takes two sessions of
    either; ``long`` sessions stay 100 s, ``short`` ones 1 s."""
    runner = make_runner(PolicyName.SESSION_ADMISSION, CLASSES,
                         admission=SessionAdmissionSettings(release_order=order))
    teach(runner, "long", 1000, 100.0)
    teach(runner, "short", 1000, 1.0)
    return runner


def _full_engine(runner: PolicyRunner) -> tuple[dict[str, EngineSnapshot], list[RequestMeta], RequestMeta, RequestMeta]:
    """Two short sessions fill the engine; a short one, then a long one, are held behind them."""
    eng = engines(1, capacity=2000)
    running = [req("short") for _ in range(2)]
    for r in running:
        assert runner.submit(r, eng, 10.0).placed
    held_short, held_long = req("short"), req("long")
    assert runner.submit(held_short, eng, 11.0).reason is Reason.HOLD_SESSION_CAP
    assert runner.submit(held_long, eng, 12.0).reason is Reason.HOLD_SESSION_CAP
    return eng, running, held_short, held_long


@pytest.mark.parametrize(("order", "first"), [("arrival", "short"), ("longest-first", "long")])
def test_room_goes_to_the_oldest_or_to_the_longest_class(order: ReleaseOrder, first: str) -> None:
    runner = _runner(order)
    eng, running, held_short, held_long = _full_engine(runner)
    runner.finish(running[0], "e0", Completion(prompt_tokens=500, completion_tokens=500), 13.0)
    released = [r for r, _ in runner.release(eng, 13.0)]
    assert released == [held_short if first == "short" else held_long]
    assert runner.held_count() == 1


@pytest.mark.parametrize("order", ["arrival", "longest-first"])
def test_a_new_short_session_waits_behind_a_held_longer_class(order: ReleaseOrder) -> None:
    # Only a long session is held; room appears (a finish) and a new short session arrives
    # before the next release pass.
    runner = _runner(order)
    eng = engines(1, capacity=2000)
    running = [req("short") for _ in range(2)]
    for r in running:
        assert runner.submit(r, eng, 10.0).placed
    held_long = req("long")
    assert not runner.submit(held_long, eng, 11.0).placed
    runner.finish(running[0], "e0", Completion(prompt_tokens=500, completion_tokens=500), 12.0)
    decision = runner.submit(req("short"), eng, 12.5)
    if order == "arrival":
        assert decision.placed  # nothing of its own class is held: the room is its
        assert runner.release(eng, 13.0) == []
    else:
        assert decision.reason is Reason.HOLD_QUEUED
        assert [r for r, _ in runner.release(eng, 13.0)] == [held_long]


def test_a_class_without_residency_samples_ranks_at_the_mean_of_the_others() -> None:
    runner = _runner("longest-first")
    policy = runner.policy
    assert policy.release_rank("long") < policy.release_rank("short")  # type: ignore[operator]
    assert policy.release_rank("unseen") == pytest.approx(-(100.0 + 1.0) / 2)
    assert make_runner(PolicyName.SESSION_ADMISSION, CLASSES).policy.release_rank("long") is None
