"""Pure desired state: a validated RolloutPool spec -> the Kubernetes objects it owns.

No I/O here: every ``build_*`` takes the spec and the pool's identity and
returns a plain dict, so the golden tests pin the exact objects and the
handlers only compare and apply. ``render`` builds everything or raises, so
an invalid pool is never half applied; its last check is the size of each
object's annotations with the last-applied record the apply step adds.

Restart rules, by construction:
- engine settings are all in the engine Deployment's pod template, so any
  engine change rolls the engines (one pod at a time, no surge: GPU pools
  rarely have a spare node);
- the router Deployment depends only on ``spec.router`` and names: admission,
  workload and budget settings live in the ConfigMap (mounted as a directory,
  so kubelet's atomic swap reaches the router's file watcher) and are pushed
  to ``PUT /admin/config``. There is deliberately no config-hash annotation
  on the router pod template.

Pods (docs/operator.md, "Engine and router pods"): the restricted Pod
Security profile (non-root, no privilege escalation, no capabilities,
seccomp RuntimeDefault, no service-account token), probes with timeouts and
a startup budget, a preStop sleep then a drain within a derived grace
period. Engines get a model cache (HF_HOME), a sized /dev/shm, a
PodDisruptionBudget, and run ``vllm serve <model>`` listening on ``::``.
With ``spec.engines.external`` no engine object is rendered at all.
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass
from typing import Any

import yaml

from misat_router.config import EnginesConfig, RouterConfig, ServiceRef, ShardsConfig
from misat_router.policy.settings import ClassSpec, WorkloadMix

from . import kube_validation as kv
from .diff import with_last_applied
from .haproxy import HEALTH_PATH, ShardServer, haproxy_config
from .models import (
    DEFAULT_SHM_SIZE,
    ENGINE_UID,
    GPU_RESOURCE,
    ROUTER_DEFAULT_LIMITS,
    ROUTER_UID,
    EnginesSpec,
    PodSettings,
    ResourceRequirements,
    RolloutPoolSpec,
    RouterSpec,
    drain_seconds,
    engine_grace_period,
    max_unavailable,
    pre_stop_sleep,
    probe_timeout,
    router_handback_idle,
    router_hold_deadline,
    startup_failures,
)
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
    service_dns,
)

ENGINE_COMPONENT = "engine"
ROUTER_COMPONENT = "router"
SHARD_COMPONENT = "router-shard"
"""Router shard pods (router.shards > 1): their own label, so the single-router Deployment (kept at
0 replicas) and the StatefulSet never select each other's pods."""
PROXY_COMPONENT = "router-proxy"
PROXY_REPLICAS = 2
"""Shard proxies: two, so a proxy pod's loss is not the pool's; both hash alike (fixed server ids)."""
PROXY_DEFAULT_LIMITS: dict[str, str] = {"cpu": "2", "memory": "512Mi"}
"""HAProxy's limits (project default: the measured proxy cost per request, docs/scale.md, is a small
fraction of a router's, so two CPUs front many shards; memory is buffers per connection)."""
PROXY_UID = 99
"""The official haproxy image's own `haproxy` user (its Dockerfile creates uid and gid 99)."""
PROXY_CONFIG_DIR = "/usr/local/etc/haproxy"
"""Where the official image's default command reads haproxy.cfg."""
PROXY_CONFIG_KEY = "haproxy.cfg"
PROXY_CONFIG_HASH_ANNOTATION = "misat.dev/proxy-config-hash"
"""On the proxy pod template: HAProxy does not re-read its file, so a new config rolls the proxies."""
PROXY_LISTEN_ADDRESS = "::"
"""Both families (``bind [::]:port v4v6``)."""
ENGINE_STARTUP_PERIOD_S = 10
"""startupProbe period; its failureThreshold is spec.engines.probes.startupBudgetSeconds / this."""
ENGINE_READINESS_PERIOD_S, ENGINE_READINESS_FAILURES = 5, 3
ENGINE_LIVENESS_PERIOD_S, ENGINE_LIVENESS_FAILURES = 10, 6
"""A started engine is restarted after a minute of failed /health checks, not one slow answer."""
ROUTER_READINESS_PERIOD_S, ROUTER_READINESS_FAILURES = 5, 3
ROUTER_LIVENESS_PERIOD_S, ROUTER_LIVENESS_FAILURES = 10, 3
ROUTER_EXIT_MARGIN_S = 10
"""Grace beyond the router's own drain (RouterConfig.drain_timeout_s and aiohttp's shutdown)."""
ROUTER_LISTEN_ADDRESS = ""
"""`misat router --host ''`: every address of both families (asyncio binds 0.0.0.0 and ::)."""
DSHM_VOLUME = "dshm"
CACHE_VOLUME = "model-cache"
MODEL_VOLUME = "model"
POD_SECURITY_PROFILE = "restricted"


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
    """Everything one pool owns, in apply order (config before the pods that read it). The engine
    objects are None for a pool of external engines."""

    secret: dict[str, Any]
    config_map: dict[str, Any]
    engine_service: dict[str, Any] | None
    router_service: dict[str, Any]
    engine_deployment: dict[str, Any] | None
    router_deployment: dict[str, Any]
    router_config: RouterConfig
    engine_disruption_budget: dict[str, Any] | None = None
    shard_service: dict[str, Any] | None = None
    """Router shards (router.shards > 1): the headless Service, the StatefulSet, the proxy."""
    router_statefulset: dict[str, Any] | None = None
    proxy_config_map: dict[str, Any] | None = None
    proxy_deployment: dict[str, Any] | None = None

    def objects(self) -> list[dict[str, Any]]:
        ordered = [
            self.secret, self.config_map, self.proxy_config_map, self.engine_service, self.router_service,
            self.shard_service, self.engine_deployment, self.router_deployment, self.router_statefulset,
            self.proxy_deployment, self.engine_disruption_budget,
        ]
        return [o for o in ordered if o is not None]


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


