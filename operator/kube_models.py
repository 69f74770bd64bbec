"""Kubernetes building blocks of the pod templates, typed with the API server's own rules.

Each model here becomes part of an engine or router pod. A field the API server
would refuse on the Deployment is refused here first, with the manifest's path
(and, where the CRD can say it, by the schema or a CEL rule too), so a pool is
never half applied. Only what the pod templates use is modelled: a field
outside these models is refused (``extra="forbid"``), not passed through.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, WithJsonSchema, field_validator, model_validator
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

from . import kube_validation as kv

MAX_LIST = 64
"""Upper bound on the list fields below (CEL cost stays bounded for the API server)."""


class KubeModel(BaseModel):
    model_config = ConfigDict(
        frozen=True, extra="forbid", alias_generator=to_camel, populate_by_name=True,
        use_attribute_docstrings=True,
    )

    def to_kube(self) -> dict[str, Any]:
        """The object as the API expects it: camelCase, unset and default-valued fields left out."""
        return self.model_dump(by_alias=True, exclude_none=True, exclude_defaults=True, mode="json")


def key_path(dotted: str) -> str:
    """``limits.nvidia.com/gpu`` -> ``.limits[nvidia.com/gpu]`` (a map key holding dots stays one part)."""
    head, _, key = dotted.partition(".")
    return f".{head}[{key}]" if any(c in key for c in "./") else f".{dotted}"


def rules(*pairs: tuple[str, str]) -> dict[str, Any]:
    """``x-kubernetes-validations`` (CEL rule, message) for a model's or field's schema."""
    return {"x-kubernetes-validations": [{"rule": r, "message": m} for r, m in pairs]}


def refuse(problems: list[tuple[str, str]]) -> PydanticCustomError:
    """One validation error carrying several (sub-path, message) problems; ``describe_spec_error``
    turns each into its own line under the field's path."""
    summary = "; ".join(f"{sub.lstrip('.') or 'here'}: {msg}" if sub else msg for sub, msg in problems)
    return PydanticCustomError("refused", "{summary}", {"summary": summary, "problems": problems})


def _check(check: Any) -> Any:
    def validate(value: Any) -> Any:
        if not isinstance(value, str):
            raise PydanticCustomError("string_type", "Input should be a valid string")
        problem = check(value)
        if problem:
            raise refuse([("", f"{value!r}: {problem}")])
        return value
    return validate


Subdomain = Annotated[
    str, PlainValidator(_check(kv.dns1123_subdomain)),
    WithJsonSchema({"type": "string", "maxLength": kv.SUBDOMAIN_MAX, "pattern": kv.DNS1123_SUBDOMAIN}),
]
"""A name of a Kubernetes object (Secret, ServiceAccount, PriorityClass, ...)."""
Dns1035Label = Annotated[
    str, PlainValidator(_check(kv.dns1035_label)),
    WithJsonSchema({"type": "string", "maxLength": kv.LABEL_MAX, "pattern": kv.DNS1035_LABEL}),
]
"""A Service name."""
Dns1123Label = Annotated[
    str, PlainValidator(_check(kv.dns1123_label)),
    WithJsonSchema({"type": "string", "maxLength": kv.LABEL_MAX, "pattern": kv.DNS1123_LABEL}),
]
"""A namespace name."""
QualifiedName = Annotated[
    str, PlainValidator(_check(kv.qualified_name)),
    WithJsonSchema({"type": "string", "maxLength": kv.SUBDOMAIN_MAX + 1 + kv.LABEL_MAX}),
]
"""A label or annotation key (``[prefix/]name``)."""


def _quantity(value: Any) -> int | str:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise PydanticCustomError(
            "quantity", "{value} is not a quantity: give an integer or a string such as 500m, 2 or 16Gi",
            {"value": repr(value)},
        )
    try:
        kv.parse_quantity(value)
    except ValueError as exc:
        raise PydanticCustomError("quantity", "{reason}", {"reason": str(exc)}) from None
    return value


Quantity = Annotated[
    int | str,
    PlainValidator(_quantity),
    WithJsonSchema({
        "x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}],
        "pattern": kv.QUANTITY,
    }),
]
"""A resource quantity (``500m``, ``2``, ``16Gi``): an integer or a string, never a float."""


