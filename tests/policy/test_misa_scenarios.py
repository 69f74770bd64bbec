"""Scenario tests, one mechanism of MISA-T each, driven through the PolicyRunner."""

from __future__ import annotations

import itertools

import pytest

from misat_router.policy.hit_guard import HitGuard
from misat_router.policy.misa import MisaPolicy
from misat_router.policy.registry import build_policy
from misat_router.policy.runner import PolicyRunner
from misat_router.policy.settings import (
    ClassSpec,
    FootprintSettings,
    PlacementSettings,
    PolicyName,
    PolicySettings,
    ResidencySettings,
    SessionAdmissionSettings,
    WorkloadMix,
)
from misat_router.policy.types import Completion, EngineSnapshot, Reason, RequestMeta

_ids = itertools.count()


def make_runner(
    name: PolicyName = PolicyName.MISA_T,
    classes: tuple[ClassSpec, ...] | None = None,
    **overrides: object,
) -> PolicyRunner:
    mix = WorkloadMix(
        classes=classes
        or (
            ClassSpec(name="rlvr", share=50),
            ClassSpec(name="agentic", share=50, multi_turn=True),
        )
    )
    fields: dict[str, object] = {
        "kv_budget_fraction": 1.0,
        # Footprints by the peak, so that a scenario's caps follow from the sizes it reports;
        # the default statistic (occupancy) has its own tests (test_occupancy).
        "footprint": FootprintSettings(statistic="peak", min_samples=1, bootstrap_tokens=1000),
        "residency": ResidencySettings(min_samples=1),
        **overrides,
    }
    settings = PolicySettings(name=name, **fields)  # type: ignore[arg-type]
    return PolicyRunner(MisaPolicy(settings, mix), mix)


def engines(n: int = 1, capacity: int = 10_000, **kw: object) -> dict[str, EngineSnapshot]:
    return {f"e{i}": EngineSnapshot(engine_id=f"e{i}", kv_capacity_tokens=capacity, **kw) for i in range(n)}  # type: ignore[arg-type]


def req(cls: str, session: str | None = None, turn: int = 0, prompt: int = 32, **kw: object) -> RequestMeta:
    return RequestMeta(
        request_id=f"r{next(_ids)}",
        workload_class=cls,
        session_id=session,
        turn=turn,
        prompt_token_ids=tuple(range(prompt)),
        prompt_tokens=prompt,
        **kw,  # type: ignore[arg-type]
    )