def _pod_fields(pod: PodSettings, ref: PoolRef, component: str) -> dict[str, Any]:
    """Pod-level fields shared by engines and router: identity, scheduling, the token."""
    out: dict[str, Any] = {"automountServiceAccountToken": pod.automount_service_account_token}
    if pod.image_pull_secrets:
        out["imagePullSecrets"] = [s.to_kube() for s in pod.image_pull_secrets]
    for key, value in (
        ("serviceAccountName", pod.service_account_name),
        ("runtimeClassName", pod.runtime_class_name),
        ("priorityClassName", pod.priority_class_name),
    ):
        if value is not None:
            out[key] = value
    if pod.node_selector:
        out["nodeSelector"] = dict(pod.node_selector)
    if pod.tolerations:
        out["tolerations"] = [t.to_kube() for t in pod.tolerations]
    if pod.affinity is not None:
        out["affinity"] = pod.affinity.to_kube()
    if pod.topology_spread_constraints:
        own = {"matchLabels": ref.names.selector(component)}
        out["topologySpreadConstraints"] = [
            {**c.to_kube(), "labelSelector": c.label_selector.to_kube() if c.label_selector else own}
            for c in pod.topology_spread_constraints
        ]
    return out


def _pod_security(pod: PodSettings, default_uid: int) -> dict[str, Any]:
    """The restricted Pod Security profile's pod half; ``_container_security`` is the other."""
    uid = pod.security_context.run_as_user or default_uid
    gid = pod.security_context.run_as_group or uid
    return {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": gid,
        "fsGroup": pod.security_context.fs_group or gid,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _container_security(read_only_root: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }
    if read_only_root:
        out["readOnlyRootFilesystem"] = True
    return out


def _template_metadata(pod: PodSettings, ref: PoolRef, component: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"labels": {**pod.pod_labels, **ref.names.labels(component)}}
    if pod.pod_annotations:
        meta["annotations"] = dict(pod.pod_annotations)
    return meta


def _http_probe(path: str, port: str, period: int, failures: int, timeout: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": timeout,
    }


def _pre_stop(seconds: int) -> dict[str, Any]:
    """Sleep before SIGTERM, so the Service and the router stop sending first (Kubernetes 1.30+)."""
    return {"preStop": {"sleep": {"seconds": seconds}}} if seconds else {}


# ---- router config ---------------------------------------------------------


def engines_config(spec: RolloutPoolSpec, ref: PoolRef, cluster_domain: str = "cluster.local") -> EnginesConfig:
    """Where the router finds the engines: the pool's headless Service, or the external ones."""
    external = spec.engines.external
    if external is None:
        return EnginesConfig(
            service=ServiceRef(name=ref.names.engines_dns(cluster_domain), port=spec.engines.port)
        )
    if external.urls is not None:
        return EnginesConfig(urls=tuple(external.urls))
    svc = external.service
    assert svc is not None  # ExternalEngines holds exactly one of the two
    name = service_dns(svc.name, svc.namespace or ref.namespace, cluster_domain)
    return EnginesConfig(service=ServiceRef(name=name, port=svc.port, scheme=svc.scheme))


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
    shards = None
    if spec.router.shards > 1:
        names = ref.names
        peers = tuple(names.shard_url(i, spec.router.port, cluster_domain) for i in range(spec.router.shards))
        shards = ShardsConfig(peers=peers, handback_idle_s=router_handback_idle(spec.router))
    return RouterConfig(
        generation=ref.generation,
        model=spec.model.served,
        engines=engines_config(spec, ref, cluster_domain),
        workloads=WorkloadMix(classes=classes, default_class=spec.default_class),
        policy=spec.admission.model_copy(update={"kv_budget_fraction": spec.kv_budget.fraction}),
        hold_deadline_s=router_hold_deadline(spec.router),
        shards=shards,
    )


def router_config_yaml(config: RouterConfig) -> str:
    """ConfigMap payload: every setting explicit, so the mounted file reads on its own (``shards``
    only where set: an unsharded router's file stays as it was before shards existed)."""
    exclude = {"shards"} if config.shards is None else None
    return yaml.safe_dump(config.model_dump(mode="json", exclude=exclude), sort_keys=False)


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

ENGINE_COMMAND = ["vllm"]
"""`vllm serve <model> ...`: the supported entry point (the api_server module is internal)."""


def engine_args(spec: RolloutPoolSpec) -> list[str]:
    """`vllm serve` arguments: the model, the flags of the typed fields, then extraArgs verbatim
    (``engine_args.check`` refused any that would repeat or undo a typed flag)."""
    e = spec.engines
    args = [
        "serve", spec.model.name,
        "--served-model-name", spec.model.served,
        "--host", e.listen_address,
        "--port", str(e.port),
        "--tensor-parallel-size", str(e.tensor_parallel_size),
    ]
    if e.gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", f"{e.gpu_memory_utilization:g}"]
    if e.max_model_len is not None:
        args += ["--max-model-len", str(e.max_model_len)]
    args.append("--enable-prefix-caching" if e.enable_prefix_caching else "--no-enable-prefix-caching")
    if e.max_num_seqs is not None:
        args += ["--max-num-seqs", str(e.max_num_seqs)]
    if e.max_num_batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(e.max_num_batched_tokens)]
    # Running generations finish after SIGTERM (vLLM's drain mode) within the grace period.
    args += ["--shutdown-timeout", str(drain_seconds(e))]
    # The router reads prompt_tokens_details.cached_tokens for per-request hit accounting.
    args.append("--enable-prompt-tokens-details")
    return args + list(e.extra_args)


