"""The RolloutPool resource: spec and status as pydantic models, the source of the CRD schema.

Fields are camelCase on the wire (``alias_generator``), snake_case in Python.
Every cross-field rule exists twice, on purpose: as a CEL rule
(``x-kubernetes-validations``, enforced by the API server on apply) and as a
pydantic validator (enforced by the operator before anything is rendered, for
API servers without CEL and for objects that predate a rule). The tests feed
the same hostile inputs to both.

The admission settings are not redeclared here: ``spec.admission`` *is* the
router's ``PolicySettings`` (every knob, its default and description), seen
through a camelCase lens, so a new router setting reaches the CRD by
regenerating it (``python -m misat_operator.crd``), and the staleness test
fails until someone does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from misat_router.config import RouterConfig
from misat_router.policy.settings import PolicySettings

from .names import MAX_POOL_NAME
from .schema import camel_keys, camel_to_snake, camelize, snake_keys, structural

VLLM_IMAGE = "vllm/vllm-openai:v0.32.0"
"""Pinned to the vLLM release the project's end-to-end test runs (docs/real-vllm.md)."""
ROUTER_IMAGE = "ghcr.io/misa-t/misa-t:0.1.0"
"""The project's own image (router and operator share it); override per pool or in the chart."""
SHARE_TOLERANCE = 1e-6
"""Shares must sum to 100 within this (the router's own tolerance)."""
MAX_CLASSES = 16
"""Upper bound on workload classes; keeps the CEL rules' cost bounded for the API server."""

MANAGED_ENGINE_FLAGS = (
    "--model", "--served-model-name", "--host", "--port", "--tensor-parallel-size",
    "--max-model-len", "--gpu-memory-utilization", "--enable-prefix-caching",
    "--no-enable-prefix-caching", "--max-num-seqs", "--max-num-batched-tokens",
    "--enable-prompt-tokens-details",
)
"""vLLM flags the operator sets from typed fields; repeating one in extraArgs is an error."""


class _Model(BaseModel):
    model_config = ConfigDict(
        frozen=True, extra="forbid", alias_generator=to_camel, populate_by_name=True,
        use_attribute_docstrings=True,
    )


def _rules(*rules: tuple[str, str]) -> dict[str, Any]:
    return {"x-kubernetes-validations": [{"rule": r, "message": m} for r, m in rules]}


# ---- Kubernetes building blocks (only what the pod templates use) ---------

