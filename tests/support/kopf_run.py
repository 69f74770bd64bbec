"""The real operator (kopf + ``misat_operator.handlers``) against kmock's emulated API server,
and small readers of the emulator's state; shared by the operator's kmock tests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import kopf

from misat_operator.handlers import Runtime, register
from misat_operator.settings import OperatorSettings

NS = "rl"
STOP_GRACE_S = 0.5


@contextlib.asynccontextmanager
async def running_operator(
    registry: kopf.OperatorRegistry, api_url: str, router_url: str, **overrides: Any
) -> AsyncIterator[Runtime]:
    @kopf.on.login(registry=registry)
    def _login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=api_url, insecure=True)

    settings = OperatorSettings(**({
        "status_interval_s": 0.2, "router_url": router_url, "kube_server": api_url, "post_events": True,
        "liveness_endpoint": None, "router_timeout_s": 1.0,
    } | overrides))
    rt = register(registry, settings)
    stop: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        kopf.operator(registry=registry, clusterwide=True, standalone=True, stop_flag=stop)
    )
    try:
        yield rt
    finally:
        stop.set_result(None)
        # kopf gives every task spawned after its start 5 s to end on its own (the test's servers'
        # connection tasks among them); past a short grace, cancel it, as SIGTERM twice would.
        done, _ = await asyncio.wait({task}, timeout=STOP_GRACE_S)
        if not done:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def emulated(k8s: Any, resource: str, name: str) -> dict[str, Any] | None:
    """The emulator's copy of an object of namespace ``NS`` (None when absent or deleted)."""
    try:
        obj = k8s.objects[resource, NS, name]
    except KeyError:
        return None
    return None if obj.deleted else dict(obj.raw)


def condition(pool: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    """A pool's condition of ``type_`` ({} when it has none)."""
    for c in ((pool or {}).get("status") or {}).get("conditions") or ():
        if c["type"] == type_:
            return dict(c)
    return {}


async def api_call(session: aiohttp.ClientSession, method: str, url: str, body: Any, ctype: str) -> dict[str, Any]:
    async with session.request(method, url, json=body, headers={"Content-Type": ctype}) as resp:
        payload = await resp.json()
        assert resp.status < 300, payload
        return dict(payload)
