"""The rollout order's pure decisions (operator/rollout.py): port change, model change, scale-down."""

from __future__ import annotations

from typing import Any

import yaml

from misat_operator.rollout import (
    Drain,
    EngineRow,
    config_engine_port,
    drain_from_status,
    drain_to_status,
    needs_recreate,
    pick_departing,
    plan_scale,
    pods_of_engines,
    rollout_complete,
    routed_port,
    with_rollout_order,
)


def _deployment(port: int = 8000, generation: int = 2, observed: int = 2, updated: int = 2, replicas: int = 2,
                live: int = 2, ready: int = 2, strategy: str = "RollingUpdate",
                annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "metadata": {"generation": generation, "annotations": annotations or {}},
        "spec": {
            "replicas": replicas, "strategy": {"type": strategy},
            "template": {"spec": {"containers": [{"name": "vllm", "ports": [{"name": "http", "containerPort": port}]}]}},
        },
        "status": {"observedGeneration": observed, "updatedReplicas": updated, "replicas": live, "readyReplicas": ready},
    }


def test_rollout_complete_needs_every_replica_on_the_current_template() -> None:
    assert rollout_complete(_deployment())
    assert not rollout_complete(_deployment(observed=1))  # controller has not seen the new template
    assert not rollout_complete(_deployment(updated=1))
    assert not rollout_complete(_deployment(live=3))  # an old pod still exists
    assert not rollout_complete(_deployment(ready=1))
    assert not rollout_complete(None)


def test_a_port_change_reaches_the_router_only_after_the_engines_rolled() -> None:
    cm = {"data": {"router.yaml": yaml.safe_dump({"engines": {"service": {"name": "x", "port": 8000}}})}}
    assert config_engine_port(cm, "router.yaml") == 8000
    before = _deployment(port=8000)
    assert routed_port(9000, 8000, before) == 8000  # template not patched yet
    assert routed_port(9000, 8000, _deployment(port=9000, generation=3, observed=2)) == 8000  # rolling
    assert routed_port(9000, 8000, _deployment(port=9000, generation=3, observed=3, updated=1)) == 8000
    assert routed_port(9000, 8000, _deployment(port=9000, generation=3, observed=3)) == 9000  # rolled
    assert routed_port(9000, None, None) == 9000  # a new pool: nothing to order
    assert routed_port(8000, 8000, before) == 8000


def test_a_model_change_under_the_same_served_name_rolls_with_recreate_until_done() -> None:
    old = {"misat.dev/model": "org/a", "misat.dev/served-model": "policy"}
    assert needs_recreate(_deployment(annotations=old), "org/b", "policy")
    assert not needs_recreate(_deployment(annotations=old), "org/b", "policy-b")  # names differ: no mix-up
    assert not needs_recreate(_deployment(annotations=old), "org/a", "policy")
    assert not needs_recreate(None, "org/b", "policy")
    new = {"misat.dev/model": "org/b", "misat.dev/served-model": "policy"}
    in_progress = _deployment(annotations=new, strategy="Recreate", generation=3, observed=3, updated=0)
    assert needs_recreate(in_progress, "org/b", "policy")  # keep Recreate while old pods may remain
    assert not needs_recreate(_deployment(annotations=new, strategy="Recreate"), "org/b", "policy")
    rendered = _deployment()
    out = with_rollout_order(rendered, model="org/b", served="policy", recreate=True, replicas=3)
    assert out["spec"]["strategy"] == {"type": "Recreate"} and out["spec"]["replicas"] == 3
    assert out["metadata"]["annotations"] == new
    assert rendered["spec"]["strategy"] == {"type": "RollingUpdate"}  # the render is not mutated


def _row(i: int, sessions: int = 0, healthy: bool = True, draining: bool = False, in_flight: int = 0) -> EngineRow:
    return EngineRow(f"http://10.0.0.{i}:8000", healthy, sessions, in_flight, draining)


def test_departing_engines_are_the_unhealthy_then_the_least_busy() -> None:
    rows = [_row(1, 3), _row(2, 0), _row(3, 1, healthy=False), _row(4, 0, in_flight=2)]
    assert pick_departing(rows, 1) == ("http://10.0.0.3:8000",)
    assert pick_departing(rows, 2) == ("http://10.0.0.2:8000", "http://10.0.0.3:8000")


