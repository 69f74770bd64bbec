"""Pure desired state: a validated RolloutPool spec -> the Kubernetes objects it owns.

No I/O here: every ``build_*`` takes the spec and the pool's identity and
returns a plain dict, so the golden tests pin the exact objects and the
handlers only compare and apply. ``render`` builds everything or raises, so
an invalid pool is never half applied.

Restart rules, by construction:
- engine settings are all in the engine Deployment's pod template, so any
  engine change rolls the engines (one pod at a time, no surge: GPU pools
  rarely have a spare node);
- the router Deployment depends only on ``spec.router`` and names: admission,
  workload and budget settings live in the ConfigMap (mounted as a directory,
  so kubelet's atomic swap reaches the router's file watcher) and are pushed
  to ``PUT /admin/config``. There is deliberately no config-hash annotation
  on the router pod template.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import yaml

from misat_router.config import EnginesConfig, RouterConfig, ServiceRef
from misat_router.policy.settings import ClassSpec, WorkloadMix

from .models import ROUTER_DEFAULT_LIMITS, EnginesSpec, ResourceRequirements, RolloutPoolSpec, RouterSpec
from .names import (
    ADMIN_DIR,
    API_VERSION,
    CONFIG_DIR,
    CONFIG_KEY,
    ENGINE_PORT_NAME,
    KIND,
    ROUTER_PORT_NAME,
    TOKEN_KEY,
    PoolNames,
)

GPU_RESOURCE = "nvidia.com/gpu"
ENGINE_COMPONENT = "engine"
ROUTER_COMPONENT = "router"
ROUTER_UID = 65532
"""Router runs as this non-root uid/gid (distroless 'nonroot'); the admin Secret is group-readable."""
ENGINE_STARTUP_PERIOD_S = 10
ENGINE_STARTUP_FAILURES = 180
"""30 minutes to load weights and capture graphs before the kubelet gives up on an engine."""
DSHM_VOLUME = "dshm"


@dataclass(frozen=True, slots=True)
class PoolRef:
    """Identity of the owning RolloutPool (owner references, config generation)."""

    name: str
    namespace: str
    uid: str
    generation: int

    @property
    def names(self) -> PoolNames:
        return PoolNames(self.name, self.namespace)


@dataclass(frozen=True, slots=True)
class Desired:
    """Everything one pool owns, in apply order (config before the pods that read it)."""

    secret: dict[str, Any]
    config_map: dict[str, Any]
    engine_service: dict[str, Any]
    router_service: dict[str, Any]
    engine_deployment: dict[str, Any]
    router_deployment: dict[str, Any]
    router_config: RouterConfig

    def objects(self) -> list[dict[str, Any]]:
        return [
            self.secret, self.config_map, self.engine_service, self.router_service,
            self.engine_deployment, self.router_deployment,
        ]


def owner_reference(ref: PoolRef) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": ref.name,
        "uid": ref.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(ref: PoolRef, name: str, component: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": ref.namespace,
        "labels": ref.names.labels(component),
        "ownerReferences": [owner_reference(ref)],
    }


def _resources(res: ResourceRequirements | None, gpus: int = 0) -> dict[str, Any]:
    limits = dict(res.limits) if res else {}
    requests = dict(res.requests) if res else {}
    if gpus:
        limits[GPU_RESOURCE] = gpus
        requests.pop(GPU_RESOURCE, None)  # extended resources: requests default to limits
    out: dict[str, Any] = {}
    if limits:
        out["limits"] = limits
    if requests:
        out["requests"] = requests
    return out


def _scheduling(node_selector: dict[str, str], tolerations: list[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if node_selector:
        out["nodeSelector"] = dict(node_selector)
    if tolerations:
        out["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in tolerations]
    return out


# ---- router config ---------------------------------------------------------


def build_router_config(
    spec: RolloutPoolSpec, ref: PoolRef, cluster_domain: str = "cluster.local"
) -> RouterConfig:
    """The RouterConfig the pool stands for; constructing it validates it (raises on error)."""
    classes = tuple(
        ClassSpec(
            name=w.name,
            share=w.share,
            multi_turn=w.multi_turn,
            min_share=w.min_kv_share,
            max_share=w.max_kv_share,
            bootstrap_footprint_tokens=w.bootstrap_footprint_tokens,
        )
        for w in spec.workloads
    )
    return RouterConfig(
        generation=ref.generation,
        model=spec.model.served,
        engines=EnginesConfig(
            service=ServiceRef(name=ref.names.engines_dns(cluster_domain), port=spec.engines.port)
        ),
        workloads=WorkloadMix(classes=classes, default_class=spec.default_class),
        policy=spec.admission.model_copy(update={"kv_budget_fraction": spec.kv_budget.fraction}),
        hold_deadline_s=spec.router.hold_deadline_seconds,
    )


def router_config_yaml(config: RouterConfig) -> str:
    """ConfigMap payload: every setting explicit, so the mounted file reads on its own."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def build_config_map(ref: PoolRef, config: RouterConfig) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(ref, ref.names.router_config, ROUTER_COMPONENT),
        "data": {CONFIG_KEY: router_config_yaml(config)},
    }


