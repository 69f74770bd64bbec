"""Pure pieces: the three-way patch planner and the status/conditions builders."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from misat_operator.diff import LAST_APPLIED, plan_patch, with_last_applied
from misat_operator.status import (
    Cond,
    Observed,
    Pending,
    Stall,
    held_engines,
    merge_conditions,
    pool_conditions,
    router_view,
    stalled_conditions,
    transitions,
    weight_versions,
)
from misat_router.status import ClassStatus, EngineStatus, RouterStatus

BASE: dict[str, Any] = {
    "apiVersion": "apps/v1",
    "kind": "Deployment",
    "metadata": {"name": "d", "namespace": "ns", "labels": {"a": "1"}},
    "spec": {
        "replicas": 2,
        "template": {"spec": {"nodeSelector": {"gpu": "h100", "zone": "a"},
                              "containers": [{"name": "c", "image": "i:1", "args": ["x"]}]}},
    },
}


def _server_copy(obj: dict[str, Any]) -> dict[str, Any]:
    """What the API server returns: the object plus defaults and server fields."""
    out = copy.deepcopy(obj)
    out["metadata"].update(uid="u", resourceVersion="7", generation=3)
    out["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = "IfNotPresent"
    out["spec"]["progressDeadlineSeconds"] = 600
    out["status"] = {"readyReplicas": 2}
    return out


def test_server_defaults_are_not_changes() -> None:
    current = _server_copy(with_last_applied(BASE))
    assert plan_patch(with_last_applied(BASE), current) is None


def test_only_the_changed_field_is_patched() -> None:
    current = _server_copy(with_last_applied(BASE))
    desired = copy.deepcopy(BASE)
    desired["spec"]["replicas"] = 5
    patch = plan_patch(with_last_applied(desired), current)
    assert patch is not None
    assert patch["spec"] == {"replicas": 5}
    assert set(patch["metadata"]) == {"annotations"}  # the new last-applied record only


def test_a_dropped_map_entry_is_removed() -> None:
    current = _server_copy(with_last_applied(BASE))
    desired = copy.deepcopy(BASE)
    del desired["spec"]["template"]["spec"]["nodeSelector"]["zone"]
    patch = plan_patch(with_last_applied(desired), current)
    assert patch is not None
    assert patch["spec"] == {"template": {"spec": {"nodeSelector": {"zone": None}}}}


def test_a_changed_list_is_replaced_whole() -> None:
    current = _server_copy(with_last_applied(BASE))
    desired = copy.deepcopy(BASE)
    desired["spec"]["template"]["spec"]["containers"][0]["args"] = ["x", "y"]
    patch = plan_patch(with_last_applied(desired), current)
    assert patch is not None
    assert patch["spec"]["template"]["spec"]["containers"] == desired["spec"]["template"]["spec"]["containers"]


def test_fields_set_by_others_survive_without_a_record() -> None:
    """Without last-applied (an object from before), nothing outside desired is removed."""
    current = _server_copy(BASE)
    current["metadata"]["labels"]["team"] = "rl"
    patch = plan_patch(with_last_applied(BASE), current)
    assert patch is not None and set(patch) == {"metadata"}
    assert LAST_APPLIED in patch["metadata"]["annotations"]


def test_bools_are_not_numbers() -> None:
    desired = {"apiVersion": "v1", "kind": "X", "metadata": {"name": "n"}, "spec": {"flag": True}}
    current = {"metadata": {"name": "n"}, "spec": {"flag": 1}}
    assert plan_patch(desired, current) == {"spec": {"flag": True}}


# ---- conditions -----------------------------------------------------------------


def test_transition_time_changes_only_with_status() -> None:
    first = merge_conditions(None, [Cond("Ready", False, "EnginesNotReady", "0/4")], 1, "t1")
    same = merge_conditions(first, [Cond("Ready", False, "RouterNotReady", "router")], 2, "t2")
    assert same[0]["lastTransitionTime"] == "t1" and same[0]["reason"] == "RouterNotReady"
    flipped = merge_conditions(same, [Cond("Ready", True, "AllReady")], 2, "t3")
    assert flipped[0]["lastTransitionTime"] == "t3" and flipped[0]["observedGeneration"] == 2


def _router(generation: int, healthy: int = 2, ready: bool = True, error: str | None = None) -> RouterStatus:
    return RouterStatus(
        generation=generation, config_hash="h", model="policy", policy="misa-t", paused=False, ready=ready,
        draining=False, healthy_engines=healthy, requests_in_flight=0, held_requests=3,
        classes=[
            ClassStatus(name="agentic", target_share=0.486, consumed_share=0.5, completed_units=5,
                        active_sessions=4, held_requests=3, kv_budget_tokens=1000.0, kv_used_tokens=500.0),
            ClassStatus(name="rlvr", target_share=0.514, consumed_share=0.5, completed_units=5,
                        active_sessions=1, held_requests=0, kv_budget_tokens=None, kv_used_tokens=None),
        ],
        engines=[
            EngineStatus(id=f"e{i}", healthy=True, in_flight=0, kv_capacity_tokens=1000, kv_usage=u, running=0,
                         waiting=0, prefix_hit_rate=None, preemptions_total=0, last_scrape_age_s=0.1,
                         last_error=None)
            for i, u in enumerate((0.5, 0.25))
        ],
        kv=[], mixture_tv_points=1.4, sample_rate_per_min=12.345, prefix_hit_rate=0.91234,
        sessions_ended_idle=0, last_reload_error=error, policy_state={},
    )


def _obs(**kw: Any) -> Observed:
    base: dict[str, Any] = dict(
        generation=2, engines_desired=2, engines_ready=2, router_desired=1, router_ready_replicas=1,
        router=_router(2),
    )
    return Observed(**(base | kw))


def _by_type(conds: list[Cond]) -> dict[str, Cond]:
    return {c.type: c for c in conds}


@pytest.mark.parametrize(
    ("case", "obs", "ready_reason", "config", "reconciling"),
    [
        ("all-good", _obs(), "AllReady", "Applied", "Reconciled"),
        ("engines-rolling", _obs(engines_ready=1), "EnginesNotReady", "Applied", "RollingOut"),
        ("router-behind", _obs(router=_router(1)), "ConfigNotApplied", "Pending", "ApplyingConfig"),
        ("reload-refused", _obs(router=_router(1, error="workloads.classes drops [x]")), "ConfigNotApplied",
         "ReloadRefused", "ApplyingConfig"),
        ("router-unreachable", _obs(router=None, router_error="GET /status: refused"), "RouterUnreachable", "Pending",
         "RouterUnreachable"),
        ("no-healthy-engines", _obs(router=_router(2, healthy=0, ready=False)), "RouterNotReady", "Applied",
         "NoHealthyEngines"),
        # Router shards: the pool's Service selects the proxy pods. None ready: not Ready, whatever
        # the shards say; one of two: serving (Ready) while the other rolls out.
        ("no-proxy-ready", _obs(proxy_desired=2, proxy_ready_replicas=0), "ProxyNotReady", "Applied", "RollingOut"),
        ("one-proxy-of-two", _obs(proxy_desired=2, proxy_ready_replicas=1), "AllReady", "Applied", "RollingOut"),
        ("all-good-sharded", _obs(proxy_desired=2, proxy_ready_replicas=2), "AllReady", "Applied", "Reconciled"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_pool_conditions(case: str, obs: Observed, ready_reason: str, config: str, reconciling: str) -> None:
    conds = _by_type(pool_conditions(obs))
    assert conds["Ready"].reason == ready_reason
    assert conds["Ready"].status is (ready_reason == "AllReady")
    assert conds["ConfigApplied"].reason == config
    assert conds["Reconciling"].reason == reconciling
    assert conds["Reconciling"].status is not case.startswith("all-good")
    assert conds["Stalled"].status is False  # a clean apply never stalls


def test_the_proxy_count_is_named_in_the_rollout_message() -> None:
    conds = _by_type(pool_conditions(_obs(proxy_desired=2, proxy_ready_replicas=0)))
    assert conds["Reconciling"].message == "engines 2/2, router 1/1, proxy 0/2"
    assert "proxy 0/2" in conds["Ready"].message and "no endpoint" in conds["Ready"].message
    # Without shards there is no proxy to count.
    assert "proxy" not in _by_type(pool_conditions(_obs(engines_ready=1)))["Reconciling"].message


def test_pending_steps_keep_reconciling_and_only_blocking_ones_clear_ready() -> None:
    drain = _by_type(pool_conditions(_obs(), [Pending("DrainingEngines", "1 engine drains", blocks_ready=False)]))
    assert drain["Reconciling"].status and drain["Reconciling"].reason == "DrainingEngines"
    assert drain["Ready"].status
    port = _by_type(pool_conditions(_obs(), [Pending("EnginePortSwitch", "engines rolling to 9000")]))
    assert not port["Ready"].status and port["Ready"].reason == "EnginePortSwitch"


def test_a_stall_is_not_reconciling_so_kstatus_reports_failed() -> None:
    conds = _by_type(stalled_conditions(Stall("ChildRefused", "Service p-router refused: 422 Invalid")))
    assert conds["Stalled"].status and conds["Stalled"].message == "Service p-router refused: 422 Invalid"
    assert not conds["Reconciling"].status and not conds["Ready"].status
    assert conds["Ready"].reason == "ChildRefused"


def test_retired_conditions_are_dropped_and_transitions_found() -> None:
    old = [{"type": "Degraded", "status": "True", "reason": "InvalidSpec", "lastTransitionTime": "t0"},
           {"type": "Ready", "status": "False", "reason": "InvalidSpec", "lastTransitionTime": "t0"}]
    merged = merge_conditions(old, pool_conditions(_obs()), 2, "t1")
    assert [c["type"] for c in merged] == ["Ready", "Reconciling", "Stalled", "ConfigApplied"]
    assert {c["type"] for c in transitions(old, merged)} == {"Ready", "Reconciling", "Stalled", "ConfigApplied"}
    assert transitions(merged, merge_conditions(merged, pool_conditions(_obs()), 2, "t2")) == []


def test_router_view_sums_kv_and_reports_percentages() -> None:
    view = router_view(_router(2))
    assert view["kv"] == {"capacityTokens": 2000.0, "usedTokens": 750.0, "usedPercent": 37.5}
    assert view["mixture"] == {"target": {"agentic": 48.6, "rlvr": 51.4}, "consumed": {"agentic": 50.0, "rlvr": 50.0},
                               "tvPoints": 1.4}
    agentic = view["classes"][0]
    assert agentic["activeSessions"] == 4 and agentic["heldRequests"] == 3 and agentic["kvUsedTokens"] == 500.0
    assert view["sampleRatePerMin"] == 12.35 and view["prefixHitRate"] == 0.9123


def test_weight_versions_in_use_are_listed_once_each() -> None:
    status = _router(2)
    assert weight_versions(status) is None  # the router knows no version yet
    rows = [e.model_copy(update={"weight_version": v}) for e, v in zip(status.engines, ("step-8", "step-7"), strict=True)]
    assert weight_versions(status.model_copy(update={"engines": rows * 2})) == ["step-7", "step-8"]


def test_engines_held_since_a_restart_are_listed() -> None:
    status = _router(2)
    assert held_engines(status) is None
    reason = "restarted: it serves the weights it loaded at start, not weight version 'step-8'"
    rows = [status.engines[0], status.engines[1].model_copy(update={"held": reason})]
    assert held_engines(status.model_copy(update={"engines": rows})) == [status.engines[1].id]
