"""The RolloutPool resource: spec and status as pydantic models, the source of the CRD schema.

Fields are camelCase on the wire (``alias_generator``), snake_case in Python.
Every cross-field rule exists twice, on purpose: as a CEL rule
(``x-kubernetes-validations``, enforced by the API server on apply) and as a
pydantic validator (enforced by the operator before anything is rendered, for
API servers without CEL and for objects that predate a rule). The tests feed
the same hostile inputs to both. What the API server would refuse on a child
(a name, a resource, an env var, a size) is refused here too, before the
first write, with the manifest's path (``kube_models.py``,
``kube_validation.py``, ``engine_args.py``).

Tunables have defaults here, not in the CRD: the stored object keeps only what
its author wrote, so a later release's defaults reach existing pools, and
``effective_values`` says what a pool runs with (``status.effective``).

The admission settings are not redeclared here: ``spec.admission`` *is* the
router's ``PolicySettings`` (every knob, its default and description), seen
through a camelCase lens, so a new router setting reaches the CRD by
regenerating it (``python -m misat_operator.crd``), and the staleness test
fails until someone does.
"""

from __future__ import annotations

import math
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

from misat_router.config import RouterConfig, ShardsConfig
from misat_router.policy.settings import PolicySettings

from . import engine_args
from . import kube_validation as kv
from .kube_models import (
    Affinity,
    Dns1035Label,
    Dns1123Label,
    EnvVar,
    LocalObjectReference,
    Quantity,
    ResourceRequirements,
    Subdomain,
    Toleration,
    TopologySpreadConstraint,
    annotation_problems,
    key_path,
    label_problems,
    refuse,
    rules,
    volume_source_problem,
)
from .names import MAX_POOL_NAME, RESERVED_LABEL_KEYS, PoolNames
from .schema import camel_keys, camel_to_snake, camelize, snake_keys, snake_to_camel, structural

VLLM_IMAGE = "vllm/vllm-openai:v0.32.0"
"""Pinned to the vLLM release the project's end-to-end test runs (docs/real-vllm.md)."""
ROUTER_IMAGE = "ghcr.io/misa-t/misa-t:0.1.0"
"""The project's own image (router and operator share it, see Dockerfile); override per pool."""
SHARE_TOLERANCE = 1e-6
"""Shares must sum to 100 within this (the router's own tolerance)."""
MAX_CLASSES = 16
"""Upper bound on workload classes; keeps the CEL rules' cost bounded for the API server."""
MAX_EXTRA_ARGS_CHARS = 16 * 1024
"""All of extraArgs together; they travel in the engine Deployment and its last-applied record."""
MAX_SPEC_BYTES = 96 * 1024
"""The whole spec as JSON. kopf keeps the last handled spec in an annotation of the pool, and each
child keeps its last-applied record in one; Kubernetes caps one object's annotations at 256 KiB."""
ENGINE_UID = 1000
"""Engines run as this non-root uid/gid (the vLLM image has no user of its own; the restricted Pod
Security profile refuses root)."""
ROUTER_UID = 65532
"""The router runs as this uid/gid (distroless 'nonroot', the image's USER)."""
DEFAULT_MODEL_CACHE_SIZE = "200Gi"
"""emptyDir limit of the model cache (project default: a 70B model in bf16 is about 140 GB, plus
vLLM's compile cache)."""
DEFAULT_SHM_SIZE = "16Gi"
"""Memory-backed /dev/shm of an engine (project default: room for NCCL and vLLM's shared-memory
broadcast between tensor-parallel workers; it counts against the pod's memory as it is used)."""
MODEL_CACHE_PATH = "/cache"

OPERATOR_ENV: dict[str, str] = {
    "HOME": "spec.engines.modelCache", "HF_HOME": "spec.engines.modelCache",
    "VLLM_CACHE_ROOT": "spec.engines.modelCache", "XDG_CACHE_HOME": "spec.engines.modelCache",
}
"""Engine environment the operator sets itself, and the field that decides it."""
REFUSED_ENV: dict[str, str] = {
    "VLLM_API_KEY": "vLLM would answer 401 to every proxied request (the router sends no engine key)",
}


class _Model(BaseModel):
    model_config = ConfigDict(
        frozen=True, extra="forbid", alias_generator=to_camel, populate_by_name=True,
        use_attribute_docstrings=True,
    )