def teach(runner: PolicyRunner, cls: str, tokens: int, duration: float, n: int = 3, t0: float = 0.0) -> None:
    """Complete ``n`` sessions of ``cls`` of ``tokens`` peak KV lasting ``duration`` seconds."""
    big = engines(1, capacity=10**9)
    multi = runner.mix.get(cls).multi_turn  # type: ignore[union-attr]
    for i in range(n):
        r = req(cls, session=f"teach-{cls}-{next(_ids)}" if multi else None)
        d = runner.submit(r, big, t0)
        assert d.placed
        runner.finish(r, d.engine_id, Completion(prompt_tokens=tokens // 2, completion_tokens=tokens // 2), t0 + duration)  # type: ignore[arg-type]
        if multi:
            runner.end_session(r.session_key, t0 + duration)
        assert i >= 0
    runner.remove_engine("e0", t0 + duration)


def fill(runner: PolicyRunner, cls: str, eng: dict[str, EngineSnapshot], n: int, now: float = 10.0) -> list:
    multi = runner.mix.get(cls).multi_turn  # type: ignore[union-attr]
    out = []
    for _ in range(n):
        r = req(cls, session=f"s{next(_ids)}" if multi else None)
        out.append((r, runner.submit(r, eng, now)))
    return out


def placed_count(decisions: list, engine: str | None = None) -> int:
    return sum(1 for _, d in decisions if d.placed and (engine is None or d.engine_id == engine))


def test_session_cap_follows_footprint_single_class() -> None:
    classes = (ClassSpec(name="rlvr", share=100),)
    small, large = make_runner(PolicyName.SESSION_ADMISSION, classes), make_runner(PolicyName.SESSION_ADMISSION, classes)
    teach(small, "rlvr", 1000, 1.0)
    teach(large, "rlvr", 2000, 1.0)
    eng = engines(1, capacity=40_000)
    n_small = placed_count(fill(small, "rlvr", eng, 100))
    n_large = placed_count(fill(large, "rlvr", eng, 100))
    assert n_small == 40
    assert n_large == 20  # footprint doubled: half the sessions


def test_class_with_doubled_footprint_gets_half_the_sessions_at_equal_budget() -> None:
    classes = (
        ClassSpec(name="a", share=50, min_share=0.5, max_share=0.5),
        ClassSpec(name="b", share=50, min_share=0.5, max_share=0.5),
    )
    runner = make_runner(PolicyName.MISA, classes)
    teach(runner, "a", 1000, 1.0)
    teach(runner, "b", 2000, 1.0)
    eng = engines(1, capacity=40_000)
    placed = fill(runner, "a", eng, 40) + fill(runner, "b", eng, 40)
    assert placed_count([p for p in placed if p[0].workload_class == "a"]) == 20
    assert placed_count([p for p in placed if p[0].workload_class == "b"]) == 10


@pytest.mark.parametrize(
    ("policy", "expected_agentic_share"),
    [(PolicyName.MISA, 0.5), (PolicyName.MISA_T, 0.8)],
    ids=["misa-no-time-factor", "misa-t-residency-4x"],
)
def test_agentic_residency_raises_its_budget_share(policy: PolicyName, expected_agentic_share: float) -> None:
    runner = make_runner(policy)
    teach(runner, "rlvr", 1000, duration=10.0)
    teach(runner, "agentic", 1000, duration=40.0)
    eng = engines(1, capacity=100_000)
    # Equal unfinished demand per class: 200 each, far above what fits.
    fill(runner, "rlvr", eng, 200)
    fill(runner, "agentic", eng, 200)
    desc = runner.policy.describe()
    runner.on_metrics(eng, 11.0)
    desc = runner.policy.describe()
    budgets = desc["engines"]["e0"]["classes"]  # type: ignore[index]
    share = budgets["agentic"]["budget_tokens"] / (budgets["agentic"]["budget_tokens"] + budgets["rlvr"]["budget_tokens"])
    assert share == pytest.approx(expected_agentic_share, abs=0.02)


def test_continuations_are_admitted_at_the_cap() -> None:
    classes = (ClassSpec(name="agentic", share=100, multi_turn=True),)
    runner = make_runner(PolicyName.MISA_T, classes)
    teach(runner, "agentic", 1000, 1.0)
    eng = engines(1, capacity=5_000)
    first = fill(runner, "agentic", eng, 5)
    assert placed_count(first) == 5
    held_new = runner.submit(req("agentic", session="fresh"), eng, 11.0)
    assert held_new.reason is Reason.HOLD_SESSION_CAP
    live_session = first[0][0]
    runner.finish(live_session, "e0", Completion(100, 10), 11.0)
    cont = runner.submit(req("agentic", session=live_session.session_id, turn=1), eng, 12.0)
    assert cont.placed and cont.engine_id == "e0" and cont.reason is Reason.CONTINUATION


def test_held_work_released_in_order_when_room_appears() -> None:
    classes = (ClassSpec(name="rlvr", share=100),)
    runner = make_runner(PolicyName.MISA_T, classes)
    teach(runner, "rlvr", 1000, 1.0)
    eng = engines(1, capacity=3_000)
    placed = fill(runner, "rlvr", eng, 3)
    waiting = fill(runner, "rlvr", eng, 5)
    assert all(not d.placed for _, d in waiting)
    order = []
    for i, (r, d) in enumerate(placed):
        runner.finish(r, d.engine_id, Completion(500, 500), 20.0 + i)
        order += [x.request_id for x, _ in runner.release(eng, 20.0 + i)]
    assert order == [r.request_id for r, _ in waiting[:3]]
    assert [e.req.request_id for e in runner.held()] == [r.request_id for r, _ in waiting[3:]]


def test_stale_metrics_never_over_admit() -> None:
    """A snapshot that shows an idle engine long after admissions does not open room."""
    classes = (ClassSpec(name="rlvr", share=100),)
    runner = make_runner(PolicyName.SESSION_ADMISSION, classes)
    teach(runner, "rlvr", 1000, 1.0)
    stale = engines(1, capacity=4_000, num_running=0, scraped_at=0.0)
    runner.on_metrics(stale, 5.0)
    assert placed_count(fill(runner, "rlvr", stale, 10, now=50.0)) == 4


def test_load_not_placed_by_this_router_counts() -> None:
    classes = (ClassSpec(name="rlvr", share=100),)
    runner = make_runner(PolicyName.SESSION_ADMISSION, classes)
    teach(runner, "rlvr", 1000, 1.0)
    busy = engines(1, capacity=10_000, num_running=7, scraped_at=9.0)
    assert placed_count(fill(runner, "rlvr", busy, 10, now=10.0)) == 3


def _feed_hits(runner: PolicyRunner, eng_id: str, rates: list[float], t0: float, state: dict,
               tokens: float = 1000) -> list[float]:
    """Feed one scrape a second per rate, ``tokens`` looked up in each; return the guard's factor after each."""
    factors = []
    for i, rate in enumerate(rates):
        state["q"] += tokens
        state["h"] += tokens * rate
        snap = EngineSnapshot(engine_id=eng_id, kv_capacity_tokens=10_000, prefix_queries_total=state["q"],
                              prefix_hits_total=state["h"], scraped_at=t0 + i)
        runner.on_metrics({eng_id: snap}, t0 + i)
        factors.append(runner.policy.guards[eng_id].factor)  # type: ignore[attr-defined]
    return factors


def test_hit_rate_drop_cuts_new_session_cap_only_after_confirmation_then_recovers() -> None:
    # The paper's rule (no cost check): every gap over the tolerance counts.
    adm = SessionAdmissionSettings(confirm_epochs=3, hit_ewma_alpha=1.0, recovery_per_epoch=0.1,
                                   degradation_cost_tolerance=0.0)
    runner = make_runner(PolicyName.MISA_T, admission=adm)
    state = {"q": 0.0, "h": 0.0}
    factors = _feed_hits(runner, "e0", [0.9] * 5, 0.0, state)
    assert factors == [1.0] * 5
    factors = _feed_hits(runner, "e0", [0.5, 0.5], 10.0, state)
    assert factors == [1.0, 1.0], "two degraded samples are not yet a confirmation"
    factors = _feed_hits(runner, "e0", [0.5], 20.0, state)
    assert factors[0] < 1.0
    cut = factors[0]
    policy = runner.policy
    snap = EngineSnapshot(engine_id="e0", kv_capacity_tokens=10_000)
    assert policy.new_session_cap("e0", snap, 1000.0) < policy.session_cap(snap, 1000.0)  # type: ignore[attr-defined]
    factors = _feed_hits(runner, "e0", [0.9] * 20, 30.0, state)
    assert factors[0] > cut and factors[-1] == 1.0


def test_single_noisy_sample_does_not_cut() -> None:
    adm = SessionAdmissionSettings(confirm_epochs=3, hit_ewma_alpha=1.0, degradation_cost_tolerance=0.0)
    runner = make_runner(PolicyName.MISA_T, admission=adm)
    state = {"q": 0.0, "h": 0.0}
    factors = _feed_hits(runner, "e0", [0.9, 0.9, 0.2, 0.9, 0.2, 0.9, 0.9], 0.0, state)
    assert factors == [1.0] * 7


def test_quiet_engine_samples_do_not_count() -> None:
    adm = SessionAdmissionSettings(confirm_epochs=1, hit_ewma_alpha=1.0, min_queries_per_epoch=5000,
                                   degradation_cost_tolerance=0.0)
    runner = make_runner(PolicyName.MISA_T, admission=adm)
    state = {"q": 0.0, "h": 0.0}
    factors = _feed_hits(runner, "e0", [0.9, 0.1, 0.1], 0.0, state)
    assert factors == [1.0, 1.0, 1.0]


def test_a_hit_gap_counts_only_when_its_lost_prompt_tokens_cost_enough_prefill_time() -> None:
    """degradation_cost_tolerance: a gap of 0.4 at 1,000 looked-up tokens/s loses 400 tokens/s, 2% of a
    20,000 tokens/s engine, under a 5% tolerance: no cut. The same gap at 5,000 tokens/s (10%) cuts."""
    adm = SessionAdmissionSettings(confirm_epochs=1, hit_ewma_alpha=1.0, degradation_cost_tolerance=0.05)
    runner = make_runner(PolicyName.SESSION_ADMISSION, admission=adm)
    assert runner.policy.settings.placement.prefill_tokens_per_s == 20_000  # type: ignore[attr-defined]
    state = {"q": 0.0, "h": 0.0}
    assert _feed_hits(runner, "e0", [0.9] * 3, 0.0, state) == [1.0] * 3
    assert _feed_hits(runner, "e0", [0.5] * 4, 3.0, state) == [1.0] * 4, "cheap gap: no cut"
    guard = runner.policy.guards["e0"]  # type: ignore[attr-defined]
    assert guard.degradation > 0.3
    factors = _feed_hits(runner, "e0", [0.5], 7.0, state, tokens=5000)
    assert factors[0] < 1.0


def test_the_cost_of_a_hit_gap_is_measured_against_the_engines_prefill_rate() -> None:
    """The same feed as above at 1,000 tokens/s cuts on an engine that prefills 2,000 tokens/s (20%)."""
    adm = SessionAdmissionSettings(confirm_epochs=1, hit_ewma_alpha=1.0, degradation_cost_tolerance=0.05)
    runner = make_runner(PolicyName.SESSION_ADMISSION, admission=adm,
                         placement=PlacementSettings(prefill_tokens_per_s=2_000))
    state = {"q": 0.0, "h": 0.0}
    _feed_hits(runner, "e0", [0.9] * 3, 0.0, state)
    assert _feed_hits(runner, "e0", [0.5], 3.0, state)[0] < 1.0


def test_the_query_rate_is_taken_over_the_samples_whole_span() -> None:
    """Quiet scrapes add up to one sample: 1,200 tokens over 4 s is 300 tokens/s, not 1,000 (one scrape's).
    At gap 0.4 and 20,000 tokens/s, 1,000 tokens/s would cost 2% (over a 1.5% tolerance), 300 tokens/s
    costs 0.6% (under it)."""
    adm = SessionAdmissionSettings(confirm_epochs=1, hit_ewma_alpha=1.0, min_queries_per_epoch=1000,
                                   degradation_cost_tolerance=0.015)
    runner = make_runner(PolicyName.SESSION_ADMISSION, admission=adm)
    state = {"q": 0.0, "h": 0.0}
    _feed_hits(runner, "e0", [0.9] * 3, 0.0, state, tokens=1000)
    quiet = [_feed_hits(runner, "e0", [0.5], 3.0 + i, state, tokens=100)[0] for i in range(3)]
    last = _feed_hits(runner, "e0", [0.5], 6.0, state, tokens=900)
    assert quiet + last == [1.0] * 4
    guard = runner.policy.guards["e0"]  # type: ignore[attr-defined]
    assert guard.degradation > 0.35, "the sample counted: its gap was seen, and judged cheap"
    assert _feed_hits(runner, "e0", [0.5], 7.0, state, tokens=1000)[0] < 1.0


def test_a_slowly_sinking_hit_rate_reads_as_a_gap_only_with_the_long_memory() -> None:
    """healthy_hit_decay: a hit rate sinking 0.5 points a sample (sessions piling up) stays within 2%
    of h* at decay 0.98, which forgets the healthy level as fast as the rate sinks; the default 0.9999
    remembers it, so the gap grows past the tolerance and the cap is cut."""
    sinking = [0.9 - 0.005 * i for i in range(60)]
    factors = {}
    for decay in (0.98, SessionAdmissionSettings().healthy_hit_decay):
        adm = SessionAdmissionSettings(confirm_epochs=3, hit_ewma_alpha=1.0, healthy_hit_decay=decay,
                                       degradation_cost_tolerance=0.0)
        runner = make_runner(PolicyName.SESSION_ADMISSION, admission=adm)
        factors[decay] = _feed_hits(runner, "e0", sinking, 0.0, {"q": 0.0, "h": 0.0})
    assert factors[0.98] == [1.0] * len(sinking)
    assert min(factors[0.9999]) < 1.0


def test_prefix_affinity_sends_group_samples_together() -> None:
    classes = (ClassSpec(name="rlvr", share=100),)
    runner = make_runner(PolicyName.MISA_T, classes)
    eng = engines(4, capacity=10**7)
    shared = tuple(range(4096))
    first = runner.submit(RequestMeta("g0", "rlvr", prompt_token_ids=shared, prompt_tokens=4096), eng, 0.0)
    second = runner.submit(RequestMeta("g1", "rlvr", prompt_token_ids=shared, prompt_tokens=4096), eng, 0.0)
    assert second.engine_id == first.engine_id
    assert second.scores["hit_tokens"] == 4096


def test_an_engine_restart_forgets_its_prefixes_and_its_guards_healthy_level() -> None:
    adm = SessionAdmissionSettings(confirm_epochs=1, hit_ewma_alpha=1.0, degradation_cost_tolerance=0.0)
    runner = make_runner(PolicyName.MISA_T, (ClassSpec(name="rlvr", share=100),), admission=adm)
    eng = engines(2, capacity=10**7)
    shared = tuple(range(4096))
    first = runner.submit(RequestMeta("g0", "rlvr", prompt_token_ids=shared, prompt_tokens=4096), eng, 0.0)
    assert first.engine_id is not None
    state = {"q": 0.0, "h": 0.0}
    _feed_hits(runner, first.engine_id, [0.9, 0.9, 0.2], 1.0, state)  # the first reading is a baseline
    guard = runner.policy.guards[first.engine_id]  # type: ignore[attr-defined]
    assert guard.factor < 1.0  # cut, measured against the level before
    runner.engine_restarted(first.engine_id, 5.0)
    assert (guard.factor, guard.healthy, guard.hit_rate) == (1.0, None, None)
    # The prompt it was sent is no longer where the index looks for it.
    again = runner.submit(RequestMeta("g1", "rlvr", prompt_token_ids=shared, prompt_tokens=4096), eng, 6.0)
    assert again.scores["hit_tokens"] == 0


def test_engine_removed_releases_its_sessions_and_continuation_moves() -> None:
    classes = (ClassSpec(name="agentic", share=100, multi_turn=True),)
    runner = make_runner(PolicyName.MISA_T, classes)
    eng = engines(2, capacity=10**6)
    r = req("agentic", session="s-1")
    d = runner.submit(r, eng, 0.0)
    runner.finish(r, d.engine_id, Completion(10, 10), 1.0)  # type: ignore[arg-type]
    runner.remove_engine(d.engine_id, 2.0)  # type: ignore[arg-type]
    policy = runner.policy
    assert policy.engine_sessions.get(d.engine_id, 0) == 0  # type: ignore[attr-defined]
    survivors = {k: v for k, v in eng.items() if k != d.engine_id}
    cont = runner.submit(req("agentic", session="s-1", turn=1), survivors, 3.0)
    assert cont.placed and cont.reason is Reason.CONTINUATION_MOVED


def test_router_restart_reattaches_continuations() -> None:
    classes = (ClassSpec(name="agentic", share=100, multi_turn=True),)
    runner = make_runner(PolicyName.MISA_T, classes)
    teach(runner, "agentic", 1000, 1.0)
    eng = engines(1, capacity=2_000)
    assert placed_count(fill(runner, "agentic", eng, 2)) == 2
    d = runner.submit(req("agentic", session="from-before-restart", turn=7), eng, 11.0)
    assert d.placed and d.reason is Reason.CONTINUATION_MOVED


@pytest.mark.parametrize("name", [PolicyName.MISA_T, PolicyName.MISA, PolicyName.SESSION_ADMISSION])
def test_after_a_restart_a_continuation_goes_to_the_engine_its_client_names(name: PolicyName) -> None:
    """A router that never saw a session cannot find its KV (its prefix index is empty): the
    client's X-Session-Engine places it there, over cost; the router's own record of a session
    it knows wins over the hint, and a hint naming no healthy engine is a moved session."""
    classes = (ClassSpec(name="agentic", share=100, multi_turn=True),)
    runner = make_runner(name, classes)
    eng = engines(3, capacity=10**6)
    eng["e2"] = EngineSnapshot(engine_id="e2", kv_capacity_tokens=10**6, num_waiting=50)  # the costliest
    d = runner.submit(req("agentic", session="old", turn=3, engine_hint="e2"), eng, 0.0)
    assert d.placed and (d.engine_id, d.reason) == ("e2", Reason.CONTINUATION_HINTED)
    assert runner.sessions["old"].engine_id == "e2" and runner.policy.engine_sessions["e2"] == 1  # type: ignore[attr-defined]
    # Known now: its next turn stays where the router placed it, whatever the client says.
    nxt = runner.submit(req("agentic", session="old", turn=4, engine_hint="e0"), eng, 1.0)
    assert (nxt.engine_id, nxt.reason) == ("e2", Reason.CONTINUATION)
    # A hint that names an engine out of rotation, or one this router does not have: moved by cost.
    eng["e1"] = EngineSnapshot(engine_id="e1", kv_capacity_tokens=10**6, healthy=False)
    for hint in ("e1", "http://elsewhere:8000"):
        moved = runner.submit(req("agentic", session=f"other-{hint}", turn=2, engine_hint=hint), eng, 2.0)
        assert (moved.engine_id, moved.reason) == ("e0", Reason.CONTINUATION_MOVED)
    # A new session (turn 0) is admitted as any other, hint or not.
    new = runner.submit(req("agentic", session="new", turn=0, engine_hint="e2"), eng, 3.0)
    assert new.reason is Reason.NEW_SESSION


def test_a_hinted_continuation_still_waits_for_the_concurrency_limit() -> None:
    mix = WorkloadMix(classes=(ClassSpec(name="agentic", share=100, multi_turn=True),))
    settings = PolicySettings(name=PolicyName.SESSION_ADMISSION, concurrency_limit=1)
    runner = PolicyRunner(build_policy(settings, mix), mix)
    eng = engines(2, capacity=10**6)
    assert runner.submit(req("agentic", session="a", turn=0), eng, 0.0).placed
    held = runner.submit(req("agentic", session="b", turn=5, engine_hint="e1"), eng, 0.0)
    assert held.reason is Reason.HOLD_CONCURRENCY_LIMIT


def test_no_healthy_engine_holds() -> None:
    runner = make_runner()
    eng = {"e0": EngineSnapshot(engine_id="e0", healthy=False, kv_capacity_tokens=10_000)}
    assert runner.submit(req("rlvr"), eng, 0.0).reason is Reason.HOLD_NO_ENGINE


def test_pause_holds_everything_and_resume_releases() -> None:
    runner = make_runner()
    eng = engines(1)
    runner.paused = True
    d = runner.submit(req("rlvr"), eng, 0.0)
    assert d.reason is Reason.HOLD_PAUSED
    assert runner.release(eng, 1.0) == []
    runner.paused = False
    assert len(runner.release(eng, 2.0)) == 1


def test_mixture_counts_units_and_tv_distance() -> None:
    runner = make_runner()
    eng = engines(1, capacity=10**7)
    for _ in range(3):
        r = req("rlvr")
        d = runner.submit(r, eng, 0.0)
        runner.finish(r, d.engine_id, Completion(10, 10), 1.0)  # type: ignore[arg-type]
    a = req("agentic", session="traj")
    d = runner.submit(a, eng, 0.0)
    runner.finish(a, d.engine_id, Completion(10, 10), 1.0)  # type: ignore[arg-type]
    assert runner.mixture.completed == {"rlvr": 3, "agentic": 0}
    runner.end_session("traj", 2.0)
    assert runner.mixture.completed == {"rlvr": 3, "agentic": 1}
    assert runner.mixture.tv_points() == pytest.approx(25.0)


def test_idle_multi_turn_session_expires() -> None:
    adm = SessionAdmissionSettings(session_idle_timeout_s=30.0)
    runner = make_runner(admission=adm)
    eng = engines(1, capacity=10**7)
    a = req("agentic", session="idle")
    d = runner.submit(a, eng, 0.0)
    runner.finish(a, d.engine_id, Completion(10, 10), 1.0)  # type: ignore[arg-type]
    runner.epoch(eng, 20.0)
    assert "idle" in runner.sessions
    runner.epoch(eng, 31.0)
    assert "idle" not in runner.sessions and runner.sessions_ended_idle == 1


def test_knob_change_keeps_learned_estimates_and_sessions() -> None:
    runner = make_runner()
    teach(runner, "rlvr", 3000, 5.0)
    eng = engines(1, capacity=10**6)
    r = req("agentic", session="keep-me")
    runner.submit(r, eng, 10.0)
    before = runner.policy
    new = before.settings.model_copy(update={"kv_budget_fraction": 0.5})
    rebuilt = runner.apply_settings(new, runner.mix, 11.0)
    assert not rebuilt and runner.policy is before
    assert runner.policy.footprint_of("rlvr") == 3000  # type: ignore[attr-defined]
    assert runner.policy.settings.kv_budget_fraction == 0.5


def test_policy_switch_hands_over_live_state() -> None:
    runner = make_runner(PolicyName.CACHE_AWARE)
    eng = engines(2, capacity=10**6)
    live = req("agentic", session="carried")
    d = runner.submit(live, eng, 0.0)
    runner.finish(live, d.engine_id, Completion(10, 10), 1.0)  # type: ignore[arg-type]
    busy = req("rlvr")
    d2 = runner.submit(busy, eng, 1.0)
    rebuilt = runner.apply_settings(PolicySettings(name=PolicyName.MISA_T), runner.mix, 2.0,
                                    in_flight=[(busy, d2.engine_id)])  # type: ignore[list-item]
    assert rebuilt
    policy = runner.policy
    assert policy.sessions["carried"].engine_id == d.engine_id  # type: ignore[attr-defined]
    assert policy.load.total == 1
    cont = runner.submit(req("agentic", session="carried", turn=1), eng, 3.0)
    assert cont.reason is Reason.CONTINUATION and cont.engine_id == d.engine_id


def test_an_engine_restart_mid_sample_keeps_what_the_sample_holds_and_when_it_started() -> None:
    """Counters going back (a restart) start a new baseline; the sample still spans from its first scrape."""
    adm = SessionAdmissionSettings(confirm_epochs=1, hit_ewma_alpha=1.0, min_queries_per_epoch=1000,
                                   degradation_cost_tolerance=0.015)
    guard = HitGuard(adm, prefill_tokens_per_s=20_000)

    def scrape(at: float, q: float, h: float) -> None:
        guard.observe(EngineSnapshot(engine_id="e0", prefix_queries_total=q, prefix_hits_total=h, scraped_at=at))

    scrape(0.0, 0, 0)
    scrape(1.0, 1000, 900)  # healthy 0.9
    scrape(2.0, 1600, 1200)  # 600 looked up at 0.5: not yet a sample
    scrape(3.0, 100, 50)  # restart: counters back to near zero
    scrape(4.0, 500, 250)  # +400 at 0.5: the sample (1,000 tokens over 3 s, 333/s) closes
    assert guard.hit_rate == 0.5
    assert guard.factor == 1.0, "0.4 x 333/s over 20,000/s is 0.7%: under the 1.5% tolerance"
