"""Round-robin, least-loaded and the static concurrency limit (through PolicyRunner)."""

from __future__ import annotations

import pytest

from misat_router.policy.base import Engines
from misat_router.policy.concurrency_limit import ConcurrencyLimited
from misat_router.policy.registry import build_policy
from misat_router.policy.runner import PolicyRunner
from misat_router.policy.settings import ClassSpec, PolicyName, PolicySettings, WorkloadMix
from misat_router.policy.simple import LeastLoadedPolicy, RoundRobinPolicy
from misat_router.policy.types import Action, Completion, Decision, EngineSnapshot, Reason, RequestMeta

MIX = WorkloadMix(classes=(ClassSpec(name="rlvr", share=100),))
DONE = Completion(prompt_tokens=1, completion_tokens=1)


def _settings(name: PolicyName, limit: int | None = None) -> PolicySettings:
    return PolicySettings(name=name, concurrency_limit=limit)


def _engines(ids: str, unhealthy: str = "") -> dict[str, EngineSnapshot]:
    return {e: EngineSnapshot(engine_id=e, healthy=e not in unhealthy) for e in ids}


def _req(i: int) -> RequestMeta:
    return RequestMeta(request_id=f"r{i}", workload_class="rlvr")


def _place_many(policy, engines, n: int) -> list[str | None]:
    out = []
    for i in range(n):
        d = policy.decide(_req(i), engines, float(i))
        if d.placed:
            policy.on_placed(_req(i), d.engine_id, float(i))
        out.append(d.engine_id)
    return out


# ---- round-robin ------------------------------------------------------------

@pytest.mark.parametrize(
    ("ids", "unhealthy", "expected"),
    [
        pytest.param("cab", "", ["a", "b", "c", "a", "b"], id="sorted-id-cycle"),
        pytest.param("abc", "b", ["a", "c", "a", "c"], id="skips-unhealthy"),
        pytest.param("a", "", ["a", "a"], id="single-engine"),
        pytest.param("ab", "ab", [None, None], id="none-healthy-holds"),
    ],
)
def test_round_robin_cycles(ids, unhealthy, expected) -> None:
    policy = RoundRobinPolicy(_settings(PolicyName.ROUND_ROBIN), MIX)
    assert _place_many(policy, _engines(ids, unhealthy), len(expected)) == expected


def test_round_robin_decide_is_pure_and_cursor_moves_on_placement() -> None:
    policy = RoundRobinPolicy(_settings(PolicyName.ROUND_ROBIN), MIX)
    engines = _engines("abc")
    assert policy.decide(_req(0), engines, 0.0).engine_id == "a"
    assert policy.decide(_req(0), engines, 0.0).engine_id == "a"
    policy.on_placed(_req(0), "a", 0.0)
    assert policy.decide(_req(1), engines, 1.0).engine_id == "b"


def test_round_robin_survives_pool_changes() -> None:
    policy = RoundRobinPolicy(_settings(PolicyName.ROUND_ROBIN), MIX)
    _place_many(policy, _engines("abc"), 2)  # a, b
    assert policy.decide(_req(9), _engines("ac"), 9.0).engine_id == "c"  # b left
    assert policy.decide(_req(9), _engines("abd"), 9.0).engine_id == "d"  # c left, d joined


# ---- least-loaded -----------------------------------------------------------

@pytest.mark.parametrize(
    ("loads", "unhealthy", "expected", "reason"),
    [
        pytest.param({"a": 2, "b": 1, "c": 3}, "", "b", Reason.LEAST_LOADED, id="fewest"),
        pytest.param({"c": 1, "b": 1, "a": 2}, "", "b", Reason.LEAST_LOADED, id="tie-by-id"),
        pytest.param({"a": 0, "b": 4}, "a", "b", Reason.LEAST_LOADED, id="skips-unhealthy"),
        pytest.param({"a": 0}, "a", None, Reason.HOLD_NO_ENGINE, id="none-healthy-holds"),
    ],
)
def test_least_loaded(loads, unhealthy, expected, reason) -> None:
    policy = LeastLoadedPolicy(_settings(PolicyName.LEAST_LOADED), MIX)
    for e, n in loads.items():
        for _ in range(n):
            policy.load.add(e)
    d = policy.decide(_req(0), _engines("".join(loads), unhealthy), 0.0)
    assert (d.engine_id, d.reason) == (expected, reason)


def test_least_loaded_spreads_then_refills_the_freed_engine() -> None:
    policy = LeastLoadedPolicy(_settings(PolicyName.LEAST_LOADED), MIX)
    engines = _engines("ab")
    assert _place_many(policy, engines, 4) == ["a", "b", "a", "b"]
    policy.on_finished(_req(1), "b", DONE, 5.0)
    assert policy.decide(_req(5), engines, 5.0).engine_id == "b"