def build_secret(ref: PoolRef, token: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(ref, ref.names.admin_secret, ROUTER_COMPONENT),
        "type": "Opaque",
        "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def token_from_secret(secret: dict[str, Any]) -> str | None:
    """The admin token held by an existing Secret, or None when it holds none."""
    raw = (secret.get("data") or {}).get(TOKEN_KEY)
    if not raw:
        return None
    try:
        return base64.b64decode(raw).decode() or None
    except (ValueError, UnicodeDecodeError):
        return None


# ---- engines ---------------------------------------------------------------


def engine_args(spec: RolloutPoolSpec) -> list[str]:
    """vLLM OpenAI server arguments from the typed fields, then extraArgs verbatim."""
    e = spec.engines
    args = [
        "--model", spec.model.name,
        "--served-model-name", spec.model.served,
        "--host", "0.0.0.0",
        "--port", str(e.port),
        "--tensor-parallel-size", str(e.tensor_parallel_size),
        "--gpu-memory-utilization", f"{e.gpu_memory_utilization:g}",
    ]
    if e.max_model_len is not None:
        args += ["--max-model-len", str(e.max_model_len)]
    args.append("--enable-prefix-caching" if e.enable_prefix_caching else "--no-enable-prefix-caching")
    if e.max_num_seqs is not None:
        args += ["--max-num-seqs", str(e.max_num_seqs)]
    if e.max_num_batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(e.max_num_batched_tokens)]
    # The router reads prompt_tokens_details.cached_tokens for per-request hit accounting.
    args.append("--enable-prompt-tokens-details")
    return args + list(e.extra_args)


def _http_probe(path: str, port: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "failureThreshold": failures,
    }