class ResourceRequirements(KubeModel):
    """Compute resources of one container (Kubernetes ResourceRequirements), checked as the API server
    does: resource names, quantities, requests not above limits, extended resources (GPUs) whole and
    with request equal to limit."""

    limits: dict[str, Quantity] = Field(default_factory=dict, max_length=16)
    requests: dict[str, Quantity] = Field(default_factory=dict, max_length=16)

    @model_validator(mode="after")
    def _api_rules(self) -> ResourceRequirements:
        problems = kv.resource_requirements(self.limits, self.requests)
        if problems:
            raise refuse([(key_path(where), msg) for where, msg in problems])
        return self


class LocalObjectReference(KubeModel):
    name: Subdomain = Field(description="Name of an object in the pool's namespace.")


class KeyRef(KubeModel):
    """A key of a ConfigMap or Secret."""

    name: Subdomain
    key: str = Field(min_length=1, max_length=kv.SUBDOMAIN_MAX, pattern=kv.CONFIG_KEY)
    optional: bool | None = None


class FieldRef(KubeModel):
    field_path: str = Field(min_length=1, max_length=256, description="e.g. metadata.name, status.podIP.")
    api_version: str | None = None


class ResourceFieldRef(KubeModel):
    resource: str = Field(min_length=1, description="e.g. limits.memory.")
    container_name: str | None = None
    divisor: Quantity | None = None


_ONE_SOURCE = "[has(self.fieldRef), has(self.resourceFieldRef), has(self.configMapKeyRef), " \
    "has(self.secretKeyRef)].filter(x, x).size() == 1"


class EnvVarSource(KubeModel):
    """Where an environment variable's value comes from: exactly one source."""

    model_config = ConfigDict(json_schema_extra=rules((_ONE_SOURCE, "valueFrom must name exactly one source")))

    field_ref: FieldRef | None = None
    resource_field_ref: ResourceFieldRef | None = None
    config_map_key_ref: KeyRef | None = None
    secret_key_ref: KeyRef | None = None

    @model_validator(mode="after")
    def _one_source(self) -> EnvVarSource:
        given = [n for n in ("fieldRef", "resourceFieldRef", "configMapKeyRef", "secretKeyRef")
                 if getattr(self, {"fieldRef": "field_ref", "resourceFieldRef": "resource_field_ref",
                                   "configMapKeyRef": "config_map_key_ref",
                                   "secretKeyRef": "secret_key_ref"}[n]) is not None]
        if len(given) != 1:
            raise refuse([("", "must name exactly one of fieldRef, resourceFieldRef, configMapKeyRef, "
                               f"secretKeyRef (got {', '.join(given) or 'none'})")])
        return self


class EnvVar(KubeModel):
    """An environment variable (Kubernetes EnvVar): a literal value or a valueFrom source, not both."""

    model_config = ConfigDict(json_schema_extra=rules((
        "!has(self.valueFrom) || !has(self.value) || self.value == ''",
        "value and valueFrom are exclusive",
    )))

    name: str = Field(min_length=1, max_length=kv.SUBDOMAIN_MAX, pattern=kv.ENV_VAR_NAME)
    value: str | None = Field(None, max_length=32768)
    value_from: EnvVarSource | None = None

    @model_validator(mode="after")
    def _exclusive(self) -> EnvVar:
        if self.value and self.value_from is not None:
            raise refuse([("", "value and valueFrom are exclusive")])
        return self


class Toleration(KubeModel):
    """A pod toleration (Kubernetes Toleration), with the API server's rules."""

    model_config = ConfigDict(json_schema_extra=rules(
        ("(has(self.key) && self.key != '') || (has(self.operator) && self.operator == 'Exists')",
         "operator must be Exists when key is empty"),
        ("!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
         "tolerationSeconds needs effect NoExecute"),
        ("!has(self.operator) || self.operator != 'Exists' || !has(self.value) || self.value == ''",
         "value must be empty when operator is Exists"),
    ))

    key: str | None = Field(None, max_length=kv.SUBDOMAIN_MAX + 1 + kv.LABEL_MAX)
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = Field(None, max_length=kv.LABEL_MAX)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None

    @model_validator(mode="after")
    def _api_rules(self) -> Toleration:
        problems: list[tuple[str, str]] = []
        if self.key:
            if problem := kv.qualified_name(self.key):
                problems.append((".key", problem))
        elif self.operator != "Exists":
            problems.append((".operator", "must be Exists when key is empty (match all keys)"))
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            problems.append((".effect", "must be NoExecute when tolerationSeconds is set"))
        if self.operator == "Exists" and self.value:
            problems.append((".value", "must be empty when operator is Exists"))
        elif self.value and (problem := kv.label_value(self.value)):
            problems.append((".value", problem))
        if problems:
            raise refuse(problems)
        return self