Quantity = Annotated[
    int | str,
    WithJsonSchema({"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}]}),
]


class ResourceRequirements(_Model):
    """Compute resources of one container (Kubernetes ResourceRequirements)."""

    limits: dict[str, Quantity] = Field(default_factory=dict)
    requests: dict[str, Quantity] = Field(default_factory=dict)


class EnvVar(_Model):
    """An environment variable (Kubernetes EnvVar): a literal value or a valueFrom source."""

    name: str = Field(min_length=1, max_length=253)
    value: str | None = None
    value_from: dict[str, Any] | None = Field(
        None, description="Kubernetes EnvVarSource (secretKeyRef, configMapKeyRef, fieldRef, ...)."
    )


class Toleration(_Model):
    """A pod toleration (Kubernetes Toleration)."""

    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class ModelVolume(_Model):
    """A volume holding the model weights, mounted read-only into every engine."""

    mount_path: str = Field("/models", pattern=r"^/", description="Where the volume is mounted.")
    source: dict[str, Any] = Field(
        description="A Kubernetes volume source, e.g. {persistentVolumeClaim: {claimName: models}}."
    )
    read_only: bool = True


# ---- spec -------------------------------------------------------------------


class ModelSpec(_Model):
    """The model every engine serves."""

    name: str = Field(
        min_length=1, max_length=512,
        description="Hugging Face model id or a path (e.g. under engines.modelVolume.mountPath); "
        "vLLM's --model.",
    )
    served_name: str | None = Field(
        None, min_length=1, max_length=253,
        description="Name clients send as 'model' (vLLM's --served-model-name); default: name.",
    )

    @property
    def served(self) -> str:
        return self.served_name or self.name


class EnginesSpec(_Model):
    """The vLLM engines: one Deployment of OpenAI-compatible servers behind a headless Service."""

    model_config = ConfigDict(
        json_schema_extra=_rules(
            (
                "self.gpusPerReplica == 0 || self.tensorParallelSize <= self.gpusPerReplica",
                "tensorParallelSize must not exceed gpusPerReplica",
            ),
        )
    )

    replicas: int = Field(
        1, ge=0, le=1024, description="Engine replicas (data-parallel); the scale subresource."
    )
    image: str = Field(VLLM_IMAGE, min_length=1, description="vLLM OpenAI server image.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    gpus_per_replica: int = Field(
        1, ge=0, le=64, description="nvidia.com/gpu per engine pod; 0 for CPU builds of vLLM."
    )
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="vLLM --tensor-parallel-size.")
    max_model_len: int | None = Field(None, ge=1, description="vLLM --max-model-len; default: the model's.")
    gpu_memory_utilization: float = Field(
        0.9, gt=0.0, le=1.0, description="vLLM --gpu-memory-utilization (vLLM's default 0.9)."
    )
    enable_prefix_caching: bool = Field(
        True, description="vLLM --enable-prefix-caching; MISA-T's admission exists to protect it."
    )
    max_num_seqs: int | None = Field(None, ge=1, description="vLLM --max-num-seqs; default: vLLM's.")
    max_num_batched_tokens: int | None = Field(
        None, ge=1, description="vLLM --max-num-batched-tokens; default: vLLM's."
    )
    port: int = Field(8000, ge=1, le=65535, description="Engine HTTP port.")
    extra_args: list[Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=list, max_length=128,
        description="More vLLM arguments, appended verbatim; must not repeat a flag set from a field.",
    )
    env: list[EnvVar] = Field(default_factory=list, max_length=128)
    resources: ResourceRequirements | None = Field(
        None, description="Container resources; nvidia.com/gpu is set from gpusPerReplica."
    )
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64)
    model_volume: ModelVolume | None = None

    @model_validator(mode="after")
    def _tensor_parallel(self) -> EnginesSpec:
        if self.gpus_per_replica and self.tensor_parallel_size > self.gpus_per_replica:
            raise ValueError(
                f"tensorParallelSize {self.tensor_parallel_size} exceeds "
                f"gpusPerReplica {self.gpus_per_replica}"
            )
        return self

    @field_validator("extra_args")
    @classmethod
    def _no_managed_flags(cls, args: list[str]) -> list[str]:
        for i, arg in enumerate(args):
            flag = arg.split("=", 1)[0]
            if flag in MANAGED_ENGINE_FLAGS:
                raise ValueError(f"extraArgs[{i}] {flag} is set from a typed field; use that field")
        return args


CLASS_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9_]*[a-z0-9])?$"
"""The router's ClassSpec.name pattern (a test keeps the two equal)."""


class WorkloadClass(_Model):
    """One workload class of the trainer: its target share and KV budget bounds."""

    model_config = ConfigDict(
        json_schema_extra=_rules(
            (
                "!has(self.minKvShare) || !has(self.maxKvShare) || self.minKvShare <= self.maxKvShare",
                "minKvShare must not be above maxKvShare",
            ),
        )
    )

    name: str = Field(
        pattern=CLASS_NAME_PATTERN,
        max_length=63, description="Class label clients send (X-Rollout-Class), e.g. agentic, rlvr, rlhf.",
    )
    share: float = Field(ge=0.0, le=100.0, description="Target share of completed units, percent.")
    multi_turn: bool = Field(
        False, description="Sessions span several requests (agentic); otherwise a request is a session."
    )
    min_kv_share: float | None = Field(
        None, ge=0.0, le=1.0, description="Least share of each engine's KV budget this class may always use."
    )
    max_kv_share: float | None = Field(
        None, ge=0.0, le=1.0, description="Largest share of each engine's KV budget this class may use."
    )
    bootstrap_footprint_tokens: int | None = Field(
        None, ge=1,
        description="KV tokens assumed per session until enough sessions completed "
        "(overrides admission.footprint.bootstrapTokens).",
    )

    @model_validator(mode="after")
    def _bounds(self) -> WorkloadClass:
        lo, hi = self.min_kv_share, self.max_kv_share
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"minKvShare {lo} is above maxKvShare {hi}")
        return self


class KvBudgetSpec(_Model):
    """How much of each engine's KV cache the router may hand out to sessions."""

    fraction: float = Field(
        PolicySettings.model_fields["kv_budget_fraction"].default, ge=0.0, le=1.0,
        description=PolicySettings.model_fields["kv_budget_fraction"].description,
    )


_ADMISSION_RENAMES = {"name": "policy", "admission": "sessionAdmission"}
_ADMISSION_DROPPED = ("kv_budget_fraction",)
_ADMISSION_FROM_CAMEL = {v: k for k, v in _ADMISSION_RENAMES.items()}


