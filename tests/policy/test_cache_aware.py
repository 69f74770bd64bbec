"""cache_aware, branch by branch, as the vLLM Router decides it."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from misat_router.policy.cache_aware import CacheAwarePolicy
from misat_router.policy.settings import (
    CacheAwareSettings,
    ClassSpec,
    PolicyName,
    PolicySettings,
    WorkloadMix,
)
from misat_router.policy.types import Action, Completion, EngineSnapshot, Reason, RequestMeta

MIX = WorkloadMix(classes=(ClassSpec(name="rlvr", share=100),))
PROMPT = tuple(range(100, 110))  # 10 tokens


def _policy(**knobs: float) -> CacheAwarePolicy:
    settings = PolicySettings(name=PolicyName.CACHE_AWARE, cache_aware=CacheAwareSettings(**knobs))
    return CacheAwarePolicy(settings, MIX)


def _req(ids: tuple[int, ...] | None = PROMPT, text: str | None = None, rid: str = "r") -> RequestMeta:
    return RequestMeta(
        request_id=rid, workload_class="rlvr", prompt_token_ids=ids, prompt_text=text,
        prompt_tokens=len(ids) if ids else 0,
    )


@dataclass
class Case:
    loads: dict[str, int]
    held: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    """(engine, prefix) inserted in this order before deciding."""
    unhealthy: tuple[str, ...] = ()
    request: RequestMeta = field(default_factory=_req)
    engine: str | None = None
    reason: Reason = Reason.CACHE_MISS


CASES = {
    "imbalance-overrides-full-hit": Case(
        loads={"a": 70, "b": 0}, held=[("a", PROMPT)], engine="b", reason=Reason.IMBALANCE,
    ),
    "abs-gap-without-ratio-is-balanced": Case(
        loads={"a": 300, "b": 210}, held=[("a", PROMPT)], engine="a", reason=Reason.CACHE_HIT,
    ),
    "ratio-without-abs-gap-is-balanced": Case(
        loads={"a": 10, "b": 0}, held=[("a", PROMPT)], engine="a", reason=Reason.CACHE_HIT,
    ),
    "abs-gap-exactly-at-threshold-is-balanced": Case(
        loads={"a": 64, "b": 0}, held=[("a", PROMPT)], engine="a", reason=Reason.CACHE_HIT,
    ),
    "unhealthy-engine-load-counts-for-imbalance": Case(
        loads={"a": 0, "b": 0, "c": 100}, held=[("b", PROMPT)], unhealthy=("c",),
        engine="a", reason=Reason.IMBALANCE,
    ),
    "imbalance-picks-least-loaded-healthy": Case(
        loads={"a": 0, "b": 100, "c": 5}, unhealthy=("a",), engine="c", reason=Reason.IMBALANCE,
    ),
    "hit-above-threshold-beats-load": Case(
        loads={"a": 5, "b": 0}, held=[("a", PROMPT[:4])], engine="a", reason=Reason.CACHE_HIT,
    ),
    "exactly-at-threshold-is-miss": Case(
        loads={"a": 5, "b": 0}, held=[("a", PROMPT[:3])], engine="b", reason=Reason.CACHE_MISS,
    ),
    "best-match-wins-over-partial": Case(
        loads={"a": 0, "b": 3, "c": 0},
        held=[("a", PROMPT[:5]), ("b", PROMPT[:8])], engine="b", reason=Reason.CACHE_HIT,
    ),
    "tie-among-best-goes-to-earliest-holder-not-least-loaded": Case(
        loads={"a": 0, "b": 9}, held=[("b", PROMPT), ("a", PROMPT)],
        engine="b", reason=Reason.CACHE_HIT,
    ),
    "miss-tie-in-load-broken-by-id": Case(loads={"b": 1, "a": 1, "c": 2}, engine="a"),
    "miss-least-loaded": Case(loads={"a": 3, "b": 1, "c": 2}, engine="b"),
    "unhealthy-best-match-never-chosen": Case(
        loads={"a": 0, "b": 1}, held=[("a", PROMPT)], unhealthy=("a",), engine="b",
    ),
    "healthy-partial-hit-when-full-holder-unhealthy": Case(
        loads={"a": 0, "b": 1, "c": 0}, held=[("a", PROMPT), ("b", PROMPT[:5])],
        unhealthy=("a",), engine="b", reason=Reason.CACHE_HIT,
    ),
    "no-healthy-engine-holds": Case(
        loads={"a": 0}, unhealthy=("a",), reason=Reason.HOLD_NO_ENGINE,
    ),
    "empty-prompt-is-miss": Case(
        loads={"a": 1, "b": 0}, held=[("a", PROMPT)], request=_req(ids=()), engine="b",
    ),
    "no-prompt-is-miss": Case(
        loads={"a": 1, "b": 0}, held=[("a", PROMPT)], request=_req(ids=None), engine="b",
    ),
}


def _engines(case: Case) -> dict[str, EngineSnapshot]:
    return {e: EngineSnapshot(engine_id=e, healthy=e not in case.unhealthy) for e in case.loads}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_decide(case: Case) -> None:
    policy = _policy()
    for engine, n in case.loads.items():
        for _ in range(n):
            policy.load.add(engine)
    for t, (engine, prefix) in enumerate(case.held):
        policy.tokens.insert(prefix, engine, float(t))
    decision = policy.decide(case.request, _engines(case), now=100.0)
    assert decision.reason is case.reason
    assert decision.engine_id == case.engine
    if case.engine is None:
        assert decision.action is Action.HOLD


def test_scores_are_match_rates_of_healthy_engines() -> None:
    policy = _policy()
    policy.tokens.insert(PROMPT[:4], "a", 0.0)
    policy.tokens.insert(PROMPT[:2], "c", 0.0)
    engines = {e: EngineSnapshot(engine_id=e, healthy=e != "c") for e in "abc"}
    decision = policy.decide(_req(), engines, now=1.0)
    assert decision.scores == {"a": pytest.approx(0.4), "b": 0.0}


def test_decide_changes_nothing() -> None:
    policy = _policy()
    policy.tokens.insert(PROMPT, "a", 0.0)
    engines = {e: EngineSnapshot(engine_id=e) for e in "ab"}
    first = policy.decide(_req(ids=(*PROMPT, 1)), engines, now=1.0)
    second = policy.decide(_req(ids=(*PROMPT, 1)), engines, now=2.0)
    assert first == second
    assert policy.tokens.sizes() == {"a": len(PROMPT)}
    assert policy.load.total == 0


@pytest.mark.parametrize(
    ("loads", "held", "reason"),
    [
        pytest.param({"a": 0, "b": 0}, False, Reason.CACHE_MISS, id="miss"),
        pytest.param({"a": 0, "b": 0}, True, Reason.CACHE_HIT, id="hit"),
        pytest.param({"a": 0, "b": 100}, False, Reason.IMBALANCE, id="imbalance"),
    ],
)
def test_chosen_engine_learns_the_prompt_on_every_branch(loads, held, reason) -> None:
    policy = _policy()
    for engine, n in loads.items():
        for _ in range(n):
            policy.load.add(engine)
    if held:
        policy.tokens.insert(PROMPT[:5], "a", 0.0)
    engines = {e: EngineSnapshot(engine_id=e) for e in loads}
    decision = policy.decide(_req(), engines, now=1.0)
    assert decision.reason is reason and decision.engine_id == "a"
    policy.on_placed(_req(), "a", now=1.0)
    assert policy.tokens.match(PROMPT) == {"a": len(PROMPT)}
    assert policy.load.get("a") == loads["a"] + 1


def test_repeat_prompt_sticks_to_its_engine_then_finish_frees_load() -> None:
    policy = _policy()
    engines = {e: EngineSnapshot(engine_id=e) for e in "ab"}
    placed = []
    for i in range(4):
        d = policy.decide(_req(rid=str(i)), engines, now=float(i))
        policy.on_placed(_req(rid=str(i)), d.engine_id, now=float(i))
        placed.append((d.engine_id, d.reason))
    assert placed == [("a", Reason.CACHE_MISS)] + [("a", Reason.CACHE_HIT)] * 3
    assert policy.load.get("a") == 4
    policy.on_finished(_req(rid="0"), "a", Completion(prompt_tokens=10, completion_tokens=1), 5.0)
    assert policy.load.get("a") == 3


@pytest.mark.parametrize(
    ("text", "held", "engine", "reason"),
    [
        pytest.param("hello world", [("b", "hello")], "b", Reason.CACHE_HIT, id="text-hit"),
        pytest.param("hello world", [("b", "hel")], "a", Reason.CACHE_MISS, id="text-below"),
        pytest.param("", [("b", "x")], "a", Reason.CACHE_MISS, id="empty-text"),
    ],
)
def test_text_prompts_use_the_character_tree(text, held, engine, reason) -> None:
    policy = _policy()
    for e, s in held:
        policy.text.insert(s, e, 0.0)
    policy.tokens.insert((104, 101), "a", 0.0)  # token tree is not consulted for text
    engines = {e: EngineSnapshot(engine_id=e) for e in "ab"}
    req = _req(ids=None, text=text)
    decision = policy.decide(req, engines, now=1.0)
    assert (decision.engine_id, decision.reason) == (engine, reason)
    policy.on_placed(req, engine, now=1.0)
    assert policy.text.match(text).get(engine, 0) == len(text)


def test_eviction_sweep_runs_once_per_interval_and_trims_lru_per_engine() -> None:
    policy = _policy(max_tree_size=8, eviction_interval_s=10.0)
    engines = {e: EngineSnapshot(engine_id=e) for e in "ab"}
    old, mid, new = (1,) * 4, (2,) * 4, (3,) * 4
    policy.on_epoch(0.0)  # starts the clock
    for t, prompt in enumerate((old, mid, new)):
        policy.on_placed(_req(ids=prompt), "a", now=float(t))
    policy.on_placed(_req(ids=old), "b", now=5.0)
    policy.on_epoch(9.9)
    assert policy.tokens.size("a") == 12  # interval not yet over
    policy.on_epoch(10.0)
    assert policy.tokens.size("a") == 8
    assert policy.tokens.match(old) == {"b": 4}
    assert policy.tokens.match(new) == {"a": 4}
    assert policy.decide(_req(ids=old), engines, now=11.0).engine_id == "b"


def test_engine_removed_forgets_its_prefixes_and_load() -> None:
    policy = _policy()
    policy.on_placed(_req(), "a", now=0.0)
    policy.on_placed(_req(ids=None, text="abc"), "a", now=0.0)
    policy.on_engine_removed("a", now=1.0)
    assert policy.tokens.match(PROMPT) == {}
    assert policy.text.match("abc") == {}
    assert policy.load.total == 0
