"""Least privilege of the pods the project ships, checked on what is rendered (no cluster).

- The router Deployment as ``misat_operator.render`` builds it for every example pool.
- The operator Deployment and RBAC of the Helm chart as ``helm template`` renders them
  (tests/operator/test_chart.py also validates the objects against Kubernetes' schemas).

Required (docs/reliability.md, "Pod security and RBAC"): non-root, read-only root
filesystem, no privilege escalation, every capability dropped, a seccomp profile, CPU and
memory limits, no service-account token where the pod does not call the API, and an
operator ClusterRole without wildcards, without delete, and without read access to
Secrets beyond ``get``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from misat_operator import models
from misat_operator import render as render_mod
from tests.support.helm import CHART, one
from tests.support.helm import render as render_chart

ROOT = Path(__file__).resolve().parents[2]

POOLS = [p for p in sorted((ROOT / "examples").glob("*.yaml"))
         if yaml.safe_load(p.read_text()).get("kind") == "RolloutPool"]


def router_deployment(path: Path) -> dict[str, Any]:
    obj = yaml.safe_load(path.read_text())
    ref = render_mod.PoolRef(obj["metadata"]["name"], "rl", "0c7f3e8a-1111-4222-8333-944455556666", 1)
    desired = render_mod.render(models.parse_spec(obj["spec"]), ref, "t")
    deps = [o for o in desired.objects() if o["kind"] == "Deployment" and o["metadata"]["name"] == ref.names.router]
    assert len(deps) == 1
    return deps[0]


def shard_workloads(path: Path) -> list[dict[str, Any]]:
    """With router shards: the shards' StatefulSet and the HAProxy Deployment in front of them."""
    obj = yaml.safe_load(path.read_text())
    ref = render_mod.PoolRef(obj["metadata"]["name"], "rl", "0c7f3e8a-1111-4222-8333-944455556666", 1)
    desired = render_mod.render(models.parse_spec(obj["spec"]), ref, "t")
    return [o for o in (desired.router_statefulset, desired.proxy_deployment) if o is not None]


def locked_down(container: dict[str, Any], pod: dict[str, Any]) -> list[str]:
    """What is missing from a container's and its pod's security settings."""
    sc, psc = container.get("securityContext", {}), pod.get("securityContext", {})
    missing = []
    if not (sc.get("runAsNonRoot") or psc.get("runAsNonRoot")) or sc.get("runAsUser", psc.get("runAsUser")) == 0:
        missing.append("runAsNonRoot")
    if sc.get("readOnlyRootFilesystem") is not True:
        missing.append("readOnlyRootFilesystem")
    if sc.get("allowPrivilegeEscalation") is not False:
        missing.append("allowPrivilegeEscalation=false")
    if sc.get("privileged"):
        missing.append("not privileged")
    if "ALL" not in sc.get("capabilities", {}).get("drop", []) or sc.get("capabilities", {}).get("add"):
        missing.append("capabilities drop ALL")
    if (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type") not in ("RuntimeDefault", "Localhost"):
        missing.append("seccompProfile")
    return missing


@pytest.mark.parametrize("pool", POOLS, ids=lambda p: p.name)
def test_router_pod_is_locked_down(pool: Path) -> None:
    dep = router_deployment(pool)
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert locked_down(container, pod) == []
    # Writable paths are explicit volumes; the admin token is a read-only Secret mount.
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    secret_vols = {v["name"] for v in pod["volumes"] if "secret" in v}
    assert all(m.get("readOnly") for m in mounts.values() if m["name"] in secret_vols)
    assert "--admin-token-file" in " ".join(container["command"] + container.get("args", []))


SHARDED = [p for p in POOLS if shard_workloads(p)]


@pytest.mark.parametrize("pool", SHARDED, ids=lambda p: p.name)
def test_shard_and_proxy_pods_are_locked_down(pool: Path) -> None:
    for obj in shard_workloads(pool):
        pod = obj["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert locked_down(container, pod) == [], obj["metadata"]["name"]
        assert {"cpu", "memory"} <= set(container["resources"]["limits"]), obj["metadata"]["name"]
        assert pod.get("automountServiceAccountToken") is False, obj["metadata"]["name"]


def test_router_pod_has_resource_limits_by_default() -> None:
    dep = router_deployment(POOLS[0])
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    limits = container.get("resources", {}).get("limits", {})
    assert {"cpu", "memory"} <= set(limits)


def test_router_pod_has_no_service_account_token() -> None:
    pod = router_deployment(POOLS[0])["spec"]["template"]["spec"]
    assert pod.get("automountServiceAccountToken") is False


def test_chart_operator_pod_is_locked_down() -> None:
    dep = one(render_chart(), "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert locked_down(container, pod) == []
    assert dep["spec"]["replicas"] == 1
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert {"cpu", "memory"} <= set(values["resources"]["limits"])
    assert {"cpu", "memory"} <= set(values["resources"]["requests"])


def test_chart_operator_rbac_is_least_privilege() -> None:
    role = one(render_chart(), "ClusterRole")  # every rule the operator gets (no namespace list)
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule.get("apiGroups", [])
        assert not {"delete", "deletecollection", "escalate", "bind", "impersonate"} & set(rule["verbs"]), rule
        if "secrets" in rule["resources"]:
            assert not {"list", "watch"} & set(rule["verbs"]), "listing Secrets reads every Secret's data"
    kinds = {r for rule in role["rules"] for r in rule["resources"]}
    assert not {"pods/exec", "nodes", "clusterroles", "clusterrolebindings", "roles", "rolebindings"} & kinds