_rules = rules


class ModelVolume(_Model):
    """A volume holding the model weights, mounted read-only into every engine."""

    mount_path: str = Field("/models", pattern=r"^/[^:]*$", max_length=1024, description="Where the volume is mounted.")
    source: dict[str, Any] = Field(
        description="A Kubernetes volume source, exactly one, e.g. {persistentVolumeClaim: {claimName: models}}. "
        "The restricted Pod Security profile admits persistentVolumeClaim, csi, ephemeral, emptyDir, "
        "configMap, secret, projected and downwardAPI only."
    )
    read_only: bool = True

    @field_validator("source")
    @classmethod
    def _one_source(cls, source: dict[str, Any]) -> dict[str, Any]:
        if problem := volume_source_problem(source):
            raise refuse([("", problem)])
        return source


class ModelCache(_Model):
    """Where vLLM keeps downloaded weights and compiled graphs (HF_HOME, VLLM_CACHE_ROOT): an emptyDir
    of sizeLimit (survives container restarts, not pod replacement) or an existing PersistentVolumeClaim
    (survives both; ReadWriteMany when engines share it)."""

    model_config = ConfigDict(json_schema_extra=_rules(
        ("!has(self.claimName) || !has(self.sizeLimit)", "claimName and sizeLimit are exclusive"),
    ))

    claim_name: Subdomain | None = Field(None, description="An existing PVC; unset: an emptyDir.")
    size_limit: Quantity | None = Field(
        None, description=f"emptyDir sizeLimit (default {DEFAULT_MODEL_CACHE_SIZE}); the kubelet evicts a pod "
        "whose cache grows past it.",
    )
    mount_path: str = Field(MODEL_CACHE_PATH, pattern=r"^/[^:]*$", max_length=1024)

    @model_validator(mode="after")
    def _exclusive(self) -> ModelCache:
        if self.claim_name is not None and self.size_limit is not None:
            raise refuse([(".sizeLimit", "claimName and sizeLimit are exclusive (a PVC has its own size)")])
        return self

    @property
    def effective_size_limit(self) -> int | str | None:
        return None if self.claim_name else (self.size_limit or DEFAULT_MODEL_CACHE_SIZE)


class PodSecurity(_Model):
    """Identity the containers run as. Always non-root, no privilege escalation, every capability
    dropped, seccomp RuntimeDefault (the restricted Pod Security profile)."""

    run_as_user: int | None = Field(None, ge=1, le=2**31 - 1, description="uid; default per component.")
    run_as_group: int | None = Field(None, ge=1, le=2**31 - 1, description="gid; default: runAsUser.")
    fs_group: int | None = Field(
        None, ge=1, le=2**31 - 1, description="Group owning mounted volumes; default: runAsGroup."
    )


class Probes(_Model):
    """HTTP probes on /health. vLLM answers /health from the API server process, which can stall for
    seconds under load, so the kubelet's 1 s default timeout restarts busy engines."""

    timeout_seconds: int | None = Field(
        None, ge=1, le=300, description="Each probe's timeout (default 10 for engines, 5 for the router)."
    )
    startup_budget_seconds: int | None = Field(
        None, ge=10, le=24 * 3600,
        description="How long an engine may take to download, load and compile before the kubelet gives "
        "up (startupProbe; default 1800). Ignored for the router.",
    )


class Shutdown(_Model):
    """How a pod stops. preStop sleeps so the router and Services stop sending before SIGTERM; then
    in-flight work drains. terminationGracePeriodSeconds is derived: preStop + drain + a margin."""

    pre_stop_sleep_seconds: int | None = Field(
        None, ge=0, le=600,
        description="preStop sleep (default 10: the router re-resolves the engine Service every 5 s).",
    )
    drain_seconds: int | None = Field(
        None, ge=0, le=24 * 3600,
        description="Engines: vLLM --shutdown-timeout, how long running generations may finish "
        "(default 600). Router: ignored (the router drains for its config's drain_timeout_s, 30 s by default).",
    )


class DisruptionBudget(_Model):
    """The engines' PodDisruptionBudget (voluntary evictions: node drains, autoscaler)."""

    max_unavailable: int | None = Field(
        None, ge=0, description="Engines that may be evicted at once (default 1; 0 blocks drains)."
    )