# ---- static concurrency limit -----------------------------------------------

def test_registry_wraps_when_a_limit_is_set() -> None:
    policy = build_policy(_settings(PolicyName.LEAST_LOADED, limit=3), MIX)
    assert isinstance(policy, ConcurrencyLimited)
    assert isinstance(policy.inner, LeastLoadedPolicy)
    assert policy.name is PolicyName.LEAST_LOADED
    assert policy.settings is policy.inner.settings and policy.mix is policy.inner.mix
    assert policy.load is policy.inner.load
    assert not isinstance(build_policy(_settings(PolicyName.LEAST_LOADED), MIX), ConcurrencyLimited)


def test_limit_holds_at_the_limit_and_releases_fifo_through_the_runner() -> None:
    policy = ConcurrencyLimited(RoundRobinPolicy(_settings(PolicyName.ROUND_ROBIN), MIX), limit=2)
    runner = PolicyRunner(policy, MIX)
    engines = _engines("ab")
    decisions = [runner.submit(_req(i), engines, float(i)) for i in range(4)]
    assert [d.action for d in decisions] == [Action.PLACE, Action.PLACE, Action.HOLD, Action.HOLD]
    assert decisions[2].reason is Reason.HOLD_CONCURRENCY_LIMIT
    assert [e.req.request_id for e in runner.held()] == ["r2", "r3"]
    assert runner.release(engines, 4.0) == []  # still at the limit

    runner.finish(_req(0), "a", DONE, 5.0)
    released = runner.release(engines, 5.0)
    assert [r.request_id for r, _ in released] == ["r2"]
    assert [e.req.request_id for e in runner.held()] == ["r3"]
    assert runner.held()[0].reason is Reason.HOLD_CONCURRENCY_LIMIT

    runner.finish(_req(1), "b", DONE, 6.0)
    assert [r.request_id for r, _ in runner.release(engines, 6.0)] == ["r3"]
    assert policy.load.total == 2


def test_limit_passes_hooks_to_the_inner_policy() -> None:
    inner = RoundRobinPolicy(_settings(PolicyName.ROUND_ROBIN), MIX)
    policy = ConcurrencyLimited(inner, limit=5)
    engines = _engines("ab")
    assert policy.decide(_req(0), engines, 0.0) == inner.decide(_req(0), engines, 0.0)
    policy.on_placed(_req(0), "a", 0.0)
    assert inner.load.get("a") == 1 and policy.decide(_req(1), engines, 1.0).engine_id == "b"
    policy.on_finished(_req(0), "a", DONE, 1.0)
    assert inner.load.total == 0
    policy.on_placed(_req(2), "b", 2.0)
    policy.on_engine_removed("b", 3.0)
    assert inner.load.total == 0
    assert policy.describe()["concurrency_limit"] == 5


def test_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        ConcurrencyLimited(LeastLoadedPolicy(_settings(PolicyName.LEAST_LOADED), MIX), limit=0)


def test_a_release_pass_stops_at_the_first_request_the_limit_holds() -> None:
    # Held continuations are tried whatever their class's state, so before this a pass at the
    # limit asked the policy once per held request: quadratic in the ledger under a long queue.
    mix = WorkloadMix(classes=(ClassSpec(name="agentic", share=100, multi_turn=True),))
    asked: list[str] = []

    class Counting(ConcurrencyLimited):
        def decide(self, req: RequestMeta, engines: Engines, now: float) -> Decision:
            asked.append(req.request_id)
            return super().decide(req, engines, now)

    policy = Counting(RoundRobinPolicy(_settings(PolicyName.ROUND_ROBIN), mix), limit=1)
    runner = PolicyRunner(policy, mix)
    engines = _engines("a")
    turns = [RequestMeta(request_id=f"t{i}", workload_class="agentic", session_id=f"s{i}", turn=1)
             for i in range(50)]
    assert [runner.submit(t, engines, 0.0).placed for t in turns[:2]] == [True, False]
    for t in turns[2:]:
        runner.submit(t, engines, 0.0)
    asked.clear()
    assert runner.release(engines, 1.0) == []
    assert asked == ["t1"]  # the oldest held, then nothing else
    runner.finish(turns[0], "a", DONE, 2.0)
    assert [r.request_id for r, _ in runner.release(engines, 2.0)] == ["t1"]
    assert [e.req.request_id for e in runner.held()][:2] == ["t2", "t3"]