def _admission_in(raw: Any) -> Any:
    """camelCase CRD shape -> PolicySettings input (snake_case, router's names)."""
    if isinstance(raw, PolicySettings):
        return raw
    if not isinstance(raw, dict):
        raise ValueError("admission must be a mapping")
    if "kvBudgetFraction" in raw:
        raise ValueError("admission.kvBudgetFraction is set as kvBudget.fraction")
    return {
        (_ADMISSION_FROM_CAMEL.get(key) or camel_to_snake(key)): snake_keys(value)
        for key, value in raw.items()
    }


def admission_schema() -> dict[str, Any]:
    """``spec.admission``: PolicySettings' own schema, camelCase, policy name as 'policy'."""
    schema = camelize(
        structural(PolicySettings.model_json_schema()),
        renames=_ADMISSION_RENAMES, dropped=_ADMISSION_DROPPED,
    )
    schema["description"] = (
        "Routing policy and every one of its settings (the router's PolicySettings, camelCase). "
        "Defaults are the router's; 'project default' in a description marks a value chosen by "
        "measurement rather than given by the MISA-T paper."
    )
    schema["default"] = {}
    return schema


Admission = Annotated[
    PolicySettings,
    BeforeValidator(_admission_in),
    PlainSerializer(lambda s: camel_keys(_admission_dump(s)), return_type=dict),
    WithJsonSchema(admission_schema()),
]


def _admission_dump(settings: PolicySettings) -> dict[str, Any]:
    dumped = settings.model_dump(mode="json", exclude={"kv_budget_fraction"})
    return {_ADMISSION_RENAMES.get(k, k): v for k, v in dumped.items()}


ROUTER_DEFAULT_LIMITS: dict[str, str] = {"cpu": "2", "memory": "2Gi"}
"""Router container limits where the pool sets none (project default: the router is one asyncio
process; 2 Gi holds the prefix index of a large pool). Explicit limits replace these per key."""


class RouterSpec(_Model):
    """The MISA-T router: one pod holding the admission state, behind a Service."""

    replicas: int = Field(
        1, ge=0, le=1,
        description="0 or 1. Admission state (sessions, caps, held work) lives in the router "
        "process, so two routers would each admit against the same engines.",
    )
    image: str = Field(ROUTER_IMAGE, min_length=1)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    port: int = Field(8080, ge=1, le=65535, description="Router HTTP port (OpenAI API, /status, /admin).")
    hold_deadline_seconds: float = Field(
        RouterConfig.model_fields["hold_deadline_s"].default, gt=0.0,
        description=RouterConfig.model_fields["hold_deadline_s"].description,
    )
    resources: ResourceRequirements | None = None
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64)
    log_json: bool = Field(True, description="Router logs one JSON object per line.")


class RolloutPoolSpec(_Model):
    """A shared pool of vLLM engines serving mixed RL rollouts through one MISA-T router."""

    model_config = ConfigDict(
        json_schema_extra=_rules(
            (
                "!has(self.defaultClass) || self.workloads.exists(w, w.name == self.defaultClass)",
                "defaultClass must name one of workloads",
            ),
        )
    )

    model: ModelSpec
    engines: EnginesSpec = EnginesSpec.model_validate({})
    workloads: list[WorkloadClass] = Field(
        min_length=1, max_length=MAX_CLASSES,
        description="Workload classes and the target mixture (shares in percent, summing to 100).",
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["name"],
            **_rules(
                ("self.all(a, self.exists_one(b, b.name == a.name))", "workload class names must be unique"),
                (
                    "self.map(w, w.share).sum() >= 99.999999 && self.map(w, w.share).sum() <= 100.000001",
                    "workload shares must sum to 100",
                ),
                (
                    "self.filter(w, has(w.minKvShare)).map(w, w.minKvShare).sum() <= 1.0",
                    "minKvShare values must not sum above 1",
                ),
            ),
        },
    )
    default_class: str | None = Field(
        None, description="Class of requests without a class label; unset: the label is required."
    )
    kv_budget: KvBudgetSpec = KvBudgetSpec.model_validate({})
    admission: Admission = PolicySettings()
    router: RouterSpec = RouterSpec.model_validate({})

    @model_validator(mode="after")
    def _workloads(self) -> RolloutPoolSpec:
        names = [w.name for w in self.workloads]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"workloads: class names must be unique, repeated: {', '.join(dupes)}")
        total = sum(w.share for w in self.workloads)
        if abs(total - 100.0) > SHARE_TOLERANCE:
            raise ValueError(f"workloads: shares must sum to 100, they sum to {total:g}")
        mins = sum(w.min_kv_share or 0.0 for w in self.workloads)
        if mins > 1.0 + 1e-9:
            raise ValueError(f"workloads: minKvShare values sum to {mins:g}, above 1")
        if self.default_class is not None and self.default_class not in names:
            raise ValueError(f"defaultClass {self.default_class!r} is not one of {names}")
        return self