class PodSettings(_Model):
    """Pod fields a real cluster asks for, shared by engines and router."""

    image_pull_secrets: list[LocalObjectReference] = Field(default_factory=list, max_length=16)
    service_account_name: Subdomain | None = Field(None, description="Default: the namespace's 'default'.")
    automount_service_account_token: bool = Field(
        False, description="Neither vLLM nor the router calls the Kubernetes API."
    )
    runtime_class_name: Subdomain | None = Field(
        None, description="e.g. 'nvidia' where the NVIDIA runtime is not the default."
    )
    priority_class_name: Subdomain | None = None
    node_selector: dict[str, str] = Field(default_factory=dict, max_length=64)
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64)
    affinity: Affinity | None = None
    topology_spread_constraints: list[TopologySpreadConstraint] = Field(default_factory=list, max_length=16)
    pod_labels: dict[str, str] = Field(
        default_factory=dict, max_length=64,
        description="Extra pod labels; the operator's own (app.kubernetes.io/*, misat.dev/*) cannot be set.",
    )
    pod_annotations: dict[str, str] = Field(default_factory=dict, max_length=64)
    security_context: PodSecurity = PodSecurity.model_validate({})
    probes: Probes = Probes.model_validate({})
    shutdown: Shutdown = Shutdown.model_validate({})

    @model_validator(mode="after")
    def _pod_fields(self) -> PodSettings:
        problems = label_problems(self.node_selector, sub=".nodeSelector")
        problems += label_problems(self.pod_labels, sub=".podLabels")
        problems += [(f".podLabels[{k}]", "is set by the operator (selectors depend on it)")
                     for k in self.pod_labels if k in RESERVED_LABEL_KEYS or k.startswith("misat.dev/")]
        problems += [(f".podAnnotations{sub}", msg) for sub, msg in annotation_problems(self.pod_annotations)]
        if problems:
            raise refuse(problems)
        return self


# ---- spec -------------------------------------------------------------------


class ModelSpec(_Model):
    """The model every engine serves."""

    name: str = Field(
        min_length=1, max_length=512, pattern=r"^\S+$",
        description="Hugging Face model id or a path (e.g. under engines.modelVolume.mountPath); "
        "the model of `vllm serve <model>`.",
    )
    served_name: str | None = Field(
        None, min_length=1, max_length=253, pattern=r"^\S+$",
        description="Name clients send as 'model' (vLLM's --served-model-name); default: name.",
    )

    @property
    def served(self) -> str:
        return self.served_name or self.name


class ExternalService(_Model):
    """An existing headless Service in front of vLLM servers: one address per engine."""

    name: Dns1035Label = Field(description="Service name (must be headless: clusterIP None).")
    namespace: Dns1123Label | None = Field(None, description="Default: the pool's namespace.")
    port: int = Field(8000, ge=1, le=65535, description="The engines' HTTP port.")
    scheme: Literal["http", "https"] = "http"


