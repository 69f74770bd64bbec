"""The Helm chart, without helm (no helm binary is installable here).

What is checked: Chart.yaml and values.yaml parse; the chart's CRD is the generated one
(test_crd.py); every template parses as YAML once its template actions are blanked out
(``{{ ... }}`` -> a placeholder, action-only lines dropped), and the resulting Deployment,
ServiceAccount, ClusterRole and ClusterRoleBinding pass Kubernetes' own schemas
(kubernetes-validate); the operator container is locked down; the RBAC rule files grant exactly
the verbs the operator uses, and the templates put them in the ClusterRole or per-namespace Roles. What is not checked: Helm's actual rendering of the actions
(includes, toYaml/nindent indentation, conditionals), `helm lint`, installing the chart.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

CHART = Path(__file__).resolve().parents[2] / "charts" / "misa-t"
K8S_VERSION = "1.32.0"
PLACEHOLDER = "placeholder"
ACTION_ONLY = re.compile(r"^\s*\{\{-?.*-?\}\}\s*$")
ACTION = re.compile(r"\{\{-?.*?-?\}\}")

# What the operator calls, by API group and resource (kopf's needs included); keep in step with
# docs/operator.md and charts/misa-t/rbac/*.yaml.
CLUSTER_RULES = {
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
    ("", "namespaces"): {"list", "watch"},
}
NAMESPACED_RULES = {
    ("misat.dev", "rolloutpools"): {"list", "watch", "patch"},
    ("misat.dev", "rolloutpools/status"): {"patch"},
    ("misat.dev", "rolloutpools/finalizers"): {"update"},
    ("", "events"): {"create"},
    ("events.k8s.io", "events"): {"create"},
    ("", "secrets"): {"get", "create", "patch"},
    ("", "configmaps"): {"get", "create", "patch", "list", "watch"},
    ("", "services"): {"get", "create", "patch", "list", "watch"},
    ("apps", "deployments"): {"get", "create", "patch", "list", "watch"},
    ("apps", "statefulsets"): {"get", "create", "patch", "list", "watch"},
    ("policy", "poddisruptionbudgets"): {"get", "create", "patch"},
    ("", "pods"): {"list", "patch"},
}
EXPECTED_RULES = CLUSTER_RULES | NAMESPACED_RULES


def blank_actions(text: str) -> str:
    lines = [line for line in text.splitlines() if not ACTION_ONLY.match(line)]
    return "\n".join(ACTION.sub(PLACEHOLDER, line) for line in lines)


def template(name: str) -> dict[str, Any]:
    doc = yaml.safe_load(blank_actions((CHART / "templates" / name).read_text()))
    assert isinstance(doc, dict), name
    return doc


def test_chart_metadata_and_values_parse() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "misa-t"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["resources"]["limits"]["memory"]
    assert (CHART / "crds" / "rolloutpool.yaml").exists()


def templates(name: str) -> list[dict[str, Any]]:
    """Every document of a template (role.yaml holds two per watched namespace)."""
    docs = [d for d in yaml.safe_load_all(blank_actions((CHART / "templates" / name).read_text())) if d]
    assert docs and all(isinstance(d, dict) for d in docs), name
    return docs


def rules_file(name: str) -> list[dict[str, Any]]:
    """charts/misa-t/rbac/<name>: rule lists the RBAC templates read with .Files.Get."""
    rules = yaml.safe_load((CHART / "rbac" / name).read_text())
    assert isinstance(rules, list)
    return rules


def granted(rules: list[dict[str, Any]]) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in rules:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


@pytest.mark.parametrize(
    "name", ["deployment.yaml", "serviceaccount.yaml", "clusterrole.yaml", "clusterrolebinding.yaml", "role.yaml"]
)
def test_templates_pass_kubernetes_schemas(name: str) -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for doc in templates(name):
        if doc["kind"] == "Deployment":
            container = doc["spec"]["template"]["spec"]["containers"][0]
            container["resources"] = values["resources"]  # filled by toYaml in the real render
            container["args"] = []
        if doc["kind"] == "ClusterRole":
            doc["rules"] = rules_file("cluster-rules.yaml") + rules_file("namespaced-rules.yaml")
        if doc["kind"] == "Role":
            doc["rules"] = rules_file("namespaced-rules.yaml")
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_operator_container_is_locked_down() -> None:
    pod = template("deployment.yaml")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    sc = container["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["command"] == ["python", "-m", "misat_operator"]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["resources"]["limits"]["cpu"] and values["resources"]["limits"]["memory"]


def test_rbac_grants_exactly_what_the_operator_uses() -> None:
    assert granted(rules_file("cluster-rules.yaml")) == CLUSTER_RULES
    namespaced = granted(rules_file("namespaced-rules.yaml"))
    assert namespaced == NAMESPACED_RULES
    assert not any("delete" in v or "*" in v for v in namespaced.values())
    assert not namespaced[("", "secrets")] & {"list", "watch"}, "no cluster-wide read of Secrets"


def test_rbac_templates_read_the_rule_files() -> None:
    """Which rules go where (Helm is not run here, so the template text is checked): the ClusterRole
    always has the cluster-scoped rules and the namespaced ones only without a namespace list; each
    watched namespace gets a Role with the namespaced rules and a RoleBinding to it."""
    cluster = (CHART / "templates" / "clusterrole.yaml").read_text()
    assert '.Files.Get "rbac/cluster-rules.yaml"' in cluster
    gate = cluster.index("{{- if not .Values.operator.namespaces }}")
    assert gate < cluster.index('.Files.Get "rbac/namespaced-rules.yaml"') < cluster.index("{{- end }}", gate)
    role = (CHART / "templates" / "role.yaml").read_text()
    assert "{{- range .Values.operator.namespaces }}" in role and "namespace: {{ . }}" in role
    kinds = [d["kind"] for d in templates("role.yaml")]
    assert kinds == ["Role", "RoleBinding"]
    binding = templates("role.yaml")[1]
    assert binding["roleRef"]["kind"] == "Role" and binding["subjects"][0]["kind"] == "ServiceAccount"


def test_operator_only_calls_what_rbac_grants() -> None:
    """The kinds the operator's client can address all have their verbs granted."""
    from misat_operator import kube

    uses = {"pods": {"list", "patch"}}
    for (api_version, _kind), plural in kube._PATHS.items():
        group = api_version.split("/")[0] if "/" in api_version else ""
        assert NAMESPACED_RULES[(group, plural)] >= uses.get(plural, {"get", "create", "patch"}), plural
    from misat_operator.handlers import CHILD_RESOURCES

    for group, _version, plural in CHILD_RESOURCES:  # kopf watches them
        assert NAMESPACED_RULES[(group, plural)] >= {"list", "watch"}, plural
