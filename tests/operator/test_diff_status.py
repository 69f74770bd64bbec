"""Pure pieces: the three-way patch planner and the status/conditions builders."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from misat_operator.diff import LAST_APPLIED, plan_patch, with_last_applied
from misat_operator.status import (
    Cond,
    Observed,
    health_conditions,
    merge_conditions,
    router_view,
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
    ("case", "obs", "ready_reason", "config", "degraded"),
    [
        ("all-good", _obs(), "AllReady", "Applied", "AsExpected"),
        ("engines-rolling", _obs(engines_ready=1), "EnginesNotReady", "Applied", "AsExpected"),
        ("router-behind", _obs(router=_router(1)), "ConfigNotApplied", "Pending", "AsExpected"),
        ("reload-refused", _obs(router=_router(1, error="workloads.classes drops [x]")), "ConfigNotApplied",
         "ReloadRefused", "AsExpected"),
        ("router-unreachable", _obs(router=None, router_error="GET /status: refused"), "RouterNotReady", "Pending",
         "RouterUnreachable"),
        ("no-healthy-engines", _obs(router=_router(2, healthy=0, ready=False)), "RouterNotReady", "Applied",
         "NoHealthyEngines"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_health_conditions(case: str, obs: Observed, ready_reason: str, config: str, degraded: str) -> None:
    conds = _by_type(health_conditions(obs))
    assert conds["Ready"].reason == ready_reason
    assert conds["Ready"].status is (ready_reason == "AllReady")
    assert conds["ConfigApplied"].reason == config
    assert conds["Degraded"].reason == degraded
    assert conds["Progressing"].status is (case in ("engines-rolling", "router-behind", "reload-refused",
                                                      "router-unreachable"))


def test_router_view_sums_kv_and_reports_percentages() -> None:
    view = router_view(_router(2))
    assert view["kv"] == {"capacityTokens": 2000.0, "usedTokens": 750.0, "usedPercent": 37.5}
    assert view["mixture"] == {"target": {"agentic": 48.6, "rlvr": 51.4}, "consumed": {"agentic": 50.0, "rlvr": 50.0},
                               "tvPoints": 1.4}
    agentic = view["classes"][0]
    assert agentic["activeSessions"] == 4 and agentic["heldRequests"] == 3 and agentic["kvUsedTokens"] == 500.0
    assert view["sampleRatePerMin"] == 12.35 and view["prefixHitRate"] == 0.9123
