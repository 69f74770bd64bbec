"""The Helm chart, rendered by the real Helm binary (``helm lint --strict``, ``helm template``).

What is checked: the chart lints; every object it renders, with the default values and with the
settings users change (a namespace list, no RBAC, extra env, the monitoring objects), passes
Kubernetes' own schemas (kubernetes-validate; the Prometheus Operator's kinds are checked against
the files they come from and by promtool); the operator container is locked down; the RBAC rule
files grant exactly the verbs the operator uses, and the rendered ClusterRole and Roles hold them
where the namespace list says. What is not checked: installing the chart in a cluster.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.support.helm import (
    CHART,
    NAMESPACE,
    PROMETHEUS_OPERATOR_API,
    RELEASE,
    one,
    render,
    render_error,
    run_helm,
    value_args,
)

K8S_VERSION = "1.32.0"
MONITORING = CHART / "monitoring"
FULLNAME = f"{RELEASE}-misa-t"
ALL_MONITORING = {"monitoring.podMonitors.enabled": True, "monitoring.prometheusRule.enabled": True,
                  "monitoring.grafanaDashboard.enabled": True}

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


def file_objects(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((MONITORING / name).read_text()) if d]


def test_chart_metadata_and_values_parse() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "misa-t"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["resources"]["limits"]["memory"]
    assert (CHART / "crds" / "rolloutpool.yaml").exists()


@pytest.mark.parametrize("values", [{}, {"operator.namespaces": ["rl-a", "rl-b"], "monitoring.grafanaDashboard.enabled": True}],
                         ids=["defaults", "namespaces-and-dashboard"])
def test_chart_lints_strictly(values: dict[str, Any]) -> None:
    """(``helm lint`` cannot be told of the Prometheus Operator's API, so the objects that need it
    are checked by rendering, below.)"""
    done = run_helm("lint", "--strict", str(CHART), *value_args(values, ()))
    assert done.returncode == 0, done.stdout + done.stderr


VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "namespaces": {"operator.namespaces": ["rl-a", "rl-b"], "operator.verbose": True},
    "no-rbac": {"rbac.create": False, "serviceAccount.create": False, "serviceAccount.name": "ops"},
    "scheduling": {"operator.extraEnv": [{"name": "MISAT_OPERATOR_RETRY_DELAY_S", "value": "2"}],
                   "podAnnotations": {"a": "b"}, "imagePullSecrets": [{"name": "regcred"}],
                   "nodeSelector": {"pool": "cpu"}, "tolerations": [{"key": "k", "operator": "Exists"}]},
    "monitoring": ALL_MONITORING,
}


@pytest.mark.parametrize("name", VALUE_SETS)
def test_rendered_objects_pass_kubernetes_schemas(name: str) -> None:
    objects = render(VALUE_SETS[name], api_versions=(PROMETHEUS_OPERATOR_API,))
    core = [o for o in objects if not o["apiVersion"].startswith("monitoring.coreos.com/")]
    assert one(core, "Deployment")
    for obj in core:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        if obj["kind"] not in {"ClusterRole", "ClusterRoleBinding"}:
            assert obj["metadata"]["namespace"] in {NAMESPACE, "rl-a", "rl-b"}, obj["metadata"]["name"]


def test_defaults_render_the_operator_with_cluster_wide_rights() -> None:
    objects = render()
    assert sorted(o["kind"] for o in objects) == ["ClusterRole", "ClusterRoleBinding", "Deployment", "ServiceAccount"]
    assert granted(one(objects, "ClusterRole")["rules"]) == EXPECTED_RULES
    binding = one(objects, "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": FULLNAME, "namespace": NAMESPACE}]
    (container,) = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert container["image"] == f"{values['image']['repository']}:{chart['appVersion']}"
    assert container["resources"] == values["resources"]
    assert not container.get("args")
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["MISAT_OPERATOR_STATUS_INTERVAL_S"] == str(values["operator"]["statusIntervalSeconds"])


def test_a_namespace_list_grants_the_namespaced_rules_only_there() -> None:
    objects = render(VALUE_SETS["namespaces"])
    assert granted(one(objects, "ClusterRole")["rules"]) == CLUSTER_RULES
    roles = {o["metadata"]["namespace"]: o for o in objects if o["kind"] == "Role"}
    bindings = {o["metadata"]["namespace"]: o for o in objects if o["kind"] == "RoleBinding"}
    assert set(roles) == set(bindings) == {"rl-a", "rl-b"}
    for ns in roles:
        assert granted(roles[ns]["rules"]) == NAMESPACED_RULES
        assert bindings[ns]["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": FULLNAME}
        assert bindings[ns]["subjects"] == [{"kind": "ServiceAccount", "name": FULLNAME, "namespace": NAMESPACE}]
    (container,) = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert container["args"] == ["--namespace=rl-a", "--namespace=rl-b", "--verbose"]


def test_without_rbac_the_operator_runs_as_the_named_account() -> None:
    objects = render(VALUE_SETS["no-rbac"])
    assert [o["kind"] for o in objects] == ["Deployment"]
    assert one(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "ops"


def test_operator_container_is_locked_down() -> None:
    pod = one(render(VALUE_SETS["scheduling"]), "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    sc = container["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["command"] == ["python", "-m", "misat_operator"]
    assert {"name": "MISAT_OPERATOR_RETRY_DELAY_S", "value": "2"} in container["env"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}] and pod["nodeSelector"] == {"pool": "cpu"}


# ---- monitoring: the files in monitoring/, installed by the chart -----------------------------


def test_monitoring_is_off_by_default_and_refused_without_the_prometheus_operator() -> None:
    assert not [o for o in render(api_versions=(PROMETHEUS_OPERATOR_API,)) if o["kind"] != "Deployment"
                and o["kind"] not in {"ServiceAccount", "ClusterRole", "ClusterRoleBinding"}]
    for key in ("podMonitors", "prometheusRule"):
        message = render_error({f"monitoring.{key}.enabled": True})
        assert f"monitoring.{key}.enabled needs the Prometheus Operator's CRDs" in message
        assert "--api-versions monitoring.coreos.com/v1" in message
    # The dashboard is a ConfigMap: it needs no CRD.
    assert one(render({"monitoring.grafanaDashboard.enabled": True}), "ConfigMap")


def test_monitoring_objects_are_the_files_renamed_and_labelled() -> None:
    values = {**ALL_MONITORING, "monitoring.namespace": "monitoring",
              "monitoring.podMonitors.labels": {"release": "kps"},
              "monitoring.prometheusRule.labels": {"release": "kps", "role": "alerts"},
              "monitoring.grafanaDashboard.annotations": {"grafana_folder": "RL"}}
    objects = render(values, api_versions=(PROMETHEUS_OPERATOR_API,))
    monitors = [o for o in objects if o["kind"] == "PodMonitor"]
    files = file_objects("podmonitors.yaml")
    assert [m["metadata"]["name"] for m in monitors] == [f"{RELEASE}-misa-t-routers", f"{RELEASE}-misa-t-engines"]
    for monitor, written in zip(monitors, files, strict=True):
        assert monitor["spec"] == written["spec"]
        assert monitor["metadata"]["namespace"] == "monitoring"
        assert monitor["metadata"]["labels"]["release"] == "kps"
        assert monitor["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
    rule = one(objects, "PrometheusRule")
    (written_rule,) = file_objects("prometheusrule.yaml")
    assert rule["spec"] == written_rule["spec"], "Prometheus templates ({{ $labels.pod }}) must pass through Helm"
    assert rule["metadata"]["labels"]["role"] == "alerts" and rule["metadata"]["namespace"] == "monitoring"
    dashboard = one(objects, "ConfigMap")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["metadata"]["annotations"] == {"grafana_folder": "RL"}
    assert json.loads(dashboard["data"]["misa-t.json"]) == json.loads((MONITORING / "grafana-dashboard.json").read_text())
    kubernetes_validate.validate(dashboard, K8S_VERSION, strict=True)


def test_podmonitors_follow_the_operators_namespace_list() -> None:
    objects = render({"monitoring.podMonitors.enabled": True, "operator.namespaces": ["rl-a"]},
                     api_versions=(PROMETHEUS_OPERATOR_API,))
    for monitor in (o for o in objects if o["kind"] == "PodMonitor"):
        assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["rl-a"]}


def test_rendered_alert_rules_load_in_prometheus(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not installed: run `bash scripts/system-packages.sh promtool` (make test does)")
    rule = one(render({"monitoring.prometheusRule.enabled": True}, api_versions=(PROMETHEUS_OPERATOR_API,)),
               "PrometheusRule")
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    done = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 10 rules found" in done.stdout


def test_rbac_grants_exactly_what_the_operator_uses() -> None:
    assert granted(rules_file("cluster-rules.yaml")) == CLUSTER_RULES
    namespaced = granted(rules_file("namespaced-rules.yaml"))
    assert namespaced == NAMESPACED_RULES
    assert not any("delete" in v or "*" in v for v in namespaced.values())
    assert not namespaced[("", "secrets")] & {"list", "watch"}, "no cluster-wide read of Secrets"


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


# ---- values.schema.json: bad values refused by helm, with their path --------------------------

OPERATOR_VALUES = {
    "statusIntervalSeconds": "status_interval_s",
    "routerTimeoutSeconds": "router_timeout_s",
    "clusterDomain": "cluster_domain",
    "postEvents": "post_events",
    "drainTimeoutSeconds": "drain_timeout_s",
    "stalledBackoffSeconds": "stalled_backoff_initial_s",
}
"""The chart's operator values and the settings (operator/settings.py) they become."""
BOUNDS = ("type", "exclusiveMinimum", "minimum", "minLength")


