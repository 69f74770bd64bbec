"""The Argo CD health check shipped in charts/misa-t/argocd/ runs, as Argo CD runs it, on a pool's states.

Argo CD evaluates ``resource.customizations.health.misat.dev_RolloutPool`` as a Lua chunk with the
object as the global ``obj`` and reads the table it returns (``status``, ``message``). Here the same
script runs in a real Lua interpreter (lupa) on two sets of inputs: the cases of its
``health_test.yaml`` (Argo CD's own layout for a customization's tests), and statuses built by the
operator's own condition functions, so the script and the operator cannot drift apart unnoticed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lupa
import pytest
import yaml

from misat_operator.status import Observed, Pending, Stall, merge_conditions, pool_conditions, stalled_conditions
from misat_router.status import RouterStatus

HERE = Path(__file__).resolve().parents[2] / "charts" / "misa-t" / "argocd" / "misat.dev" / "RolloutPool"
SCRIPT = (HERE / "health.lua").read_text()
ARGO_STATUSES = {"Healthy", "Progressing", "Degraded", "Suspended", "Missing", "Unknown"}


def health(obj: dict[str, Any]) -> dict[str, str]:
    """Run the script as Argo CD does: a fresh Lua state, ``obj`` a global, the chunk's return value read."""
    lua = lupa.LuaRuntime()
    lua.globals().obj = lua.table_from(obj, recursive=True)
    result = lua.execute(SCRIPT)
    out = {"status": str(result["status"]), "message": str(result["message"] or "")}
    assert out["status"] in ARGO_STATUSES
    return out


def _cases() -> list[dict[str, Any]]:
    return list(yaml.safe_load((HERE / "health_test.yaml").read_text())["tests"])


@pytest.mark.parametrize("case", _cases(), ids=lambda c: Path(c["inputPath"]).stem)
def test_health_test_yaml_cases(case: dict[str, Any]) -> None:
    obj = yaml.safe_load((HERE / case["inputPath"]).read_text())
    assert health(obj) == case["healthStatus"]


def test_every_status_the_script_can_give_is_covered() -> None:
    assert {c["healthStatus"]["status"] for c in _cases()} == {"Healthy", "Progressing", "Degraded", "Suspended"}


# ---- on statuses the operator itself builds ------------------------------------------------


def _router(generation: int, healthy: int = 2) -> RouterStatus:
    return RouterStatus(
        generation=generation, config_hash="h", model="policy", policy="misa-t", paused=False, ready=healthy > 0,
        draining=False, healthy_engines=healthy, requests_in_flight=0, held_requests=0, classes=[], engines=[],
        kv=[], mixture_tv_points=0.0, sample_rate_per_min=0.0, prefix_hit_rate=None, sessions_ended_idle=0,
        last_reload_error=None, policy_state={},
    )


def _pool(conds: list[Any], generation: int = 2, replicas: int = 2) -> dict[str, Any]:
    return {
        "metadata": {"name": "p", "generation": generation},
        "spec": {"engines": {"replicas": replicas}},
        "status": {"observedGeneration": generation, "conditions": merge_conditions(None, conds, generation, "t")},
    }


def _obs(**kw: Any) -> Observed:
    base: dict[str, Any] = dict(generation=2, engines_desired=2, engines_ready=2, router_desired=1,
                                router_ready_replicas=1, router=_router(2))
    return Observed(**(base | kw))


@pytest.mark.parametrize(
    ("conds", "expected", "reason"),
    [
        (pool_conditions(_obs()), "Healthy", "AllReady"),
        (pool_conditions(_obs(engines_ready=1)), "Progressing", "RollingOut"),
        (pool_conditions(_obs(router=_router(1))), "Progressing", "ApplyingConfig"),
        (pool_conditions(_obs(router=None, router_error="GET /status: refused")), "Progressing", "RouterUnreachable"),
        (pool_conditions(_obs(), [Pending("EnginePortSwitch", "engines rolling to port 9000")]), "Progressing",
         "EnginePortSwitch"),
        (pool_conditions(_obs(), [Pending("DrainingEngines", "1 engine drains", blocks_ready=False)]), "Progressing",
         "DrainingEngines"),
        (stalled_conditions(Stall("ChildRefused", "Service p-router refused: 422")), "Degraded", "ChildRefused"),
        (stalled_conditions(Stall("NameConflict", "ConfigMap p-router-config exists")), "Degraded", "NameConflict"),
        (stalled_conditions(Stall("InvalidSpec", "spec.workloads: ...")), "Degraded", "InvalidSpec"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_operator_statuses(conds: list[Any], expected: str, reason: str) -> None:
    got = health(_pool(conds))
    assert got["status"] == expected
    assert got["message"].startswith(reason)


def test_a_status_of_an_older_generation_is_progressing_even_if_it_said_ready() -> None:
    obj = _pool(pool_conditions(_obs()))
    obj["metadata"]["generation"] = 3
    assert health(obj)["status"] == "Progressing"


def test_scaled_to_zero_is_suspended() -> None:
    obs = _obs(engines_desired=0, engines_ready=0, router=_router(2, healthy=0))
    assert health(_pool(pool_conditions(obs), replicas=0))["status"] == "Suspended"
