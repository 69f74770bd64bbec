"""A release pass holds, without deciding, the held new sessions a hold earlier in the pass implies
(``Policy.hold_order``): the answers are the decisions' own, and fewer decisions are made."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from misat_router.policy.base import Engines
from misat_router.policy.registry import build_policy
from misat_router.policy.runner import PolicyRunner
from misat_router.policy.settings import ClassSpec, FootprintSettings, PolicyName, PolicySettings
from misat_router.policy.types import Completion, Decision, Reason, RequestMeta

from .test_misa_scenarios import engines, make_runner, req, teach
from .test_policy_properties import ADMISSION_POLICIES, MIX, make, op, run


def _held(runner: PolicyRunner) -> list[tuple[str, Reason]]:
    return [(e.req.request_id, e.reason) for e in runner.held()]


@pytest.mark.parametrize("name", ADMISSION_POLICIES, ids=[n.value for n in ADMISSION_POLICIES])
@settings(max_examples=40, deadline=None)
@given(ops=st.lists(op, min_size=1, max_size=150))
def test_implied_holds_are_the_decisions_own(name: PolicyName, ops: list) -> None:
    # Every decision and every held request's reason, with the shortcut and without it; engines
    # of 4,000 tokens keep two or three sessions of the 2,000-token prior, so most passes hold.
    for limit in (None, 3):
        implied, decided = make(name, limit), make(name, limit)
        decided.imply_holds = False
        got = run(implied, ops, group_samples=True, capacity=4000)
        want = run(decided, ops, group_samples=True, capacity=4000)
        assert got.decisions == want.decisions
        assert _held(implied) == _held(decided)


@pytest.mark.parametrize("name", ADMISSION_POLICIES, ids=[n.value for n in ADMISSION_POLICIES])
@settings(max_examples=40, deadline=None)
@given(ops=st.lists(op, min_size=1, max_size=150))
def test_implied_holds_follow_k_ref_where_placements_move_it(name: PolicyName, ops: list) -> None:
    # Before any session completes, a class's footprint is what its live sessions' prompts hold
    # on average, so a placement in the pass can lower k_ref (raise the caps) for the holds after
    # it. Footprints stay on that prior here (a window no completion fills) at a 16-token floor,
    # below every prompt. (Random ops rarely hit that case; the last test below builds it.)
    def runner() -> PolicyRunner:
        s = PolicySettings(name=name, footprint=FootprintSettings(min_samples=10_000, bootstrap_tokens=16))
        return PolicyRunner(build_policy(s, MIX), MIX)

    implied, decided = runner(), runner()
    decided.imply_holds = False
    got = run(implied, ops, group_samples=True, capacity=300)
    want = run(decided, ops, group_samples=True, capacity=300)
    assert got.decisions == want.decisions
    assert _held(implied) == _held(decided)


CLASSES = (ClassSpec(name="a", share=34), ClassSpec(name="b", share=33), ClassSpec(name="c", share=33))


def _counting(runner: PolicyRunner) -> list[str]:
    """Wrap the policy's decide; returns the list of request ids it was asked about."""
    asked: list[str] = []
    decide = runner.policy.decide

    def counted(r: RequestMeta, eng: Engines, now: float) -> Decision:
        asked.append(r.request_id)
        return decide(r, eng, now)

    runner.policy.decide = counted  # type: ignore[method-assign]
    return asked


@pytest.mark.parametrize("imply", [True, False])
def test_a_full_fleet_is_checked_once_per_pass_not_once_per_held_class(imply: bool) -> None:
    runner = make_runner(PolicyName.SESSION_ADMISSION, CLASSES)
    for c in "abc":
        teach(runner, c, 1000, 10.0)
    runner.imply_holds = imply
    eng = engines(2, capacity=2000)  # two sessions of 1,000 tokens an engine
    for i in range(4):
        assert runner.submit(req("abc"[i % 3]), eng, 10.0).placed
    held = [req(c) for c in "abc"]
    for r in held:
        assert not runner.submit(r, eng, 11.0).placed
    asked = _counting(runner)
    assert runner.release(eng, 12.0) == []
    # The oldest held class is decided; the others, as large, are implied (with the shortcut).
    assert asked == ([held[0].request_id] if imply else [r.request_id for r in held])
    assert {reason for _, reason in _held(runner)} == {Reason.HOLD_SESSION_CAP}