def engine_env(e: EnginesSpec) -> list[dict[str, Any]]:
    """Cache locations first (weights, compiled graphs and every ~/.cache land on the cache volume,
    not in the container's writable layer), then the pool's own variables."""
    root = e.model_cache.mount_path.rstrip("/")
    cache = [
        {"name": "HOME", "value": f"{root}/home"},
        {"name": "HF_HOME", "value": f"{root}/huggingface"},
        {"name": "VLLM_CACHE_ROOT", "value": f"{root}/vllm"},
        {"name": "XDG_CACHE_HOME", "value": root},
    ]
    return cache + [v.to_kube() for v in e.env]


def _engine_volumes(e: EnginesSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    cache = e.model_cache
    if cache.claim_name is not None:
        cache_source: dict[str, Any] = {"persistentVolumeClaim": {"claimName": cache.claim_name}}
    else:
        cache_source = {"emptyDir": {"sizeLimit": cache.effective_size_limit}}
    volumes: list[dict[str, Any]] = [
        {"name": CACHE_VOLUME, **cache_source},
        # NCCL and vLLM's worker broadcast need more shared memory than the runtime's 64 MiB.
        {"name": DSHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": e.shm_size or DEFAULT_SHM_SIZE}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": CACHE_VOLUME, "mountPath": cache.mount_path},
        {"name": DSHM_VOLUME, "mountPath": "/dev/shm"},
    ]
    if e.model_volume is not None:
        volumes.append({"name": MODEL_VOLUME, **e.model_volume.source})
        mounts.append(
            {"name": MODEL_VOLUME, "mountPath": e.model_volume.mount_path, "readOnly": e.model_volume.read_only}
        )
    return volumes, mounts


def build_engine_deployment(spec: RolloutPoolSpec, ref: PoolRef) -> dict[str, Any]:
    e = spec.engines
    names = ref.names
    volumes, mounts = _engine_volumes(e)
    timeout = probe_timeout(e)
    container: dict[str, Any] = {
        "name": "vllm",
        "image": e.image,
        "imagePullPolicy": e.image_pull_policy,
        "command": list(ENGINE_COMMAND),
        "args": engine_args(spec),
        "env": engine_env(e),
        "ports": [{"name": ENGINE_PORT_NAME, "containerPort": e.port, "protocol": "TCP"}],
        "startupProbe": _http_probe(
            "/health", ENGINE_PORT_NAME, ENGINE_STARTUP_PERIOD_S, startup_failures(e, ENGINE_STARTUP_PERIOD_S),
            timeout,
        ),
        "readinessProbe": _http_probe(
            "/health", ENGINE_PORT_NAME, ENGINE_READINESS_PERIOD_S, ENGINE_READINESS_FAILURES, timeout
        ),
        "livenessProbe": _http_probe(
            "/health", ENGINE_PORT_NAME, ENGINE_LIVENESS_PERIOD_S, ENGINE_LIVENESS_FAILURES, timeout
        ),
        "lifecycle": _pre_stop(pre_stop_sleep(e)),
        # vLLM writes outside its volumes (Triton, torch and compiler scratch): the root stays writable.
        "securityContext": _container_security(read_only_root=False),
        "volumeMounts": mounts,
    }
    if not container["lifecycle"]:
        del container["lifecycle"]
    resources = _resources(e.resources, e.gpus_per_replica)
    if resources:
        container["resources"] = resources
    pod_spec: dict[str, Any] = {
        **_pod_fields(e, ref, ENGINE_COMPONENT),
        "securityContext": _pod_security(e, ENGINE_UID),
        "terminationGracePeriodSeconds": engine_grace_period(e),
        "containers": [container],
        "volumes": volumes,
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(ref, names.engines, ENGINE_COMPONENT),
        "spec": {
            "replicas": e.replicas,
            "selector": {"matchLabels": names.selector(ENGINE_COMPONENT)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "template": {"metadata": _template_metadata(e, ref, ENGINE_COMPONENT), "spec": pod_spec},
        },
    }


def build_engine_service(spec: RolloutPoolSpec, ref: PoolRef) -> dict[str, Any]:
    """Headless: the router resolves one address per ready engine pod and balances itself. Single
    stack on purpose (the cluster's primary family): a dual-stack headless Service would give the
    router each engine twice, once per family."""
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


def build_engine_disruption_budget(spec: RolloutPoolSpec, ref: PoolRef) -> dict[str, Any]:
    """Node drains and the cluster autoscaler evict at most maxUnavailable engines at once. An
    engine that is not ready may always be evicted, so a crash-looping one never blocks a drain."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(ref, ref.names.engines, ENGINE_COMPONENT),
        "spec": {
            "maxUnavailable": max_unavailable(spec.engines),
            "selector": {"matchLabels": ref.names.selector(ENGINE_COMPONENT)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


# ---- router ----------------------------------------------------------------


def router_command(r: RouterSpec) -> list[str]:
    args = [
        "misat", "router",
        "--config", f"{CONFIG_DIR}/{CONFIG_KEY}",
        "--admin-token-file", f"{ADMIN_DIR}/{TOKEN_KEY}",
        "--host", ROUTER_LISTEN_ADDRESS,
        "--port", str(r.port),
    ]
    return [*args, "--log-json"] if r.log_json else args


def router_grace_period(r: RouterSpec) -> int:
    """preStop, then the router's own drain of in-flight requests (RouterConfig.drain_timeout_s)."""
    drain = float(RouterConfig.model_fields["drain_timeout_s"].default)
    return pre_stop_sleep(r) + int(drain) + ROUTER_EXIT_MARGIN_S


def _router_template(spec: RolloutPoolSpec, ref: PoolRef, component: str) -> dict[str, Any]:
    """The router pod template (one router, or each shard: a shard reads its index from its
    StatefulSet hostname, so the template is the same)."""
    r = spec.router
    names = ref.names
    timeout = probe_timeout(r)
    container: dict[str, Any] = {
        "name": "router",
        "image": r.image,
        "imagePullPolicy": r.image_pull_policy,
        "command": router_command(r),
        "ports": [{"name": ROUTER_PORT_NAME, "containerPort": r.port, "protocol": "TCP"}],
        # /health, not /ready: the Service must reach the router (and its admin API) even
        # while no engine is healthy; /ready reports engine health in status instead.
        "readinessProbe": _http_probe(
            "/health", ROUTER_PORT_NAME, ROUTER_READINESS_PERIOD_S, ROUTER_READINESS_FAILURES, timeout
        ),
        "livenessProbe": _http_probe(
            "/health", ROUTER_PORT_NAME, ROUTER_LIVENESS_PERIOD_S, ROUTER_LIVENESS_FAILURES, timeout
        ),
        "lifecycle": _pre_stop(pre_stop_sleep(r)),
        "securityContext": _container_security(read_only_root=True),
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "admin", "mountPath": ADMIN_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    if not container["lifecycle"]:
        del container["lifecycle"]
    resources = _resources(r.resources)
    # Every router container has limits: the pool's own, else the defaults, key by key.
    resources["limits"] = ROUTER_DEFAULT_LIMITS | resources.get("limits", {})
    container["resources"] = resources
    pod_spec: dict[str, Any] = {
        # The router never calls the Kubernetes API: no service-account token unless asked for.
        **_pod_fields(r, ref, component),
        "securityContext": _pod_security(r, ROUTER_UID),
        "terminationGracePeriodSeconds": router_grace_period(r),
        "containers": [container],
        "volumes": [
            {"name": "config", "configMap": {"name": names.router_config}},
            {"name": "admin", "secret": {"secretName": names.admin_secret, "defaultMode": 0o440}},
            {"name": "tmp", "emptyDir": {}},
        ],
    }
    return {"metadata": _template_metadata(r, ref, component), "spec": pod_spec}


def build_router_deployment(spec: RolloutPoolSpec, ref: PoolRef) -> dict[str, Any]:
    """Depends on spec.router and names only: config changes never touch this template. With
    shards it stays, at 0 replicas: the StatefulSet's shards own the engines instead."""
    r = spec.router
    names = ref.names
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(ref, names.router, ROUTER_COMPONENT),
        "spec": {
            "replicas": r.replicas if r.shards == 1 else 0,
            "selector": {"matchLabels": names.selector(ROUTER_COMPONENT)},
            # Never two routers at once: each would admit against the same engines.
            "strategy": {"type": "Recreate"},
            "template": _router_template(spec, ref, ROUTER_COMPONENT),
        },
    }


def build_router_statefulset(spec: RolloutPoolSpec, ref: PoolRef) -> dict[str, Any]:
    """The router shards: pod ``{pool}-router-N`` is shard N. Parallel pod management: shards are
    independent (a missing one's engines are re-homed), so none waits for another to start."""
    names = ref.names
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _metadata(ref, names.router, SHARD_COMPONENT),
        "spec": {
            "replicas": spec.router.shards,
            "serviceName": names.router_shards,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": names.selector(SHARD_COMPONENT)},
            "updateStrategy": {"type": "RollingUpdate"},
            "template": _router_template(spec, ref, SHARD_COMPONENT),
        },
    }


def build_shard_service(spec: RolloutPoolSpec, ref: PoolRef) -> dict[str, Any]:
    """Headless: a DNS name per shard pod, for its peers and the proxy. Not-ready pods are
    published too: a shard's liveness is its peers' and the proxy's own /health checks."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(ref, ref.names.router_shards, SHARD_COMPONENT),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": ref.names.selector(SHARD_COMPONENT),
            "ports": [
                {"name": ROUTER_PORT_NAME, "port": spec.router.port, "targetPort": ROUTER_PORT_NAME,
                 "protocol": "TCP"}
            ],
        },
    }


def proxy_config(spec: RolloutPoolSpec, ref: PoolRef, cluster_domain: str = "cluster.local") -> str:
    names = ref.names
    servers = [ShardServer(names.shard_dns(i, cluster_domain), spec.router.port) for i in range(spec.router.shards)]
    return haproxy_config(servers, bind_address=PROXY_LISTEN_ADDRESS, bind_port=spec.router.port, dns=True)


def build_proxy_config_map(ref: PoolRef, config_text: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(ref, ref.names.router_proxy, PROXY_COMPONENT),
        "data": {PROXY_CONFIG_KEY: config_text},
    }


def build_proxy_deployment(spec: RolloutPoolSpec, ref: PoolRef, config_text: str) -> dict[str, Any]:
    """HAProxy (the official image) in front of the shards; the pool's router Service points here."""
    r = spec.router
    names = ref.names
    timeout = probe_timeout(r)
    container: dict[str, Any] = {
        "name": "haproxy",
        "image": r.proxy_image,
        "imagePullPolicy": r.image_pull_policy,
        "args": ["haproxy", "-f", f"{PROXY_CONFIG_DIR}/{PROXY_CONFIG_KEY}"],
        "ports": [{"name": ROUTER_PORT_NAME, "containerPort": r.port, "protocol": "TCP"}],
        # Ready once a shard answers through it; alive while it accepts connections at all.
        "readinessProbe": _http_probe(
            HEALTH_PATH, ROUTER_PORT_NAME, ROUTER_READINESS_PERIOD_S, ROUTER_READINESS_FAILURES, timeout
        ),
        "livenessProbe": {
            "tcpSocket": {"port": ROUTER_PORT_NAME},
            "periodSeconds": ROUTER_LIVENESS_PERIOD_S,
            "failureThreshold": ROUTER_LIVENESS_FAILURES,
            "timeoutSeconds": timeout,
        },
        "securityContext": _container_security(read_only_root=True),
        "resources": {"limits": dict(PROXY_DEFAULT_LIMITS)},
        "volumeMounts": [{"name": "config", "mountPath": PROXY_CONFIG_DIR, "readOnly": True}],
    }
    digest = hashlib.sha256(config_text.encode()).hexdigest()[:16]
    template_meta = _template_metadata(r, ref, PROXY_COMPONENT)
    template_meta["annotations"] = {**template_meta.get("annotations", {}), PROXY_CONFIG_HASH_ANNOTATION: digest}
    pod_spec: dict[str, Any] = {
        **_pod_fields(r, ref, PROXY_COMPONENT),
        "securityContext": {
            "runAsNonRoot": True, "runAsUser": PROXY_UID, "runAsGroup": PROXY_UID, "fsGroup": PROXY_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": [{"name": "config", "configMap": {"name": names.router_proxy}}],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(ref, names.router_proxy, PROXY_COMPONENT),
        "spec": {
            "replicas": PROXY_REPLICAS,
            "selector": {"matchLabels": names.selector(PROXY_COMPONENT)},
            "template": {"metadata": template_meta, "spec": pod_spec},
        },
    }


def build_router_service(spec: RolloutPoolSpec, ref: PoolRef) -> dict[str, Any]:
    """The pool's address: the router, or with shards the proxy in front of them."""
    target = PROXY_COMPONENT if spec.router.shards > 1 else ROUTER_COMPONENT
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(ref, ref.names.router, ROUTER_COMPONENT),
        "spec": {
            "type": "ClusterIP",
            "selector": ref.names.selector(target),
            "ports": [
                {"name": ROUTER_PORT_NAME, "port": spec.router.port, "targetPort": ROUTER_PORT_NAME,
                 "protocol": "TCP"}
            ],
        },
    }


# ---- the last check: what the apply step will write must fit -----------------------------


def size_problem(obj: dict[str, Any]) -> str | None:
    """Why ``obj`` with its last-applied record would be refused for its annotations' size, or None."""
    annotations = with_last_applied(obj)["metadata"]["annotations"]
    size = kv.annotations_size(annotations)
    if size <= kv.TOTAL_ANNOTATION_BYTES:
        return None
    record = len(json.dumps(obj, separators=(",", ":")))
    return (
        f"{obj['kind']} {obj['metadata']['name']} would carry {size} bytes of annotations, above Kubernetes' "
        f"{kv.TOTAL_ANNOTATION_BYTES} (its last-applied record alone is about {record}); shorten "
        "spec.engines.extraArgs, spec.engines.env or the pod annotations"
    )


def render(spec: RolloutPoolSpec, ref: PoolRef, token: str, cluster_domain: str = "cluster.local") -> Desired:
    """Everything the pool owns, or an exception: nothing is applied from a partial render."""
    config = build_router_config(spec, ref, cluster_domain)
    creates_engines = spec.engines.external is None
    sharded = spec.router.shards > 1
    proxy_text = proxy_config(spec, ref, cluster_domain) if sharded else ""
    desired = Desired(
        secret=build_secret(ref, token),
        config_map=build_config_map(ref, config),
        engine_service=build_engine_service(spec, ref) if creates_engines else None,
        router_service=build_router_service(spec, ref),
        engine_deployment=build_engine_deployment(spec, ref) if creates_engines else None,
        router_deployment=build_router_deployment(spec, ref),
        router_config=config,
        engine_disruption_budget=build_engine_disruption_budget(spec, ref) if creates_engines else None,
        shard_service=build_shard_service(spec, ref) if sharded else None,
        router_statefulset=build_router_statefulset(spec, ref) if sharded else None,
        proxy_config_map=build_proxy_config_map(ref, proxy_text) if sharded else None,
        proxy_deployment=build_proxy_deployment(spec, ref, proxy_text) if sharded else None,
    )
    problems = [p for obj in desired.objects() if (p := size_problem(obj))]
    if problems:
        raise ValueError("; ".join(problems))
    return desired