# ---- status -------------------------------------------------------------------


class Condition(_Model):
    """A standard condition; lastTransitionTime changes only when status changes."""

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str = ""
    last_transition_time: str
    observed_generation: int | None = None


class EnginesStatus(_Model):
    desired: int | None = Field(None, description="spec.engines.replicas as last reconciled.")
    ready: int | None = Field(None, description="Engine pods ready (the Deployment's readyReplicas).")
    summary: str | None = Field(None, description="'ready/desired', for kubectl get.")
    selector: str | None = Field(None, description="Label selector of engine pods (scale subresource).")


class RouterStatusView(_Model):
    ready: bool | None = Field(None, description="Router pod ready and /status reports ready.")
    ready_replicas: int | None = None
    healthy_engines: int | None = Field(None, description="Engines the router sees as healthy.")
    url: str | None = Field(None, description="In-cluster base URL of the router (OpenAI API).")


class ConfigStatus(_Model):
    desired_generation: int | None = Field(None, description="Generation rendered into the ConfigMap.")
    applied_generation: int | None = Field(None, description="Generation the router reports applied.")
    hash: str | None = Field(None, description="Router's config hash of the applied config.")
    last_error: str | None = Field(None, description="Last push or reload error, if any.")


class KvStatus(_Model):
    capacity_tokens: float | None = Field(None, description="KV capacity of all engines, tokens.")
    used_tokens: float | None = Field(None, description="KV in use on all engines, tokens.")
    used_percent: float | None = Field(None, description="used / capacity, percent.")


class ClassStatus(_Model):
    name: str
    target_percent: float | None = None
    consumed_percent: float | None = Field(None, description="Share of completed units so far, percent.")
    completed_units: int | None = None
    active_sessions: int | None = None
    held_requests: int | None = None
    kv_budget_tokens: float | None = Field(None, description="Class KV budget over all engines (MISA*).")
    kv_used_tokens: float | None = None


class MixtureStatus(_Model):
    target: dict[str, float] | None = Field(None, description="Target mixture, percent per class.")
    consumed: dict[str, float] | None = Field(None, description="Consumed mixture, percent per class.")
    tv_points: float | None = Field(None, description="Total-variation distance, percentage points.")


class RolloutPoolStatus(_Model):
    """Written by the operator only: reconcile outcome and the router's live view."""

    observed_generation: int | None = None
    conditions: list[Condition] | None = Field(
        None,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    engines: EnginesStatus | None = None
    router: RouterStatusView | None = None
    config: ConfigStatus | None = None
    kv: KvStatus | None = None
    classes: list[ClassStatus] | None = None
    mixture: MixtureStatus | None = None
    sample_rate_per_min: float | None = Field(None, description="Completed rollout units per minute.")
    prefix_hit_rate: float | None = Field(None, description="Prompt tokens served from prefix cache (0..1).")
    last_update_time: str | None = Field(None, description="When the status timer last read the router.")


def parse_spec(spec: Any) -> RolloutPoolSpec:
    """Validate a RolloutPool spec (camelCase mapping); raises pydantic.ValidationError."""
    return RolloutPoolSpec.model_validate(spec)


def describe_spec_error(exc: ValidationError) -> str:
    """One line per problem, each naming its path under spec (``spec.workloads[1].share: ...``)."""
    lines = []
    for err in exc.errors():
        path = "spec"
        for part in err["loc"]:
            if isinstance(part, int):
                path += f"[{part}]"
            elif not str(part).startswith("function-"):
                path += f".{part}"
        lines.append(f"{path}: {err['msg'].removeprefix('Value error, ')}")
    return "; ".join(lines)


def pool_name_error(name: str) -> str | None:
    """A reason the pool name cannot be used, or None (children's names must fit 63 chars)."""
    if len(name) > MAX_POOL_NAME:
        return f"metadata.name must be at most {MAX_POOL_NAME} characters, got {len(name)}"
    return None