# ---- affinity and spreading ---------------------------------------------------


def _requirement_problems(operator: str, values: list[str]) -> str | None:
    if operator in ("In", "NotIn") and not values:
        return f"values must be non-empty when operator is {operator}"
    if operator in ("Exists", "DoesNotExist") and values:
        return f"values must be empty when operator is {operator}"
    if operator in ("Gt", "Lt") and (len(values) != 1 or not values[0].lstrip("-").isdigit()):
        return f"values must be a single integer when operator is {operator}"
    return None


class LabelSelectorRequirement(KubeModel):
    key: QualifiedName
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] = Field(default_factory=list, max_length=MAX_LIST)

    @model_validator(mode="after")
    def _values(self) -> LabelSelectorRequirement:
        if problem := _requirement_problems(self.operator, self.values):
            raise refuse([(".values", problem)])
        return self


class LabelSelector(KubeModel):
    match_labels: dict[str, str] = Field(default_factory=dict, max_length=MAX_LIST)
    match_expressions: list[LabelSelectorRequirement] = Field(default_factory=list, max_length=MAX_LIST)

    @field_validator("match_labels")
    @classmethod
    def _labels(cls, labels: dict[str, str]) -> dict[str, str]:
        problems = label_problems(labels)
        if problems:
            raise refuse(problems)
        return labels


class NodeSelectorRequirement(KubeModel):
    key: str = Field(min_length=1, max_length=kv.SUBDOMAIN_MAX + 1 + kv.LABEL_MAX)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"]
    values: list[str] = Field(default_factory=list, max_length=MAX_LIST)

    @model_validator(mode="after")
    def _values(self) -> NodeSelectorRequirement:
        if problem := _requirement_problems(self.operator, self.values):
            raise refuse([(".values", problem)])
        return self


class NodeSelectorTerm(KubeModel):
    match_expressions: list[NodeSelectorRequirement] = Field(default_factory=list, max_length=MAX_LIST)
    match_fields: list[NodeSelectorRequirement] = Field(default_factory=list, max_length=MAX_LIST)


class NodeSelector(KubeModel):
    node_selector_terms: list[NodeSelectorTerm] = Field(min_length=1, max_length=MAX_LIST)


class PreferredSchedulingTerm(KubeModel):
    weight: int = Field(ge=1, le=100)
    preference: NodeSelectorTerm


class NodeAffinity(KubeModel):
    required_during_scheduling_ignored_during_execution: NodeSelector | None = None
    preferred_during_scheduling_ignored_during_execution: list[PreferredSchedulingTerm] = Field(
        default_factory=list, max_length=MAX_LIST
    )


class PodAffinityTerm(KubeModel):
    label_selector: LabelSelector | None = None
    namespaces: list[str] = Field(default_factory=list, max_length=MAX_LIST)
    topology_key: str = Field(min_length=1, max_length=kv.SUBDOMAIN_MAX + 1 + kv.LABEL_MAX)
    namespace_selector: LabelSelector | None = None
    match_label_keys: list[str] = Field(default_factory=list, max_length=MAX_LIST)
    mismatch_label_keys: list[str] = Field(default_factory=list, max_length=MAX_LIST)

    @field_validator("topology_key")
    @classmethod
    def _topology_key(cls, key: str) -> str:
        if problem := kv.qualified_name(key):
            raise refuse([("", problem)])
        return key


class WeightedPodAffinityTerm(KubeModel):
    weight: int = Field(ge=1, le=100)
    pod_affinity_term: PodAffinityTerm