def test_a_larger_group_is_implied_and_a_smaller_one_is_decided() -> None:
    # A hold of 2 samples implies one of 3, and says nothing of 1 sample: that one is decided.
    runner = make_runner(PolicyName.SESSION_ADMISSION, CLASSES)
    for c in "abc":
        teach(runner, c, 1000, 10.0)
    eng = engines(1, capacity=3000)  # three places of 1,000 tokens
    running = [req(c) for c in "abc"]
    for r in running:
        assert runner.submit(r, eng, 10.0).placed
    two, three, one = req("a", samples=2), req("b", samples=3), req("c")
    for r in (two, three, one):
        assert not runner.submit(r, eng, 11.0).placed
    runner.finish(running[0], "e0", Completion(prompt_tokens=500, completion_tokens=500), 12.0)
    asked = _counting(runner)
    released = runner.release(eng, 12.0)  # two places taken: 2 + 2 > 3, 2 + 1 fits
    assert asked == [two.request_id, one.request_id]
    assert [r.request_id for r, _ in released] == [one.request_id]
    assert _held(runner) == [(two.request_id, Reason.HOLD_SESSION_CAP), (three.request_id, Reason.HOLD_SESSION_CAP)]


def test_a_hold_at_a_larger_k_ref_implies_nothing_once_a_placement_lowers_it() -> None:
    # Before any session completes, a class's footprint is its live sessions' prompts on
    # average. A 1,000-token b session is live on an engine of 700 tokens; a (2 samples), b and
    # c (2 samples) arrive and are held. In the pass, k_ref is 334 (a cap of 2): a is held, b
    # fits; with b's second, 10-token session its footprint halves, k_ref falls to 169 (a cap of
    # 4), and c, as large as a, fits too.
    runner = make_runner(PolicyName.SESSION_ADMISSION, CLASSES,
                         footprint=FootprintSettings(statistic="peak", min_samples=10_000, bootstrap_tokens=1))
    eng = engines(1, capacity=700)
    assert runner.submit(req("b", prompt=1000), eng, 1.0).placed
    x, y, z = req("a", prompt=10, samples=2), req("b", prompt=10), req("c", prompt=10, samples=2)
    for r in (x, y, z):
        assert runner.submit(r, eng, 2.0).reason is Reason.HOLD_SESSION_CAP
    asked = _counting(runner)
    released = runner.release(eng, 3.0)
    assert [r.request_id for r, _ in released] == [y.request_id, z.request_id]
    assert asked == [x.request_id, y.request_id, z.request_id]


def test_a_held_request_whose_session_went_live_in_the_pass_is_decided() -> None:
    # Two turn-0 requests of one session are held; the first is placed in the pass, so the
    # second is its session's continuation now, placed with it, though a larger hold came first.
    runner = make_runner(PolicyName.SESSION_ADMISSION, CLASSES)
    for c in "abc":
        teach(runner, c, 1000, 10.0)
    eng = engines(1, capacity=2000)  # two places of 1,000 tokens
    running = [req("c"), req("c")]
    for r in running:
        assert runner.submit(r, eng, 10.0).placed
    big = req("a", samples=2)
    first, second = req("b", session="s"), req("b", session="s", samples=2)
    for r in (big, first, second):
        assert not runner.submit(r, eng, 11.0).placed
    runner.finish(running[0], "e0", Completion(prompt_tokens=500, completion_tokens=500), 12.0)
    released = runner.release(eng, 12.0)  # one place free: big is held, first fits
    assert [(r.request_id, d.reason) for r, d in released] == [
        (first.request_id, Reason.NEW_SESSION), (second.request_id, Reason.CONTINUATION)]