def test_operator_values_carry_the_settings_bounds() -> None:
    from misat_operator.settings import OperatorSettings

    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["operator"]["properties"]
    settings = OperatorSettings.model_json_schema()["properties"]
    for value, field in OPERATOR_VALUES.items():
        want = {k: v for k, v in settings[field].items() if k in BOUNDS}
        assert {k: v for k, v in schema[value].items() if k in BOUNDS} == want, value
    # Every operator setting the Deployment sets comes from one of them.
    (container,) = one(render(), "Deployment")["spec"]["template"]["spec"]["containers"]
    env = {e["name"] for e in container["env"]}
    assert env == {"MISAT_OPERATOR_" + f.upper() for f in OPERATOR_VALUES.values()}


@pytest.mark.parametrize(("values", "message"), [
    ({"operator.statusIntervalSeconds": 0}, "operator.statusIntervalSeconds: Must be greater than 0"),
    ({"operator.drainTimeoutSeconds": -1}, "operator.drainTimeoutSeconds: Must be greater than or equal to 0"),
    ({"operator.postEvents": "yes"}, "operator.postEvents: Invalid type. Expected: boolean, given: string"),
    ({"operator.namespaces": ["RL_jobs"]}, "operator.namespaces.0: Does not match pattern"),
    ({"monitoring.podMonitor.enabled": True}, "monitoring: Additional property podMonitor is not allowed"),
    ({"image.pullPolicy": "Sometimes"}, "image.pullPolicy"),
    ({"resources.limit": {"cpu": "1"}}, "resources: Additional property limit is not allowed"),
], ids=["interval-zero", "drain-negative", "events-string", "namespace-invalid", "typo", "pull-policy", "limits-typo"])
def test_bad_values_are_refused_with_their_path(values: dict[str, Any], message: str) -> None:
    error = render_error(values)
    assert "values don't meet the specifications of the schema" in error
    assert message in error
