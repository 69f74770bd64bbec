"""The generated CRD: in sync, structural, and it accepts the examples and refuses hostile input.

What stands in for the API server here (no kube-apiserver can run on this machine):
- OpenAPI schema: ``jsonschema`` (Draft 4: OpenAPI v3.0's boolean exclusiveMinimum), once as is,
  once with ``additionalProperties: false`` on every object to stand in for strict field
  validation (kubectl's default): an unknown field must be refused, not silently pruned.
- CEL: ``cel-python`` evaluates every ``x-kubernetes-validations`` rule at its place in the
  object. It lacks the Kubernetes list extension ``sum()``; the test registers a ``sum`` with
  the extension's meaning (add up a list of numbers). Kubernetes' cost estimator, ``has()`` on
  absent list items and CEL type-checking against the schema are *not* checked here.
- Not checked: defaulting and pruning by the API server, printer-column rendering.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import celpy
import celpy.celtypes as celtypes
import jsonschema
import pytest
import yaml
from pydantic import ValidationError

from misat_operator.crd import CRD_PATHS, build_crd, render_yaml
from misat_operator.models import RolloutPoolSpec, describe_spec_error, pool_name_error

ROOT = Path(__file__).resolve().parents[2]
POOL_EXAMPLES = [
    p for p in sorted((ROOT / "examples").glob("*.yaml")) if yaml.safe_load(p.read_text()).get("kind") == "RolloutPool"
]
SCHEMA = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _strict(node: Any) -> Any:
    if isinstance(node, list):
        return [_strict(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict(v) for k, v in node.items()}
    if node.get("type") == "object" and "properties" in node:
        out["additionalProperties"] = False
    return out


STRICT = _strict(SCHEMA)
STRICT["properties"]["metadata"] = {"type": "object"}


def schema_errors(obj: dict[str, Any], *, strict: bool = True) -> list[str]:
    validator = jsonschema.Draft4Validator(STRICT if strict else SCHEMA)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]


# ---- CEL ---------------------------------------------------------------------


def _k8s_sum(values: celtypes.ListType) -> celtypes.Value:
    """The Kubernetes CEL list extension ``sum()`` (absent from cel-python)."""
    total: celtypes.Value = celtypes.DoubleType(0.0)
    for v in values:
        total = celtypes.DoubleType(float(total) + float(v))
    return total


def _rules(node: dict[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], dict[str, str]]]:
    for rule in node.get("x-kubernetes-validations", []):
        yield path, rule
    for name, sub in node.get("properties", {}).items():
        yield from _rules(sub, (*path, name))
    if "items" in node:
        yield from _rules(node["items"], (*path, "[]"))


RULES = list(_rules(SCHEMA))
_ENV = celpy.Environment()
_PROGRAMS = {r["rule"]: _ENV.program(_ENV.compile(r["rule"]), functions={"sum": _k8s_sum}) for _, r in RULES}


def _values_at(obj: Any, path: tuple[str, ...]) -> Iterator[Any]:
    if not path:
        yield obj
        return
    head, rest = path[0], path[1:]
    if head == "[]":
        for item in obj if isinstance(obj, list) else []:
            yield from _values_at(item, rest)
    elif isinstance(obj, dict) and head in obj:
        yield from _values_at(obj[head], rest)


def cel_failures(obj: dict[str, Any]) -> list[str]:
    failures = []
    for path, rule in RULES:
        for value in _values_at(obj, path):
            result = _PROGRAMS[rule["rule"]].evaluate({"self": celpy.json_to_cel(value)})
            if isinstance(result, Exception) or not bool(result):
                failures.append(rule["message"])
    return failures


# ---- in sync and structural ----------------------------------------------------


@pytest.mark.parametrize("rel", CRD_PATHS)
def test_checked_in_crd_is_current(rel: str) -> None:
    path = ROOT / rel
    assert path.read_text() == render_yaml(), (
        f"{rel} is stale: run `python -m misat_operator.crd --write` and commit the result"
    )


def _walk(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(node, dict):
        yield path, node
        for name, sub in node.get("properties", {}).items():
            yield from _walk(sub, f"{path}.{name}")
        if isinstance(node.get("items"), dict):
            yield from _walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            yield from _walk(node["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural() -> None:
    for path, node in _walk(SCHEMA):
        escape = node.get("x-kubernetes-int-or-string") or node.get("x-kubernetes-preserve-unknown-fields")
        assert "type" in node or escape, f"{path}: no type"
        assert "$ref" not in node and "$defs" not in node, path
        assert "anyOf" not in node or node.get("x-kubernetes-int-or-string"), f"{path}: anyOf"
        assert not ("properties" in node and "additionalProperties" in node), path
        assert node.get("additionalProperties") is not False, path
        assert isinstance(node.get("exclusiveMinimum", True), bool), path
        assert "title" not in node, path
        if path.startswith(".spec") and path.count(".") >= 2 and "type" in node:
            assert "description" in node or path.endswith("[]") or "{}" in path or node["type"] in (
                "string", "integer", "number", "boolean", "array", "object"
            ), path


def test_the_spec_schema_defaults_nothing_but_the_scale_path() -> None:
    """Tunables stay unset in stored objects: a default in the CRD would be written into every pool
    and outlive the release that chose it. Only .spec.engines.replicas (the scale subresource's
    path, which must exist) is defaulted."""
    defaults = {path: node["default"] for path, node in _walk(SCHEMA["properties"]["spec"]) if "default" in node}
    assert defaults == {".engines": {}, ".engines.replicas": 1}
    for path, node in _walk(SCHEMA):
        if "default" in node:
            sub = {k: v for k, v in node.items() if k != "default"}
            errors = list(jsonschema.Draft4Validator(sub).iter_errors(node["default"]))
            assert not errors, f"{path}: default {node['default']!r}: {errors[0].message}"


def test_spec_fields_are_described_for_kubectl_explain() -> None:
    spec = SCHEMA["properties"]["spec"]
    for name in ("model", "engines", "workloads", "kvBudget", "admission", "router"):
        assert spec["properties"][name].get("description"), name
    admission = spec["properties"]["admission"]["properties"]
    assert admission["sessionAdmission"]["properties"]["confirmEpochs"]["description"]


def test_subresources_columns_and_names() -> None:
    crd = build_crd()
    version = crd["spec"]["versions"][0]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.engines.replicas"
    assert version["subresources"]["scale"]["statusReplicasPath"] == ".status.engines.ready"
    assert version["subresources"]["status"] == {}
    columns = [c["name"].upper() for c in version["additionalPrinterColumns"] if c.get("priority", 0) == 0]
    assert columns == ["READY", "ENGINES", "KV-USED", "MIX-TV", "SAMPLES/MIN", "AGE"]
    assert crd["spec"]["names"]["shortNames"] == ["rp"]
    for col in version["additionalPrinterColumns"]:
        field = col["jsonPath"].split("[")[0].lstrip(".").split(".")
        if field[0] == "metadata":
            continue
        node = SCHEMA
        for part in field:
            node = node["properties"][part]
        assert node, col


# ---- examples and hostile input ---------------------------------------------------


@pytest.mark.parametrize("path", POOL_EXAMPLES, ids=lambda p: Path(p).name)
def test_examples_pass_schema_cel_and_the_model(path: Path) -> None:
    obj = yaml.safe_load(path.read_text())
    assert schema_errors(obj) == []
    assert cel_failures(obj) == []
    RolloutPoolSpec.model_validate(obj["spec"])


def _set(obj: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    node: Any = out
    keys = path.split(".")
    for key in keys[:-1]:
        node = node[int(key)] if key.isdigit() else node.setdefault(key, {})
    last = keys[-1]
    if last.isdigit():
        node[int(last)] = value
    elif value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return out


_DELETE = object()

SCHEMA_HOSTILE = [
    ("spec.engines.replicas", -1),
    ("spec.engines.replicas", "4"),
    ("spec.engines.gpuMemoryUtilization", 0),
    ("spec.engines.gpuMemoryUtilization", 1.5),
    ("spec.engines.imagePullPolicy", "Sometimes"),
    ("spec.engines.extraArgs", [1, 2]),
    ("spec.engines.tolerations.0.operator", "Maybe"),
    ("spec.engines.gpu", 1),
    ("spec.admission.policy", "fastest"),
    ("spec.admission.footprint.statistic", "p90"),
    ("spec.admission.sessionAdmission.epochS", 0),
    ("spec.admission.kvBudgetFraction", 0.5),
    ("spec.workloads", []),
    ("spec.workloads", [{"name": f"c{i}", "share": 5} for i in range(20)]),
    ("spec.workloads.0.share", 150),
    ("spec.workloads.0.name", "Agentic"),
    ("spec.workloads.0.name", _DELETE),
    ("spec.workloads.1.maxKvShare", 2),
    ("spec.model", _DELETE),
    ("spec.model.name", ""),
    ("spec.router.replicas", 2),
    ("spec.router.port", 70000),
    ("spec.kvBudget.fraction", -0.1),
    ("spec.engines.resources.limits.cpu", [1]),
    # Refused by the API server on a child, so refused on the pool itself:
    ("spec.engines.resources.limits.memory", "lots"),
    ("spec.engines.resources.limits.cpu", 0.5),
    ("spec.engines.env.0.name", "1X"),
    ("spec.engines.image", "vllm/vllm-openai latest"),
    ("spec.engines.port", 80),
    ("spec.engines.listenAddress", "localhost"),
    ("spec.engines.serviceAccountName", "Bad_Name"),
    ("spec.engines.imagePullSecrets", [{"name": "a b"}]),
    ("spec.engines.modelCache.claimName", "UPPER"),
    ("spec.engines.shmSize", "16GB"),
    ("spec.router.port", 80),
    ("spec.engines.env.0.valueFrom", {"secretKeyRef": {"name": "s"}}),
]


@pytest.mark.parametrize(("path", "value"), SCHEMA_HOSTILE, ids=lambda v: v if isinstance(v, str) else None)
def test_schema_refuses_hostile_input(mixed_pool: dict[str, Any], path: str, value: Any) -> None:
    bad = _set(mixed_pool, path, value)
    assert schema_errors(bad), f"schema accepted {path}={value!r}"
    if path.startswith("spec.") and value != "4":  # pydantic's lax mode reads "4" as 4; the API server won't
        with pytest.raises(ValidationError):
            RolloutPoolSpec.model_validate(bad["spec"])


def test_unknown_fields_are_pruned_not_refused_without_strict_validation(mixed_pool: dict[str, Any]) -> None:
    bad = _set(mixed_pool, "spec.engines.gpu", 1)
    assert schema_errors(bad, strict=False) == []
    assert schema_errors(bad)


# Cross-field rules: the schema alone accepts these; CEL and the model must both refuse.
CEL_CASES = [
    ("shares-sum-90", "spec.workloads.0.share", 38.6, "workload shares must sum to 100"),
    ("duplicate-names", "spec.workloads.1.name", "agentic", "workload class names must be unique"),
    ("min-above-max", "spec.workloads.2.minKvShare", 0.9, "minKvShare must not be above maxKvShare"),
    ("unknown-default-class", "spec.defaultClass", "chat", "defaultClass must name one of workloads"),
    ("tp-above-gpus", "spec.engines.tensorParallelSize", 8, "tensorParallelSize must not exceed gpusPerReplica"),
    ("name-too-long", "metadata.name", "p" * 41, "metadata.name must be at most 40 characters"),
    ("name-with-a-dot", "metadata.name", "pool.v2", "metadata.name must be a DNS-1035 label"),
    ("name-starting-with-a-digit", "metadata.name", "7b-pool", "metadata.name must be a DNS-1035 label"),
    ("env-value-and-valueFrom", "spec.engines.env.0", {"name": "X", "value": "1", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}, "value and valueFrom are exclusive"),
    ("valueFrom-two-sources", "spec.engines.env.0", {"name": "X", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}, "fieldRef": {"fieldPath": "metadata.name"}}}, "valueFrom must name exactly one source"),
    ("toleration-without-key", "spec.engines.tolerations.0", {"operator": "Equal", "value": "x"}, "operator must be Exists when key is empty"),
    ("toleration-seconds-without-NoExecute", "spec.engines.tolerations.0", {"key": "k", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 30}, "tolerationSeconds needs effect NoExecute"),
    ("external-and-created", "spec.engines.external", {"urls": ["http://10.0.0.5:8000"]}, "external engines are not created by the operator"),
    ("external-service-and-urls", "spec.engines", {"external": {"urls": ["http://e:8000"], "service": {"name": "fleet"}}}, "give exactly one of service or urls"),
    ("cache-claim-and-size", "spec.engines.modelCache", {"claimName": "hf", "sizeLimit": "1Gi"}, "claimName and sizeLimit are exclusive"),
    ("spread-minDomains", "spec.engines.topologySpreadConstraints", [{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "ScheduleAnyway", "minDomains": 2}], "minDomains needs whenUnsatisfiable DoNotSchedule"),
]


@pytest.mark.parametrize(("case", "path", "value", "message"), CEL_CASES, ids=[c[0] for c in CEL_CASES])
def test_cel_and_model_agree_on_cross_field_rules(
    mixed_pool: dict[str, Any], case: str, path: str, value: Any, message: str
) -> None:
    bad = _set(mixed_pool, path, value)
    assert schema_errors(bad) == [], "the schema alone should not catch a cross-field rule"
    failures = cel_failures(bad)
    assert any(message in f for f in failures), failures
    if path.startswith("spec."):
        with pytest.raises(ValidationError):
            RolloutPoolSpec.model_validate(bad["spec"])
    else:
        assert pool_name_error(bad["metadata"]["name"])


# What neither the schema nor CEL can say (quantities compared, names against every child kind,
# vLLM's argument syntax, sizes): the model refuses it before any write, naming the manifest path.
MODEL_ONLY = [
    ("router-requests-above-default-limits", "spec.router.resources.requests.cpu", "4", "spec.router.resources.requests.cpu: must be less than or equal to the cpu limit of 2"),
    ("requests-above-limits", "spec.engines.resources.requests.memory", "256Gi", "spec.engines.resources.requests.memory: must be less than or equal to the memory limit of 192Gi"),
    ("gpu-in-resources", "spec.engines.resources.requests|nvidia.com/gpu", 1, "spec.engines.resources.requests[nvidia.com/gpu]: a request needs an equal limit"),
    ("extended-request-without-limit", "spec.engines.resources.requests|rdma/hca", 1, "spec.engines.resources.requests[rdma/hca]: a request needs an equal limit"),
    ("fractional-extended", "spec.engines.resources.limits|rdma/hca", "500m", "spec.engines.resources.limits[rdma/hca]: must be a whole number"),
    ("unqualified-resource", "spec.engines.resources.limits.gpu", 1, "spec.engines.resources.limits.gpu: 'gpu' is not a standard resource"),
    ("extra-args-typed-flag", "spec.engines.extraArgs", ["-tp", "8"], "spec.engines.extraArgs[0]: '-tp' (vLLM's --tensor-parallel-size) is set by the operator from spec.engines.tensorParallelSize"),
    ("extra-args-api-key", "spec.engines.extraArgs", ["--api-key", "x"], "spec.engines.extraArgs[0]: --api-key is refused"),
    ("extra-args-too-long", "spec.engines.extraArgs", [f"--x{i}=" + "v" * 4000 for i in range(8)], "spec.engines.extraArgs: 32" ),
    ("env-set-by-the-operator", "spec.engines.env.0.name", "HF_HOME", "spec.engines.env[0]: HF_HOME is set by the operator from spec.engines.modelCache"),
    ("env-api-key", "spec.engines.env.0.name", "VLLM_API_KEY", "spec.engines.env[0]: VLLM_API_KEY is refused"),
    ("pod-label-of-the-operator", "spec.engines.podLabels", {"misat.dev/pool": "other"}, "spec.engines.podLabels[misat.dev/pool]: is set by the operator"),
    ("node-selector-value", "spec.engines.nodeSelector", {"zone": "a b"}, "spec.engines.nodeSelector[zone]: value 'a b'"),
    ("affinity-In-without-values", "spec.engines.affinity", {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In"}]}]}}}, "matchExpressions[0].values: values must be non-empty when operator is In"),
    ("mount-paths-collide", "spec.engines.modelVolume", {"mountPath": "/dev/shm", "source": {"persistentVolumeClaim": {"claimName": "w"}}}, "two volumes would mount at /dev/shm"),
    ("volume-source-unknown", "spec.engines.modelVolume", {"source": {"bucket": {"name": "w"}}}, "spec.engines.modelVolume.source: 'bucket' is not a Kubernetes volume source"),
    ("router-startup-budget", "spec.router.probes", {"startupBudgetSeconds": 60}, "spec.router.probes.startupBudgetSeconds: applies to engines only"),
    ("handback-without-shards", "spec.router.handbackIdleSeconds", 30, "spec.router.handbackIdleSeconds: applies to router shards only"),
]


@pytest.mark.parametrize(("case", "path", "value", "message"), MODEL_ONLY, ids=[c[0] for c in MODEL_ONLY])
def test_model_refuses_what_only_a_child_would_show(
    mixed_pool: dict[str, Any], case: str, path: str, value: Any, message: str
) -> None:
    parent, _, key = path.partition("|")  # "|" sets a map key that holds dots or a slash
    bad = _set(mixed_pool, parent, {**_get(mixed_pool, parent), key: value}) if key else _set(mixed_pool, path, value)
    assert schema_errors(bad) == [], "the schema should not catch this"
    assert cel_failures(bad) == [], "CEL should not catch this"
    with pytest.raises(ValidationError) as err:
        RolloutPoolSpec.model_validate(bad["spec"])
    assert message in describe_spec_error(err.value)


def _get(obj: dict[str, Any], path: str) -> Any:
    node: Any = obj
    for key in path.split("."):
        node = node[int(key)] if key.isdigit() else node.get(key, {})
    return node


def test_min_kv_shares_summing_above_one_fail_cel(mixed_pool: dict[str, Any]) -> None:
    bad = copy.deepcopy(mixed_pool)
    for w in bad["spec"]["workloads"]:
        w.pop("maxKvShare", None)
        w["minKvShare"] = 0.4
    assert "minKvShare values must not sum above 1" in cel_failures(bad)
    fine = copy.deepcopy(bad)
    fine["spec"]["workloads"][0]["minKvShare"] = 0.1
    assert cel_failures(fine) == []


def test_shares_given_as_integers_sum_like_numbers(mixed_pool: dict[str, Any]) -> None:
    obj = copy.deepcopy(mixed_pool)
    obj["spec"]["workloads"] = [{"name": "a", "share": 50}, {"name": "b", "share": 50}]
    assert schema_errors(obj) == [] and cel_failures(obj) == []