def _engine_volumes(e: EnginesSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    if e.model_volume is not None:
        volumes.append({"name": "model", **e.model_volume.source})
        mounts.append(
            {"name": "model", "mountPath": e.model_volume.mount_path, "readOnly": e.model_volume.read_only}
        )
    if e.tensor_parallel_size > 1:
        # NCCL between tensor-parallel workers needs more shared memory than the 64 MiB default.
        volumes.append({"name": DSHM_VOLUME, "emptyDir": {"medium": "Memory"}})
        mounts.append({"name": DSHM_VOLUME, "mountPath": "/dev/shm"})
    return volumes, mounts


def build_engine_deployment(spec: RolloutPoolSpec, ref: PoolRef) -> dict[str, Any]:
    e = spec.engines
    names = ref.names
    volumes, mounts = _engine_volumes(e)
    container: dict[str, Any] = {
        "name": "vllm",
        "image": e.image,
        "imagePullPolicy": e.image_pull_policy,
        "command": ["python3", "-m", "vllm.entrypoints.openai.api_server"],
        "args": engine_args(spec),
        "ports": [{"name": ENGINE_PORT_NAME, "containerPort": e.port, "protocol": "TCP"}],
        "startupProbe": _http_probe(
            "/health", ENGINE_PORT_NAME, ENGINE_STARTUP_PERIOD_S, ENGINE_STARTUP_FAILURES
        ),
        "readinessProbe": _http_probe("/health", ENGINE_PORT_NAME, 5, 3),
        "livenessProbe": _http_probe("/health", ENGINE_PORT_NAME, 10, 6),
    }
    if e.env:
        container["env"] = [v.model_dump(by_alias=True, exclude_none=True) for v in e.env]
    resources = _resources(e.resources, e.gpus_per_replica)
    if resources:
        container["resources"] = resources
    if mounts:
        container["volumeMounts"] = mounts
    pod_spec: dict[str, Any] = {"containers": [container], **_scheduling(e.node_selector, e.tolerations)}
    if volumes:
        pod_spec["volumes"] = volumes
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(ref, names.engines, ENGINE_COMPONENT),
        "spec": {
            "replicas": e.replicas,
            "selector": {"matchLabels": names.selector(ENGINE_COMPONENT)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "template": {"metadata": {"labels": names.labels(ENGINE_COMPONENT)}, "spec": pod_spec},
        },
    }


def build_engine_service(spec: RolloutPoolSpec, ref: PoolRef) -> dict[str, Any]:
    """Headless: the router resolves one address per ready engine pod and balances itself."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(ref, ref.names.engines, ENGINE_COMPONENT),
        "spec": {
            "clusterIP": "None",
            "selector": ref.names.selector(ENGINE_COMPONENT),
            "ports": [
                {"name": ENGINE_PORT_NAME, "port": spec.engines.port, "targetPort": ENGINE_PORT_NAME,
                 "protocol": "TCP"}
            ],
        },
    }


# ---- router ----------------------------------------------------------------


def router_command(r: RouterSpec) -> list[str]:
    args = [
        "misat", "router",
        "--config", f"{CONFIG_DIR}/{CONFIG_KEY}",
        "--admin-token-file", f"{ADMIN_DIR}/{TOKEN_KEY}",
        "--port", str(r.port),
    ]
    return [*args, "--log-json"] if r.log_json else args


def build_router_deployment(spec: RolloutPoolSpec, ref: PoolRef) -> dict[str, Any]:
    """Depends on spec.router and names only: config changes never touch this template."""
    r = spec.router
    names = ref.names
    container: dict[str, Any] = {
        "name": "router",
        "image": r.image,
        "imagePullPolicy": r.image_pull_policy,
        "command": router_command(r),
        "ports": [{"name": ROUTER_PORT_NAME, "containerPort": r.port, "protocol": "TCP"}],
        # /health, not /ready: the Service must reach the router (and its admin API) even
        # while no engine is healthy; /ready reports engine health in status instead.
        "readinessProbe": _http_probe("/health", ROUTER_PORT_NAME, 5, 3),
        "livenessProbe": _http_probe("/health", ROUTER_PORT_NAME, 10, 3),
        "securityContext": {
            "runAsNonRoot": True,
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "admin", "mountPath": ADMIN_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    resources = _resources(r.resources)
    # Every router container has limits: the pool's own, else the defaults, key by key.
    resources["limits"] = ROUTER_DEFAULT_LIMITS | resources.get("limits", {})
    container["resources"] = resources
    pod_spec: dict[str, Any] = {
        # The router never calls the Kubernetes API: no service-account token in its pod.
        "automountServiceAccountToken": False,
        "securityContext": {
            "runAsUser": ROUTER_UID, "runAsGroup": ROUTER_UID, "fsGroup": ROUTER_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": [
            {"name": "config", "configMap": {"name": names.router_config}},
            {"name": "admin", "secret": {"secretName": names.admin_secret, "defaultMode": 0o440}},
            {"name": "tmp", "emptyDir": {}},
        ],
        **_scheduling(r.node_selector, r.tolerations),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(ref, names.router, ROUTER_COMPONENT),
        "spec": {
            "replicas": r.replicas,
            "selector": {"matchLabels": names.selector(ROUTER_COMPONENT)},
            # Never two routers at once: each would admit against the same engines.
            "strategy": {"type": "Recreate"},
            "template": {"metadata": {"labels": names.labels(ROUTER_COMPONENT)}, "spec": pod_spec},
        },
    }


def build_router_service(spec: RolloutPoolSpec, ref: PoolRef) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(ref, ref.names.router, ROUTER_COMPONENT),
        "spec": {
            "type": "ClusterIP",
            "selector": ref.names.selector(ROUTER_COMPONENT),
            "ports": [
                {"name": ROUTER_PORT_NAME, "port": spec.router.port, "targetPort": ROUTER_PORT_NAME,
                 "protocol": "TCP"}
            ],
        },
    }


def render(spec: RolloutPoolSpec, ref: PoolRef, token: str, cluster_domain: str = "cluster.local") -> Desired:
    """Everything the pool owns, or an exception: nothing is applied from a partial render."""
    config = build_router_config(spec, ref, cluster_domain)
    return Desired(
        secret=build_secret(ref, token),
        config_map=build_config_map(ref, config),
        engine_service=build_engine_service(spec, ref),
        router_service=build_router_service(spec, ref),
        engine_deployment=build_engine_deployment(spec, ref),
        router_deployment=build_router_deployment(spec, ref),
        router_config=config,
    )