class ExternalEngines(_Model):
    """vLLM engines the pool does not create: a headless Service or a list of base URLs."""

    model_config = ConfigDict(json_schema_extra=_rules(
        ("has(self.service) != has(self.urls)", "give exactly one of service or urls"),
    ))

    service: ExternalService | None = None
    urls: list[Annotated[str, Field(max_length=2048, pattern=r"^https?://[^\s/]+(/\S*)?$")]] | None = Field(
        None, min_length=1, max_length=256, description="Engine base URLs, e.g. http://10.0.0.5:8000.",
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> ExternalEngines:
        if (self.service is None) == (self.urls is None):
            raise refuse([("", "give exactly one of service or urls")])
        if self.urls is not None and len(set(self.urls)) != len(self.urls):
            raise refuse([(".urls", "must not repeat an engine")])
        return self


ENGINE_EXTERNAL_ONLY = ("external", "replicas")
"""Fields of engines that may accompany ``external`` (replicas: the scale subresource's path)."""


def _engines_rules(schema: dict[str, Any], cls: type[Any]) -> None:
    """CEL rules of spec.engines, written from the model's own fields and defaults (no drift): the
    schema carries no defaults, so every rule reads an absent field as the operator would."""
    fields = cls.model_fields

    def value(name: str) -> str:
        camel = snake_to_camel(name)
        return f"(has(self.{camel}) ? self.{camel} : {fields[name].default})"

    gpus, tp = value("gpus_per_replica"), value("tensor_parallel_size")
    others = [snake_to_camel(n) for n in fields if n not in ENGINE_EXTERNAL_ONLY]
    schema.setdefault("x-kubernetes-validations", []).extend([
        {"rule": f"{gpus} == 0 || {tp} <= {gpus}", "message": "tensorParallelSize must not exceed gpusPerReplica"},
        {"rule": f"!has(self.external) || !({' || '.join(f'has(self.{n})' for n in others)})",
         "message": "external engines are not created by the operator: set only external and replicas"},
    ])


class EnginesSpec(PodSettings):
    """The vLLM engines: one Deployment of `vllm serve` pods behind a headless Service, or, with
    `external`, an existing fleet the pool only routes to."""

    model_config = ConfigDict(json_schema_extra=_engines_rules)

    replicas: int = Field(
        1, ge=0, le=1024, description="Engine replicas (data-parallel); the scale subresource."
    )
    external: ExternalEngines | None = Field(
        None, description="Route to existing engines instead of creating them (no engine Deployment, "
        "Service or PodDisruptionBudget is rendered); exclusive with every other engines field but replicas.",
    )
    image: str = Field(
        VLLM_IMAGE, min_length=1, max_length=1024, pattern=r"^\S+$", description="vLLM OpenAI server image."
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    gpus_per_replica: int = Field(
        1, ge=0, le=64, description="nvidia.com/gpu per engine pod; 0 for CPU builds of vLLM."
    )
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="vLLM --tensor-parallel-size.")
    max_model_len: int | None = Field(None, ge=1, description="vLLM --max-model-len; default: the model's.")
    gpu_memory_utilization: float | None = Field(
        None, gt=0.0, le=1.0, description="vLLM --gpu-memory-utilization; default: vLLM's (0.9)."
    )
    enable_prefix_caching: bool = Field(
        True, description="vLLM --enable-prefix-caching; MISA-T's admission exists to protect it."
    )
    max_num_seqs: int | None = Field(None, ge=1, description="vLLM --max-num-seqs; default: vLLM's.")
    max_num_batched_tokens: int | None = Field(
        None, ge=1, description="vLLM --max-num-batched-tokens; default: vLLM's."
    )
    port: int = Field(8000, ge=1024, le=65535, description="Engine HTTP port (vLLM refuses ports below 1024 as "
                      "non-root).")
    listen_address: Literal["::", "0.0.0.0"] = Field(
        "::", description="vLLM --host. '::' listens on IPv6 and IPv4 (dual-stack, IPv6-only clusters); "
        "'0.0.0.0' where the kernel has IPv6 disabled.",
    )
    extra_args: list[Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=list, max_length=128,
        description="More `vllm serve` arguments, appended verbatim. Refused: a flag the operator sets from a "
        "typed field (in any spelling vLLM accepts: --max_num_seqs, -tp, --served-model, ...), flags that "
        "break the pool (--api-key, --config, --no-enable-prompt-tokens-details, --disable-log-stats, ...), "
        "and arguments vLLM would refuse at start-up.",
    )
    env: list[EnvVar] = Field(default_factory=list, max_length=128)
    resources: ResourceRequirements | None = Field(
        None, description="Container resources; nvidia.com/gpu is set from gpusPerReplica."
    )
    model_volume: ModelVolume | None = None
    model_cache: ModelCache = ModelCache.model_validate({})
    shm_size: Quantity | None = Field(
        None, description=f"sizeLimit of the memory-backed /dev/shm (default {DEFAULT_SHM_SIZE}).",
    )
    disruption_budget: DisruptionBudget = DisruptionBudget.model_validate({})

    @model_validator(mode="after")
    def _engines(self) -> EnginesSpec:
        problems: list[tuple[str, str]] = []
        if self.external is not None:
            extra = sorted(snake_to_camel(f) for f in self.model_fields_set if f not in ENGINE_EXTERNAL_ONLY)
            if extra:
                problems.append(("", f"external engines are not created by the operator: remove "
                                     f"{', '.join(extra)}"))
        if self.gpus_per_replica and self.tensor_parallel_size > self.gpus_per_replica:
            problems.append((".tensorParallelSize", f"{self.tensor_parallel_size} exceeds gpusPerReplica "
                                                    f"{self.gpus_per_replica}"))
        problems += [(f".extraArgs[{p.index}]", p.message) for p in engine_args.check(list(self.extra_args))]
        total = sum(len(a) for a in self.extra_args)
        if total > MAX_EXTRA_ARGS_CHARS:
            problems.append((".extraArgs", f"{total} characters in all, above {MAX_EXTRA_ARGS_CHARS}"))
        for i, var in enumerate(self.env):
            if var.name in OPERATOR_ENV:
                problems.append((f".env[{i}]", f"{var.name} is set by the operator from {OPERATOR_ENV[var.name]}"))
            elif var.name in REFUSED_ENV:
                problems.append((f".env[{i}]", f"{var.name} is refused: {REFUSED_ENV[var.name]}"))
        if self.resources is not None:
            for kind in ("limits", "requests"):
                if GPU_RESOURCE in getattr(self.resources, kind):
                    problems.append((f".resources.{kind}[{GPU_RESOURCE}]", "is set from gpusPerReplica"))
        mounts = self._mount_paths()
        for path in {p for p in mounts if mounts.count(p) > 1}:
            problems.append(("", f"two volumes would mount at {path} (modelVolume.mountPath, modelCache.mountPath, "
                                 "and /dev/shm must differ)"))
        if problems:
            raise refuse(problems)
        return self

    def _mount_paths(self) -> list[str]:
        paths = [self.model_cache.mount_path.rstrip("/") or "/", "/dev/shm"]
        if self.model_volume is not None:
            paths.append(self.model_volume.mount_path.rstrip("/") or "/")
        return paths

    @property
    def managed_replicas(self) -> int:
        """Engine pods the operator runs (0 for external engines)."""
        return 0 if self.external is not None else self.replicas


GPU_RESOURCE = "nvidia.com/gpu"


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


HAPROXY_IMAGE = "haproxy:2.6"
"""The shard proxy's image: the official HAProxy image of the 2.6 long-term branch, the version
the proxy configuration (operator/haproxy.py) is written and tested against."""
MAX_SHARDS = 64
"""Most router shards one pool may have (a StatefulSet of this many pods; far beyond one
router's measured throughput times any engine pool's need, docs/scale.md)."""


class RouterSpec(PodSettings):
    """The MISA-T router: one pod holding the admission state, behind a Service; or ``shards``
    routers, each owning a disjoint subset of the engines, behind a session-hashing HAProxy."""

    replicas: int = Field(
        1, ge=0, le=1,
        description="0 or 1. Admission state (sessions, caps, held work) lives in the router "
        "process, so two routers would each admit against the same engines; scale out with shards.",
    )
    shards: int = Field(
        1, ge=1, le=MAX_SHARDS,
        description="Router shards. 1: one router Deployment. Above 1: a StatefulSet of this many "
        "routers, each owning a disjoint, stable subset of the engines (re-homed when a shard is down), "
        "behind an HAProxy Deployment hashing X-Session-Id (docs/router.md, Router shards). Needs "
        "replicas 1 and at most as many shards as engines.",
    )
    proxy_image: str = Field(
        HAPROXY_IMAGE, min_length=1, max_length=1024, pattern=r"^\S+$",
        description="Image of the shard proxy (shards > 1); its config is written for HAProxy 2.6.",
    )
    image: str = Field(ROUTER_IMAGE, min_length=1, max_length=1024, pattern=r"^\S+$")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    port: int = Field(8080, ge=1024, le=65535, description="Router HTTP port (OpenAI API, /status, /admin); "
                      "1024 or above (the router runs without capabilities).")
    hold_deadline_seconds: float | None = Field(
        None, gt=0.0,
        description=f"{RouterConfig.model_fields['hold_deadline_s'].description} "
        f"Default: the router's ({RouterConfig.model_fields['hold_deadline_s'].default:g}).",
    )
    handback_idle_seconds: float | None = Field(
        None, ge=0.0,
        description="Router shards only (shards above 1). "
        f"{ShardsConfig.model_fields['handback_idle_s'].description} "
        f"Default: the router's ({ShardsConfig.model_fields['handback_idle_s'].default:g}).",
    )
    resources: ResourceRequirements | None = Field(
        None, description="Limits default to ROUTER_DEFAULT_LIMITS per key (2 CPUs, 2Gi)."
    )
    log_json: bool = Field(True, description="Router logs one JSON object per line.")

    @model_validator(mode="after")
    def _router(self) -> RouterSpec:
        problems: list[tuple[str, str]] = []
        if self.resources is not None:
            limits = ROUTER_DEFAULT_LIMITS | dict(self.resources.limits)
            for where, msg in kv.resource_requirements(limits, self.resources.requests):
                if where.startswith("requests.") and where.split(".", 1)[1] not in self.resources.limits:
                    msg += " (the router's default limit; set resources.limits to raise it)"
                problems.append((f".resources{key_path(where)}", msg))
        if self.probes.startup_budget_seconds is not None:
            problems.append((".probes.startupBudgetSeconds", "applies to engines only"))
        if self.shutdown.drain_seconds is not None:
            problems.append((".shutdown.drainSeconds", "applies to engines only (the router drains for its "
                                                       "config's drain_timeout_s)"))
        if self.handback_idle_seconds is not None and self.shards <= 1:
            problems.append((".handbackIdleSeconds", "applies to router shards only (shards above 1)"))
        if self.shards > 1 and self.replicas != 1:
            problems.append((".shards", f"{self.shards} shards need replicas 1 (each shard is one pod of "
                                        f"the router StatefulSet), not {self.replicas}"))
        if problems:
            raise refuse(problems)
        return self


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
    def _size(self) -> RolloutPoolSpec:
        size = len(self.model_dump_json(by_alias=True, exclude_unset=True))
        if size > MAX_SPEC_BYTES:
            raise refuse([("", f"{size} bytes as JSON, above {MAX_SPEC_BYTES}: the engine and router objects carry "
                               "it in their last-applied annotations, and Kubernetes caps annotations at 256 KiB "
                               "per object")])
        return self

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

    @model_validator(mode="after")
    def _shards(self) -> RolloutPoolSpec:
        shards = self.router.shards
        external = self.engines.external
        engines = len(external.urls) if external is not None and external.urls is not None else (
            None if external is not None else self.engines.replicas)
        if shards > 1 and engines is not None and engines and shards > engines:
            raise refuse([(".router.shards", f"{shards} shards for {engines} engines: a shard owns engines, and "
                                             "one without any could only hold its sessions' requests")])
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


class DrainStatus(_Model):
    """A session-aware scale-down in progress (docs/operator.md, "Scale-down")."""

    engines: list[str] | None = Field(None, description="Departing engines (router ids): no new sessions.")
    from_replicas: int | None = Field(None, description="Engine replicas before the scale-down.")
    to_replicas: int | None = Field(None, description="Engine replicas after it (spec.engines.replicas).")
    started_at: str | None = Field(None, description="When the drain began.")
    deadline: str | None = Field(
        None, description="When the Deployment shrinks even if sessions are left (operator drain_timeout_s)."
    )
    sessions_left: int | None = Field(None, description="Live sessions and requests on the departing engines.")


class EnginesStatus(_Model):
    desired: int | None = Field(None, description="spec.engines.replicas as last reconciled.")
    ready: int | None = Field(None, description="Engine pods ready (the Deployment's readyReplicas).")
    summary: str | None = Field(None, description="'ready/desired', for kubectl get.")
    selector: str | None = Field(None, description="Label selector of engine pods (scale subresource).")
    drain: DrainStatus | None = Field(None, description="The scale-down in progress, if any.")
    weight_versions: list[str] | None = Field(
        None, description="Weight versions the router reports for its engines (more than one: mid-update)."
    )
    held: list[str] | None = Field(
        None, description="Engines the router gives no new work although healthy: each restarted, or joined the "
        "pool, after a weight version was recorded, and serves its start-up weights until a weight update "
        "through the router reaches it."
    )


class ShardView(_Model):
    """One router shard as the operator last read it (router.shards > 1)."""

    index: int
    url: str | None = Field(None, description="The shard's own base URL (admin calls go to each one).")
    up: bool | None = Field(None, description="Its /status answered.")
    ready: bool | None = None
    generation: int | None = Field(None, description="Config generation the shard reports applied.")
    healthy_engines: int | None = None
    owned_engines: int | None = Field(None, description="Engines it owns now (more while a peer is down).")
    handing_back_engines: int | None = Field(
        None, description="Engines it handed back to a returning shard and still finishes its sessions on."
    )
    live_shards: list[int] | None = Field(None, description="Shards it sees alive (itself included).")
    error: str | None = Field(None, description="Why it did not answer.")


class ProxyView(_Model):
    """The HAProxy Deployment in front of the shards: clients of the pool's Service reach a shard only
    through a ready proxy pod."""

    desired: int
    ready: int


class RouterStatusView(_Model):
    ready: bool | None = Field(None, description="Router pod ready and /status reports ready (every shard's).")
    ready_replicas: int | None = None
    healthy_engines: int | None = Field(None, description="Engines the router sees as healthy (all shards).")
    url: str | None = Field(None, description="In-cluster base URL of the router (OpenAI API); with shards, "
                            "the proxy in front of them.")
    shards: list[ShardView] | None = Field(None, description="Each router shard (router.shards > 1).")
    proxy: ProxyView | None = Field(None, description="The shard proxy's pods (router.shards > 1).")


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
    effective: dict[str, Any] | None = Field(
        None, description="The tunables the pool runs with: its own where the spec sets them, the operator "
        "release's defaults where not (models.effective_values); the spec itself stores only what was written.",
    )


def parse_spec(spec: Any) -> RolloutPoolSpec:
    """Validate a RolloutPool spec (camelCase mapping); raises pydantic.ValidationError."""
    return RolloutPoolSpec.model_validate(spec)


def _path_part(part: str | int, admission_depth: int | None) -> str:
    if isinstance(part, int):
        return f"[{part}]"
    if admission_depth is not None:
        # spec.admission holds the router's PolicySettings: its snake_case names, shown as written.
        part = _ADMISSION_RENAMES.get(part, part) if admission_depth == 0 else part
        part = snake_to_camel(part)
    if any(c in part for c in "./ "):
        return f"[{part}]"
    return f".{part}"


def spec_error_lines(exc: ValidationError, root: str = "spec") -> list[str]:
    """One line per problem, each naming its path as the manifest writes it
    (``spec.workloads[1].share: ...``, ``spec.admission.sessionAdmission.epochS: ...``)."""
    lines = []
    for err in exc.errors():
        path = root
        admission_depth: int | None = None
        for part in err["loc"]:
            if isinstance(part, str) and (part.startswith("function-") or part in ("list[str]",)):
                continue
            path += _path_part(part, admission_depth)
            if admission_depth is not None:
                admission_depth += 1
            elif part == "admission" and path == f"{root}.admission":
                admission_depth = 0
        ctx = err.get("ctx") or {}
        if err["type"] == "refused" and ctx.get("problems"):
            lines += [f"{path}{sub}: {msg}" for sub, msg in ctx["problems"]]
        else:
            lines.append(f"{path}: {err['msg'].removeprefix('Value error, ')}")
    return lines


def describe_spec_error(exc: ValidationError) -> str:
    """Every problem of an invalid spec on one line, ``; ``-separated (see ``spec_error_lines``)."""
    return "; ".join(spec_error_lines(exc))


def pool_name_error(name: str) -> str | None:
    """A reason the pool name cannot be used, or None: it must fit every child it names (the engine and
    router Services are DNS-1035 labels; names within 63 characters) and be a label value."""
    if not name:
        return "metadata.name is required"
    if len(name) > MAX_POOL_NAME:
        return f"metadata.name must be at most {MAX_POOL_NAME} characters, got {len(name)}"
    for kind, child in PoolNames(name, "-").children():
        check = kv.dns1035_label if kind == "Service" else kv.dns1123_subdomain
        if problem := check(child):
            return f"metadata.name: {name!r} cannot name a {kind} ({child}): {problem}"
    if problem := kv.label_value(name):
        return f"metadata.name: {name!r} cannot be a label value: {problem}"
    return None


def effective_values(spec: RolloutPoolSpec) -> dict[str, Any]:
    """The tunables a pool runs with, its own where set and the release's defaults where not
    (camelCase; ``status.effective``). Pure: the same spec gives the same values."""
    e, r = spec.engines, spec.router
    out: dict[str, Any] = {
        "admission": camel_keys(_admission_dump(spec.admission)),
        "kvBudget": {"fraction": spec.kv_budget.fraction},
        "router": {
            "holdDeadlineSeconds": router_hold_deadline(r),
            "probes": {"timeoutSeconds": probe_timeout(r)},
            "shutdown": {"preStopSleepSeconds": pre_stop_sleep(r)},
        },
    }
    if r.shards > 1:
        out["router"]["handbackIdleSeconds"] = router_handback_idle(r)
    if e.external is None:
        out["engines"] = {
            "gpuMemoryUtilization": e.gpu_memory_utilization,
            "listenAddress": e.listen_address,
            "shmSize": e.shm_size or DEFAULT_SHM_SIZE,
            "modelCache": {"claimName": e.model_cache.claim_name, "sizeLimit": e.model_cache.effective_size_limit,
                           "mountPath": e.model_cache.mount_path},
            "probes": {"timeoutSeconds": probe_timeout(e), "startupBudgetSeconds": startup_budget(e)},
            "shutdown": {"preStopSleepSeconds": pre_stop_sleep(e), "drainSeconds": drain_seconds(e)},
            "terminationGracePeriodSeconds": engine_grace_period(e),
            "disruptionBudget": {"maxUnavailable": max_unavailable(e)},
        }
        if e.gpu_memory_utilization is None:
            del out["engines"]["gpuMemoryUtilization"]  # vLLM's own default applies
    return out


# ---- effective values of the pod settings (named defaults, one place) -------------------

ENGINE_PROBE_TIMEOUT_S = 10
"""Engine probe timeout (project default: vLLM's /health stalls for seconds under heavy load)."""
ROUTER_PROBE_TIMEOUT_S = 5
ENGINE_STARTUP_BUDGET_S = 1800
"""Download, load and compile before the kubelet gives up (project default: 30 minutes)."""
PRE_STOP_SLEEP_S = 10
"""Seconds between the pod leaving its Service and SIGTERM (the router re-resolves every 5 s)."""
ENGINE_DRAIN_S = 600
"""vLLM --shutdown-timeout: running generations get this long to finish (project default)."""
ENGINE_EXIT_MARGIN_S = 30
"""Grace beyond preStop + drain for vLLM to exit its worker processes."""
ENGINE_MAX_UNAVAILABLE = 1
"""PodDisruptionBudget maxUnavailable (one engine at a time, like the rolling update)."""


def probe_timeout(pod: EnginesSpec | RouterSpec) -> int:
    default = ENGINE_PROBE_TIMEOUT_S if isinstance(pod, EnginesSpec) else ROUTER_PROBE_TIMEOUT_S
    return pod.probes.timeout_seconds or default


def startup_budget(e: EnginesSpec) -> int:
    return e.probes.startup_budget_seconds or ENGINE_STARTUP_BUDGET_S


def startup_failures(e: EnginesSpec, period_s: int) -> int:
    return max(1, math.ceil(startup_budget(e) / period_s))


def pre_stop_sleep(pod: EnginesSpec | RouterSpec) -> int:
    value = pod.shutdown.pre_stop_sleep_seconds
    return PRE_STOP_SLEEP_S if value is None else value


def drain_seconds(e: EnginesSpec) -> int:
    value = e.shutdown.drain_seconds
    return ENGINE_DRAIN_S if value is None else value


def engine_grace_period(e: EnginesSpec) -> int:
    return pre_stop_sleep(e) + drain_seconds(e) + ENGINE_EXIT_MARGIN_S


def max_unavailable(e: EnginesSpec) -> int:
    value = e.disruption_budget.max_unavailable
    return ENGINE_MAX_UNAVAILABLE if value is None else value


def router_handback_idle(r: RouterSpec) -> float:
    default = ShardsConfig.model_fields["handback_idle_s"].default
    return float(default if r.handback_idle_seconds is None else r.handback_idle_seconds)


def router_hold_deadline(r: RouterSpec) -> float:
    default = RouterConfig.model_fields["hold_deadline_s"].default
    return float(default if r.hold_deadline_seconds is None else r.hold_deadline_seconds)
