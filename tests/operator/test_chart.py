"""The Helm chart, without helm (no helm binary is installable here).

What is checked: Chart.yaml and values.yaml parse; the chart's CRD is the generated one
(test_crd.py); every template parses as YAML once its template actions are blanked out
(``{{ ... }}`` -> a placeholder, action-only lines dropped), and the resulting Deployment,
ServiceAccount, ClusterRole and ClusterRoleBinding pass Kubernetes' own schemas
(kubernetes-validate); the operator container is locked down; the ClusterRole grants exactly
the verbs the operator uses. What is not checked: Helm's actual rendering of the actions
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
# docs/operator.md and templates/clusterrole.yaml.
EXPECTED_RULES = {
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
    ("", "namespaces"): {"list", "watch"},
    ("misat.dev", "rolloutpools"): {"list", "watch", "patch"},
    ("misat.dev", "rolloutpools/status"): {"patch"},
    ("", "events"): {"create"},
    ("events.k8s.io", "events"): {"create"},
    ("", "secrets"): {"get", "create", "patch"},
    ("", "configmaps"): {"get", "create", "patch"},
    ("", "services"): {"get", "create", "patch"},
    ("apps", "deployments"): {"get", "create", "patch"},
}


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


@pytest.mark.parametrize(
    "name", ["deployment.yaml", "serviceaccount.yaml", "clusterrole.yaml", "clusterrolebinding.yaml"]
)
def test_templates_pass_kubernetes_schemas(name: str) -> None:
    doc = template(name)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    if doc["kind"] == "Deployment":
        container = doc["spec"]["template"]["spec"]["containers"][0]
        container["resources"] = values["resources"]  # filled by toYaml in the real render
        container["args"] = []
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


def test_cluster_role_grants_exactly_what_the_operator_uses() -> None:
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in template("clusterrole.yaml")["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.setdefault((group, resource), set()).update(rule["verbs"])
    assert granted == EXPECTED_RULES
    assert not any("delete" in v or "*" in v or ("list" in v and g[1] == "secrets") for g, v in granted.items())


def test_operator_only_calls_what_rbac_grants() -> None:
    """The child kinds the operator's client can address all have get/create/patch granted."""
    from misat_operator import kube

    for (api_version, _kind), plural in kube._PATHS.items():
        group = api_version.split("/")[0] if "/" in api_version else ""
        assert EXPECTED_RULES[(group, plural)] >= {"get", "create", "patch"}