def test_scale_down_waits_for_the_router_then_the_sessions() -> None:
    rows = [_row(1, 2), _row(2, 1), _row(3, 4)]
    start = plan_scale(2, 3, rows, None, now=100.0, timeout_s=60.0)
    assert start.replicas == 3 and start.draining == ("http://10.0.0.2:8000",) and not start.release
    assert start.drain == Drain(("http://10.0.0.2:8000",), 3, 2, 100.0, 160.0)
    # The router has not confirmed the drain: no shrink, even with nothing left there.
    idle = [_row(1, 2), _row(2, 0), _row(3, 4)]
    assert plan_scale(2, 3, idle, start.drain, 101.0, 60.0).replicas == 3
    acked = [_row(1, 2), _row(2, 1, draining=True), _row(3, 4)]
    waiting = plan_scale(2, 3, acked, start.drain, 110.0, 60.0)
    assert waiting.replicas == 3 and waiting.sessions_left == 1
    done = plan_scale(2, 3, [_row(1, 2), _row(2, 0, draining=True), _row(3, 4)], start.drain, 120.0, 60.0)
    assert done.replicas == 2 and done.release == ("http://10.0.0.2:8000",) and done.cut_sessions == 0


def test_the_deadline_shrinks_anyway_and_says_how_many_sessions_were_cut() -> None:
    drain = Drain(("http://10.0.0.2:8000",), 3, 2, 100.0, 160.0)
    late = plan_scale(2, 3, [_row(1), _row(2, 2, draining=True, in_flight=1)], drain, 160.0, 60.0)
    assert late.replicas == 2 and late.cut_sessions == 3 and "3 live sessions cut" in late.note
    unreachable = plan_scale(2, 3, None, drain, 130.0, 60.0)
    assert unreachable.replicas == 3  # no view of the router: wait (until the deadline)


def test_the_drain_outlives_the_shrink_until_the_pods_are_gone_and_ends_on_scale_up() -> None:
    drain = Drain(("http://10.0.0.2:8000",), 3, 2, 100.0, 160.0)
    shrinking = plan_scale(2, 2, [_row(1), _row(2, draining=True)], drain, 121.0, 60.0, live=3)
    assert shrinking.drain == drain and shrinking.draining == drain.engines and not shrinking.release
    assert plan_scale(2, 2, [_row(1)], drain, 122.0, 60.0, live=2).drain is None
    # Scaled back up mid-drain: the drain is dropped, the router gets its engines back.
    back = plan_scale(3, 3, [_row(1), _row(2, 1, draining=True)], drain, 115.0, 60.0, live=3)
    assert back.drain is None and back.draining == () and back.replicas == 3
    # Scaled down further mid-drain: a new drain with the new target.
    further = plan_scale(1, 3, [_row(1, 1), _row(2, 1, draining=True), _row(3, 5)], drain, 115.0, 60.0)
    assert further.drain is not None and further.drain.to_replicas == 1 and len(further.drain.engines) == 2


def test_without_a_router_the_deployment_shrinks_at_once_with_a_note() -> None:
    plan = plan_scale(2, 3, None, None, 100.0, 60.0)
    assert plan.replicas == 2 and plan.drain is None and "without draining" in plan.note


def test_the_drain_survives_an_operator_restart_through_the_status() -> None:
    drain = Drain(("http://10.0.0.2:8000",), 3, 2, 1_700_000_000.0, 1_700_000_600.0)
    status = {"engines": {"drain": drain_to_status(drain, 4)}}
    assert status["engines"]["drain"]["sessionsLeft"] == 4
    assert drain_from_status(status) == drain
    assert drain_from_status({"engines": {}}) is None
    assert drain_from_status({"engines": {"drain": {"engines": ["x"]}}}) is None


def test_pods_are_matched_to_engines_by_address_and_port() -> None:
    pods = [
        {"metadata": {"name": "a"}, "status": {"podIP": "10.0.0.1"}},
        {"metadata": {"name": "b"}, "status": {"podIP": "10.0.0.2", "podIPs": [{"ip": "10.0.0.2"}, {"ip": "fd00::2"}]}},
        {"metadata": {"name": "c"}, "status": {}},
    ]
    assert pods_of_engines(pods, ["http://10.0.0.2:8000"], 8000) == ["b"]
    assert pods_of_engines(pods, ["http://[fd00::2]:8000"], 8000) == ["b"]
    assert pods_of_engines(pods, ["http://10.0.0.1:9000"], 8000) == []
