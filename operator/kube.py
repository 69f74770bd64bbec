"""A small async Kubernetes REST client for the child objects (aiohttp, plain dicts).

Why not the ``kubernetes`` package's client: it is synchronous (a thread per
call inside kopf's event loop) and deserialises into typed models, which
refuse objects the operator only needs to compare as dicts. The operator needs
a handful of calls (get, create, merge-patch of its children, a labelled list
of engine pods, Events, the pool's status), so it speaks the REST API
directly. Credentials: in-cluster service account (token re-read on every
request, so projected-token rotation works), or a kubeconfig through the
``kubernetes`` package's loader, or an explicit server URL (tests).
"""

from __future__ import annotations

import json
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp

from .names import API_VERSION, PLURAL

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
TRANSIENT_STATUSES = frozenset({404, 408, 409, 429})
"""4xx answers that are races or load, not refusals: not found (deleted meanwhile), timeout,
conflict (resourceVersion, or created meanwhile), too many requests. Retried soon."""

_PATHS = {
    ("v1", "Secret"): "secrets",
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Service"): "services",
    ("apps/v1", "Deployment"): "deployments",
    ("apps/v1", "StatefulSet"): "statefulsets",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("v1", "Pod"): "pods",
}
"""The child kinds (get/create/patch), and engine pods (list, annotate before a scale-down).
The pool itself is patched on /status, and on its metadata only to drop a retired finalizer."""


class KubeError(Exception):
    """A non-2xx answer; ``status`` is the HTTP status, ``reason`` the API's Status reason."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message

    @property
    def refused(self) -> bool:
        """The API server refused the request itself (invalid, forbidden, too large, ...): sending it
        again unchanged gets the same answer, so the pool is Stalled rather than retried at once."""
        return 400 <= self.status < 500 and self.status not in TRANSIENT_STATUSES


def object_path(api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
    plural = _PATHS[(api_version, kind)]
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{base}/namespaces/{namespace}/{plural}"
    return f"{path}/{name}" if name else path


@dataclass(frozen=True)
class Credentials:
    server: str
    token_file: Path | None = None
    token: str | None = None
    ca_file: str | None = None
    client_cert: tuple[str, str] | None = None
    insecure: bool = False

    def bearer(self) -> str | None:
        if self.token_file is not None:
            return self.token_file.read_text().strip()
        return self.token

    def ssl_context(self) -> ssl.SSLContext | bool:
        if not self.server.startswith("https"):
            return False
        if self.insecure:
            return False
        ctx = ssl.create_default_context(cafile=self.ca_file)
        if self.client_cert is not None:
            ctx.load_cert_chain(*self.client_cert)
        return ctx


def in_cluster() -> Credentials | None:
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
    if not host or not port or not (SA_DIR / "token").exists():
        return None
    host = f"[{host}]" if ":" in host else host
    return Credentials(
        server=f"https://{host}:{port}", token_file=SA_DIR / "token", ca_file=str(SA_DIR / "ca.crt")
    )


def from_kubeconfig() -> Credentials:
    """Read the current kubeconfig context with the ``kubernetes`` package's loader (lazy import:
    that package reads $KUBECONFIG at import time)."""
    from kubernetes import client, config

    cfg = client.Configuration()
    config.load_kube_config(client_configuration=cfg)
    auth = (cfg.api_key or {}).get("authorization") or (cfg.api_key or {}).get("BearerToken")
    token = auth.split(" ", 1)[1] if auth and auth.lower().startswith("bearer ") else auth
    cert = (cfg.cert_file, cfg.key_file) if cfg.cert_file and cfg.key_file else None
    return Credentials(
        server=cfg.host, token=token, ca_file=cfg.ssl_ca_cert, client_cert=cert, insecure=not cfg.verify_ssl
    )


class KubeClient:
    """get/create/patch of namespaced objects as dicts; one pooled aiohttp session."""

    def __init__(self, creds: Credentials, timeout_s: float = 10.0) -> None:
        self._creds = creds
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=self._creds.ssl_context()), timeout=self._timeout
            )
        return self._session

    async def _call(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> dict[str, Any]:
        headers = {"Accept": "application/json"}
        token = self._creds.bearer()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body)
        url = self._creds.server.rstrip("/") + path
        async with self._http().request(method, url, data=data, headers=headers) as resp:
            text = await resp.text()
            payload = json.loads(text) if text else {}
            if resp.status >= 400:
                reason = payload.get("reason", "") if isinstance(payload, dict) else ""
                message = payload.get("message", text) if isinstance(payload, dict) else text
                raise KubeError(resp.status, str(reason), str(message)[:500])
            return payload if isinstance(payload, dict) else {}

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return await self._call("GET", object_path(api_version, kind, namespace, name))
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        return await self._call("POST", object_path(obj["apiVersion"], obj["kind"], meta["namespace"]), obj)

    async def patch(
        self, api_version: str, kind: str, namespace: str, name: str, patch: dict[str, Any]
    ) -> dict[str, Any]:
        path = object_path(api_version, kind, namespace, name)
        return await self._call("PATCH", path, patch, MERGE_PATCH)

    async def list_labelled(
        self, api_version: str, kind: str, namespace: str, labels: dict[str, str]
    ) -> list[dict[str, Any]]:
        """Objects of a kind in a namespace with all of ``labels`` (also filtered here, so a server
        that ignores the selector cannot hand back someone else's objects)."""
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        path = object_path(api_version, kind, namespace) + "?labelSelector=" + quote(selector)
        items = (await self._call("GET", path)).get("items") or []
        return [
            item for item in items
            if isinstance(item, dict)
            and all(((item.get("metadata") or {}).get("labels") or {}).get(k) == v for k, v in labels.items())
        ]

    async def create_event(self, namespace: str, event: dict[str, Any]) -> dict[str, Any]:
        return await self._call("POST", f"/api/v1/namespaces/{namespace}/events", event)

    async def json_patch_pool(self, namespace: str, name: str, ops: list[dict[str, Any]]) -> dict[str, Any]:
        """A JSON patch of a RolloutPool's metadata (with ``test`` ops, so it never races a writer)."""
        path = f"/apis/{API_VERSION}/namespaces/{namespace}/{PLURAL}/{name}"
        return await self._call("PATCH", path, ops, JSON_PATCH)

    async def patch_pool_status(self, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        """Merge-patch a RolloutPool's status subresource (the operator's only write to a pool)."""
        path = f"/apis/{API_VERSION}/namespaces/{namespace}/{PLURAL}/{name}/status"
        return await self._call("PATCH", path, {"status": status}, MERGE_PATCH)
