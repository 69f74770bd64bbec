"""Draining engines (config engines.draining, set by the operator before a scale-down): no new
session is placed there, by any policy, while continuations of live sessions still are."""

from __future__ import annotations

import pytest

from misat_router.config import EnginesConfig, ServiceRef
from misat_router.policy.registry import build_policy
from misat_router.policy.runner import PolicyRunner
from misat_router.policy.settings import ClassSpec, PolicyName, PolicySettings, WorkloadMix
from misat_router.policy.types import Completion, EngineSnapshot, Reason, RequestMeta

MIX = WorkloadMix(classes=(ClassSpec(name="agentic", share=100, multi_turn=True),))
DONE = Completion(prompt_tokens=10, completion_tokens=10)
STICKY = {PolicyName.MISA_T, PolicyName.MISA, PolicyName.SESSION_ADMISSION}
"""Policies that place a live session's next turn on its engine (Reason.CONTINUATION)."""
ENGINES = {e: EngineSnapshot(engine_id=e, kv_capacity_tokens=10_000_000) for e in ("e0", "e1", "e2")}


def _turn(session: str, turn: int, i: int) -> RequestMeta:
    return RequestMeta(request_id=f"{session}-{turn}-{i}", workload_class="agentic", session_id=session, turn=turn,
                       prompt_tokens=10, max_tokens=10)


@pytest.mark.parametrize("name", list(PolicyName))
def test_new_sessions_avoid_draining_engines_and_live_ones_stay(name: PolicyName) -> None:
    runner = PolicyRunner(build_policy(PolicySettings(name=name), MIX), MIX)
    placed: dict[str, str] = {}
    for i in range(9):  # spread sessions over all three engines first
        req = _turn(f"s{i}", 0, i)
        d = runner.submit(req, ENGINES, float(i))
        assert d.placed and d.engine_id is not None
        runner.finish(req, d.engine_id, DONE, float(i) + 0.5)
        placed[f"s{i}"] = d.engine_id
    victim = placed["s0"]
    draining = frozenset({victim})
    now = 20.0
    new_placed = 0
    for i in range(12):
        req = _turn(f"n{i}", 0, i)
        d = runner.submit(req, ENGINES, now, draining)
        if d.placed:
            assert d.engine_id != victim
            runner.finish(req, d.engine_id, DONE, now)
            new_placed += 1
        now += 1.0
    assert new_placed
    on_victim = [s for s, e in placed.items() if e == victim]
    for s in on_victim:
        req = _turn(s, 1, 99)
        d = runner.submit(req, ENGINES, now, draining)
        assert d.placed and d.engine_id is not None
        if d.reason is Reason.CONTINUATION:  # policies that keep a session on its engine keep it there
            assert d.engine_id == victim
        runner.finish(req, d.engine_id, DONE, now)
    if name in STICKY:
        assert runner.sessions_per_engine()[victim] == len(on_victim)
    # A live session of another engine never moves onto the draining one.
    for s in [s for s, e in placed.items() if e != victim]:
        req = _turn(s, 1, 100)
        d = runner.submit(req, ENGINES, now, draining)
        assert d.placed and d.engine_id != victim
        runner.finish(req, d.engine_id, DONE, now)


def test_held_new_work_is_released_only_onto_engines_that_do_not_drain() -> None:
    runner = PolicyRunner(build_policy(PolicySettings(name=PolicyName.ROUND_ROBIN), MIX), MIX)
    only = {"e0": ENGINES["e0"]}
    held = runner.submit(_turn("s", 0, 0), only, 0.0, frozenset({"e0"}))
    assert not held.placed and held.reason is Reason.HOLD_NO_ENGINE
    assert runner.release(only, 1.0, frozenset({"e0"})) == []
    ((req, d),) = runner.release(ENGINES, 2.0, frozenset({"e0"}))
    assert req.session_id == "s" and d.engine_id in ("e1", "e2")


def test_draining_urls_are_validated_and_normalised() -> None:
    cfg = EnginesConfig(service=ServiceRef(name="pool-engines"), draining=("http://10.0.0.2:8000/",))
    assert cfg.draining_ids() == frozenset({"http://10.0.0.2:8000"})
    assert EnginesConfig(service=ServiceRef(name="pool-engines")).draining_ids() == frozenset()
    with pytest.raises(ValueError, match=r"draining\[0\]"):
        EnginesConfig(service=ServiceRef(name="pool-engines"), draining=("10.0.0.2:8000",))


def test_last_activity_per_engine_is_the_latest_turn_of_its_sessions_and_now_while_one_runs() -> None:
    """What a router shard reads to decide that an engine it hands back has gone quiet."""
    runner = PolicyRunner(build_policy(PolicySettings(name=PolicyName.SESSION_ADMISSION), MIX), MIX)
    one = {"e0": ENGINES["e0"]}
    a0, b0 = _turn("a", 0, 0), _turn("b", 0, 1)
    runner.submit(a0, one, 1.0)
    runner.finish(a0, "e0", DONE, 2.0)
    runner.submit(b0, one, 3.0)
    runner.finish(b0, "e0", DONE, 5.0)
    assert runner.last_active_per_engine(10.0) == {"e0": 5.0}
    a1 = _turn("a", 1, 2)
    runner.submit(a1, one, 11.0)
    assert runner.last_active_per_engine(12.0) == {"e0": 12.0}  # in flight: active now
    runner.finish(a1, "e0", DONE, 13.0)
    runner.end_session("a", 13.0)
    runner.end_session("b", 13.0)
    assert runner.last_active_per_engine(14.0) == {}  # no session left there
