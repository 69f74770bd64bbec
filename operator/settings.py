"""Operator settings: typed, frozen, read once at start-up from the environment.

Every value has a default with its reason; ``from_env`` names the variable in
the error when a value is invalid. Settings are passed explicitly to
``handlers.register`` (no module-level singleton), so tests build their own.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError

ENV_PREFIX = "MISAT_OPERATOR_"


class OperatorSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    status_interval_s: float = Field(
        10.0, gt=0.0,
        description="Seconds between status timer ticks per pool (reads the router's /status and the "
        "Deployments). 10 s keeps `kubectl get rp` fresh at a few requests a minute per pool.",
    )
    router_url: str | None = Field(
        None,
        description="Template of a pool's router base URL with {name}, {namespace}, {port}; default: "
        "the router Service's in-cluster DNS name. Tests and out-of-cluster runs override it.",
    )
    shard_url: str | None = Field(
        None,
        description="Template of one router shard's base URL with {name}, {namespace}, {port}, {shard} "
        "(pools with router.shards > 1); default: the shard pod's DNS name under the headless Service.",
    )
    cluster_domain: str = Field("cluster.local", min_length=1, description="Cluster DNS suffix.")
    router_timeout_s: float = Field(
        3.0, gt=0.0, description="Timeout of one call to a router (push or /status)."
    )
    kube_server: str | None = Field(
        None,
        description="Kubernetes API URL for the operator's own client (no auth); default: in-cluster "
        "service account, else the current kubeconfig context.",
    )
    post_events: bool = Field(
        True, description="Post a Kubernetes Event on the pool for each condition transition (and kopf's own)."
    )
    retry_delay_s: float = Field(
        5.0, gt=0.0,
        description="Delay before a pass that failed on a race or an unreachable API server runs again "
        "(conflicts, timeouts, 5xx: they usually clear within seconds).",
    )
    stalled_backoff_initial_s: float = Field(
        30.0, gt=0.0,
        description="First wait before a generation whose child the API server refused is tried again; "
        "doubled after each refusal. A new generation is tried at once. Quota, RBAC and admission "
        "webhooks can change without a spec change, so a refused generation is retried, slowly.",
    )
    stalled_backoff_max_s: float = Field(
        600.0, gt=0.0, description="Longest wait between tries of a refused generation (the doubling stops here)."
    )
    drain_timeout_s: float = Field(
        600.0, ge=0.0,
        description="Longest a scale-down waits for the live sessions on the departing engines to finish "
        "before the Deployment shrinks anyway (the status and an Event say how many were cut). "
        "10 minutes covers a multi-turn agentic session between turns; 0 shrinks at once.",
    )
    liveness_endpoint: str | None = Field(
        "http://0.0.0.0:8080/healthz", description="kopf's liveness endpoint (an empty string turns it off)."
    )

    def router_base_url(self, name: str, namespace: str, port: int) -> str:
        if self.router_url:
            return self.router_url.format(name=name, namespace=namespace, port=port).rstrip("/")
        from .names import PoolNames

        return PoolNames(name, namespace).router_url(port, self.cluster_domain)

    def shard_base_url(self, name: str, namespace: str, port: int, shard: int) -> str:
        if self.shard_url:
            return self.shard_url.format(name=name, namespace=namespace, port=port, shard=shard).rstrip("/")
        from .names import PoolNames

        return PoolNames(name, namespace).shard_url(shard, port, self.cluster_domain)


class SettingsError(ValueError):
    """An environment variable holds an invalid value (message names it)."""


def from_env(env: Mapping[str, str] | None = None) -> OperatorSettings:
    """Settings from ``MISAT_OPERATOR_<FIELD>`` variables (e.g. MISAT_OPERATOR_STATUS_INTERVAL_S)."""
    source = os.environ if env is None else env
    raw = {
        name: source[ENV_PREFIX + name.upper()]
        for name in OperatorSettings.model_fields
        if ENV_PREFIX + name.upper() in source
    }
    try:
        return OperatorSettings.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{ENV_PREFIX}{str(e['loc'][0]).upper()}: {e['msg']}" for e in exc.errors()
        )
        raise SettingsError(problems) from None