class PodAffinity(KubeModel):
    required_during_scheduling_ignored_during_execution: list[PodAffinityTerm] = Field(
        default_factory=list, max_length=MAX_LIST
    )
    preferred_during_scheduling_ignored_during_execution: list[WeightedPodAffinityTerm] = Field(
        default_factory=list, max_length=MAX_LIST
    )


class Affinity(KubeModel):
    """Node affinity, pod affinity and anti-affinity (Kubernetes Affinity)."""

    node_affinity: NodeAffinity | None = None
    pod_affinity: PodAffinity | None = None
    pod_anti_affinity: PodAffinity | None = None


class TopologySpreadConstraint(KubeModel):
    """How pods spread over a topology (Kubernetes TopologySpreadConstraint). Without a
    labelSelector the operator selects the component's own pods (engines or router of this pool)."""

    model_config = ConfigDict(json_schema_extra=rules((
        "!has(self.minDomains) || self.whenUnsatisfiable == 'DoNotSchedule'",
        "minDomains needs whenUnsatisfiable DoNotSchedule",
    )))

    max_skew: int = Field(ge=1)
    topology_key: str = Field(min_length=1, max_length=kv.SUBDOMAIN_MAX + 1 + kv.LABEL_MAX)
    when_unsatisfiable: Literal["DoNotSchedule", "ScheduleAnyway"]
    label_selector: LabelSelector | None = None
    min_domains: int | None = Field(None, ge=1)
    node_affinity_policy: Literal["Honor", "Ignore"] | None = None
    node_taints_policy: Literal["Honor", "Ignore"] | None = None
    match_label_keys: list[str] = Field(default_factory=list, max_length=MAX_LIST)

    @model_validator(mode="after")
    def _api_rules(self) -> TopologySpreadConstraint:
        problems: list[tuple[str, str]] = []
        if problem := kv.qualified_name(self.topology_key):
            problems.append((".topologyKey", problem))
        if self.min_domains is not None and self.when_unsatisfiable != "DoNotSchedule":
            problems.append((".minDomains", "needs whenUnsatisfiable DoNotSchedule"))
        if problems:
            raise refuse(problems)
        return self


VOLUME_SOURCES = (
    "persistentVolumeClaim", "emptyDir", "ephemeral", "csi", "nfs", "hostPath", "configMap", "secret",
    "projected", "image", "iscsi", "fc", "cephfs", "rbd", "glusterfs", "azureFile", "azureDisk",
    "awsElasticBlockStore", "gcePersistentDisk", "downwardAPI", "flexVolume", "portworxVolume",
    "vsphereVolume", "quobyte", "scaleIO", "storageos", "photonPersistentDisk", "cinder", "flocker",
    "gitRepo",
)
"""Kubernetes VolumeSource members (a volume names exactly one)."""
RESTRICTED_VOLUME_SOURCES = (
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret",
)
"""Volume types the ``restricted`` Pod Security profile admits (others need a laxer namespace)."""


def volume_source_problem(source: dict[str, Any]) -> str | None:
    kinds = list(source)
    if len(kinds) != 1:
        return f"must name exactly one volume source (e.g. persistentVolumeClaim), got {kinds or 'none'}"
    if kinds[0] not in VOLUME_SOURCES:
        return f"{kinds[0]!r} is not a Kubernetes volume source"
    if not isinstance(source[kinds[0]], dict):
        return f"{kinds[0]} must be a mapping"
    return None


def label_problems(labels: dict[str, str], *, sub: str = "") -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    for key, value in labels.items():
        if problem := kv.qualified_name(key):
            problems.append((f"{sub}[{key}]", f"key {problem}"))
        elif problem := kv.label_value(value):
            problems.append((f"{sub}[{key}]", f"value {value!r}: {problem}"))
    return problems


def annotation_problems(annotations: dict[str, str]) -> list[tuple[str, str]]:
    problems = [(f"[{k}]", f"key {p}") for k in annotations if (p := kv.qualified_name(k))]
    size = kv.annotations_size(annotations)
    if size > kv.TOTAL_ANNOTATION_BYTES:
        problems.append(("", f"{size} bytes of annotations, above Kubernetes' {kv.TOTAL_ANNOTATION_BYTES}"))
    return problems
