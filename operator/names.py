"""Every per-pool key in one place: object names, labels, selectors, DNS names, URLs.

Two places building the same name differently is how operators leak objects
or talk to the wrong Service, so render, handlers and tests all ask this
module. Names are derived from the pool name only (never from the spec), so a
spec change can never orphan a child object.
"""

from __future__ import annotations

from dataclasses import dataclass

GROUP = "misat.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "RolloutPool"
PLURAL = "rolloutpools"
SINGULAR = "rolloutpool"
SHORT_NAMES = ("rp",)

MANAGER = "misat-operator"
POOL_LABEL = f"{GROUP}/pool"
COMPONENT_LABEL = "app.kubernetes.io/component"

ENGINE_PORT_NAME = "http"
ROUTER_PORT_NAME = "http"
CONFIG_KEY = "router.yaml"
TOKEN_KEY = "token"
CONFIG_DIR = "/etc/misat/config"
ADMIN_DIR = "/etc/misat/admin"

RESERVED_LABEL_KEYS = (
    "app.kubernetes.io/name", "app.kubernetes.io/instance", COMPONENT_LABEL, "app.kubernetes.io/managed-by",
    POOL_LABEL,
)
"""Labels the operator sets on every child and pod; selectors depend on them, so a pool cannot."""

MAX_POOL_NAME = 40
"""Longest pool name: the longest suffix ('-router-config', 14) keeps child names within 63
characters, and Service names (DNS labels) within 63 too."""


def service_dns(name: str, namespace: str, cluster_domain: str = "cluster.local") -> str:
    return f"{name}.{namespace}.svc.{cluster_domain}"


@dataclass(frozen=True, slots=True)
class PoolNames:
    """Names and labels of everything one RolloutPool owns."""

    pool: str
    namespace: str

    @property
    def engines(self) -> str:
        """Engine Deployment and its headless Service (same name, as StatefulSets do)."""
        return f"{self.pool}-engines"

    @property
    def router(self) -> str:
        """Router Deployment and Service."""
        return f"{self.pool}-router"

    @property
    def router_shards(self) -> str:
        """Headless Service of the router shards' StatefulSet (``{pool}-router``): one DNS name per pod."""
        return f"{self.pool}-router-shards"

    @property
    def router_proxy(self) -> str:
        """The shard proxy (HAProxy): its ConfigMap and Deployment."""
        return f"{self.pool}-router-proxy"

    def shard_pod(self, shard: int) -> str:
        """A shard's pod name (StatefulSet ordinal)."""
        return f"{self.router}-{shard}"

    def shard_dns(self, shard: int, cluster_domain: str = "cluster.local") -> str:
        return f"{self.shard_pod(shard)}.{self.router_shards}.{self.namespace}.svc.{cluster_domain}"

    def shard_url(self, shard: int, port: int, cluster_domain: str = "cluster.local") -> str:
        """In-cluster base URL of one router shard (peers, the proxy and the operator call it)."""
        return f"http://{self.shard_dns(shard, cluster_domain)}:{port}"

    @property
    def router_config(self) -> str:
        return f"{self.pool}-router-config"

    @property
    def admin_secret(self) -> str:
        return f"{self.pool}-router-admin"

    def children(self) -> list[tuple[str, str]]:
        """(kind, name) of every child a pool may own; the pool name must fit each kind's rules."""
        return [
            ("Secret", self.admin_secret), ("ConfigMap", self.router_config),
            ("Service", self.engines), ("Service", self.router),
            ("Deployment", self.engines), ("Deployment", self.router),
            ("PodDisruptionBudget", self.engines),
            ("StatefulSet", self.router), ("Service", self.router_shards),
            ("ConfigMap", self.router_proxy), ("Deployment", self.router_proxy),
        ]

    def engines_dns(self, cluster_domain: str = "cluster.local") -> str:
        """DNS name of the headless engine Service: one A record per ready engine pod."""
        return service_dns(self.engines, self.namespace, cluster_domain)

    def router_url(self, port: int, cluster_domain: str = "cluster.local") -> str:
        """In-cluster base URL of the router Service (the operator's hot-reload target)."""
        return f"http://{self.router}.{self.namespace}.svc.{cluster_domain}:{port}"

    def labels(self, component: str) -> dict[str, str]:
        """Labels on every child object and pod of ``component`` ('engine' or 'router')."""
        return {
            "app.kubernetes.io/name": "misa-t",
            "app.kubernetes.io/instance": self.pool,
            COMPONENT_LABEL: component,
            "app.kubernetes.io/managed-by": MANAGER,
            POOL_LABEL: self.pool,
        }

    def selector(self, component: str) -> dict[str, str]:
        """Pod selector: the two labels that never change (Deployment selectors are immutable)."""
        return {POOL_LABEL: self.pool, COMPONENT_LABEL: component}

    def selector_string(self, component: str) -> str:
        """The selector as a label-selector string (for the scale subresource, HPA)."""
        return ",".join(f"{k}={v}" for k, v in sorted(self.selector(component).items()))
