"""The router's admin API from the trainer's side: pause, resume, engine control, weight updates.

Every call carries ``Authorization: Bearer <token>`` (the router's ``--admin-token-file``) and
answers a typed model (``admin_models.py``); an error status raises ``RouterHTTPError`` with
the router's OpenAI-style error fields.

The weight-update sequence (``update_weights``), for a trainer that owns the pool:

1. ``pause(mode)``: new work is held; ``abort`` also ends the requests in flight (they answer
   ``finish_reason: "abort"`` with their partial output), ``wait`` lets them finish, ``keep``
   freezes them on their engines;
2. wait until the router reports no request in flight (bounded; not after ``keep``, whose
   frozen requests stay in flight);
3. each framework call (e.g. ``/areal_update_weights``) passed through to every engine
   (``POST /admin/engines/call``); if any engine refuses, the router stays paused and
   ``WeightUpdateFailed`` says which (no rollout runs on a pool of mixed weights);
4. ``resume(reset_prefix_cache=True, weight_version=v)``: KV computed with the old weights is
   dropped (after ``keep``, the frozen requests' too: they recompute it under the new weights),
   the version is recorded for every engine, held work is released.

``AdminClient`` is async (aiohttp), ``SyncAdminClient`` sync (standard library); both build
their requests with the same functions below.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel

from .admin_models import (
    EngineFanOut,
    EngineOp,
    PauseMode,
    PauseResult,
    ResumeResult,
    RouterStatusView,
    WeightUpdateResult,
)
from .errors import MisatClientError
from .transport import Answer, AsyncTransport, HttpCall, SyncTransport, query_flag

if TYPE_CHECKING:
    import aiohttp

M = TypeVar("M", bound=BaseModel)

ADMIN_TIMEOUT_S = 120.0
"""Longest wait for one admin answer: an abort, a fan-out or a weight load on every engine."""
IDLE_TIMEOUT_S = 300.0
"""Longest wait, after a pause, for the requests in flight to reach zero (the router's default
``hold_deadline_s``: a ``wait`` pause lets the longest generations finish)."""
IDLE_POLL_S = 0.1
"""Interval of ``/status`` reads while waiting for zero in flight."""


class WeightUpdateFailed(MisatClientError):
    """An engine refused a weight-update call; the router was left paused."""

    def __init__(self, call: EngineCall, result: EngineFanOut) -> None:
        self.call = call
        self.result = result
        failed = ", ".join(f"{e}: {r.error or r.status}" for e, r in result.failed().items()) or "no engine"
        super().__init__(f"{call.method} {call.path} failed on {failed}; the router stays paused")


class PoolNotIdle(MisatClientError):
    """Requests still in flight after the pause, past the wait's bound."""


@dataclass(frozen=True, slots=True)
class EngineCall:
    """A control call to pass through to every engine (``POST /admin/engines/call``)."""

    path: str
    body: Any = None
    method: str = "POST"
    query: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # The router refuses these too (400); failing here names the caller's mistake sooner.
        if not self.path.startswith("/"):
            raise ValueError(f"path must start with '/', got {self.path!r}")
        if self.path.startswith("/v1/"):
            raise ValueError(f"path {self.path!r} is a generation path, not a control call")


# ---- the requests, built once for both clients ----------------------------------------


def pause_call(mode: PauseMode | str = PauseMode.WAIT, reset_prefix_cache: bool | None = None) -> HttpCall:
    query = {"mode": PauseMode(mode).value}
    if reset_prefix_cache is not None:
        query["reset_prefix_cache"] = query_flag(reset_prefix_cache)
    return HttpCall("POST", "/admin/pause", query=query)


def resume_call(reset_prefix_cache: bool = False, weight_version: str | None = None) -> HttpCall:
    query = {"reset_prefix_cache": query_flag(reset_prefix_cache)}
    if weight_version is not None:
        query["weight_version"] = weight_version
    return HttpCall("POST", "/admin/resume", query=query)


def engines_call(op: EngineOp | str, query: Mapping[str, str] | None = None) -> HttpCall:
    return HttpCall("POST", f"/admin/engines/{EngineOp(op).value}", query=dict(query or {}))


def engine_call_call(call: EngineCall, weight_version: str | None = None) -> HttpCall:
    body: dict[str, Any] = {"method": call.method, "path": call.path, "body": call.body, "query": dict(call.query)}
    if weight_version is not None:
        body["weight_version"] = weight_version
    return HttpCall("POST", "/admin/engines/call", json=body)


def status_call() -> HttpCall:
    return HttpCall("GET", "/status")


def _parse(model: type[M], answer: Answer) -> M:
    return model.model_validate(answer.raise_for_status().json())


def _authorised(call: HttpCall, token: str) -> HttpCall:
    return HttpCall(call.method, call.path, call.query, call.json, {**call.headers, "Authorization": f"Bearer {token}"})


# ---- async ------------------------------------------------------------------------------


class AdminClient:
    """The admin API, async. ``base_url`` is the router; ``token`` its admin token."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        http: aiohttp.ClientSession | None = None,
        timeout_s: float = ADMIN_TIMEOUT_S,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._transport = AsyncTransport(base_url, http=http, timeout_s=timeout_s)
        self._token = token
        self._sleep = sleep

    async def _send(self, call: HttpCall) -> Answer:
        return await self._transport.send(_authorised(call, self._token))

    async def pause(
        self, mode: PauseMode | str = PauseMode.WAIT, *, reset_prefix_cache: bool | None = None
    ) -> PauseResult:
        """Hold new work; ``abort`` also ends the requests in flight with their partial output.
        ``reset_prefix_cache`` None: the router's ``pause_resets_prefix_cache``."""
        return _parse(PauseResult, await self._send(pause_call(mode, reset_prefix_cache)))

    async def resume(self, *, reset_prefix_cache: bool = False, weight_version: str | None = None) -> ResumeResult:
        """Release held work, after resetting every engine's prefix cache if asked and recording
        ``weight_version`` for every engine if given."""
        return _parse(ResumeResult, await self._send(resume_call(reset_prefix_cache, weight_version)))

    async def engines(self, op: EngineOp | str, query: Mapping[str, str] | None = None) -> EngineFanOut:
        """vLLM's ``/sleep`` (``query={"level": "1"}``), ``/wake_up`` or ``/reset_prefix_cache``
        on every engine; per-engine results."""
        return _parse(EngineFanOut, await self._send(engines_call(op, query)))

    async def engine_call(self, call: EngineCall, *, weight_version: str | None = None) -> EngineFanOut:
        """Pass ``call`` through to every engine; ``weight_version`` is recorded for the engines
        that answer 2xx."""
        return _parse(EngineFanOut, await self._send(engine_call_call(call, weight_version)))

    async def status(self) -> RouterStatusView:
        """``GET /status`` (no token needed; sent anyway)."""
        return _parse(RouterStatusView, await self._send(status_call()))

    async def wait_idle(self, timeout_s: float = IDLE_TIMEOUT_S, poll_s: float = IDLE_POLL_S) -> RouterStatusView:
        """Read ``/status`` until no request is in flight; ``PoolNotIdle`` past ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            status = await self.status()
            if status.requests_in_flight == 0:
                return status
            if time.monotonic() >= deadline:
                raise PoolNotIdle(f"{status.requests_in_flight} request(s) still in flight after {timeout_s} s")
            await self._sleep(poll_s)

    async def update_weights(
        self,
        calls: Sequence[EngineCall],
        *,
        version: str,
        mode: PauseMode | str = PauseMode.ABORT,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
    ) -> WeightUpdateResult:
        """The weight-update sequence of the module docstring."""
        keep = PauseMode(mode) == PauseMode.KEEP
        # A keep pause cannot reset caches (the router refuses it); the resume below resets them.
        paused = await self.pause(mode, reset_prefix_cache=False if keep else None)
        if paused.requests_in_flight and not keep:
            await self.wait_idle(idle_timeout_s)
        results = []
        for call in calls:
            result = await self.engine_call(call, weight_version=version)
            if not result.ok:
                raise WeightUpdateFailed(call, result)
            results.append(result)
        resumed = await self.resume(reset_prefix_cache=True, weight_version=version)
        return WeightUpdateResult(pause=paused, calls=results, resume=resumed)

    async def close(self) -> None:
        await self._transport.close()

    async def __aenter__(self) -> AdminClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


# ---- sync -------------------------------------------------------------------------------


class SyncAdminClient:
    """The admin API, sync (standard library); the methods of ``AdminClient``."""

    def __init__(
        self, base_url: str, token: str, *, timeout_s: float = ADMIN_TIMEOUT_S,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._transport = SyncTransport(base_url, timeout_s=timeout_s)
        self._token = token
        self._sleep = sleep

    def _send(self, call: HttpCall) -> Answer:
        return self._transport.send(_authorised(call, self._token))

    def pause(self, mode: PauseMode | str = PauseMode.WAIT, *, reset_prefix_cache: bool | None = None) -> PauseResult:
        return _parse(PauseResult, self._send(pause_call(mode, reset_prefix_cache)))

    def resume(self, *, reset_prefix_cache: bool = False, weight_version: str | None = None) -> ResumeResult:
        return _parse(ResumeResult, self._send(resume_call(reset_prefix_cache, weight_version)))

    def engines(self, op: EngineOp | str, query: Mapping[str, str] | None = None) -> EngineFanOut:
        return _parse(EngineFanOut, self._send(engines_call(op, query)))

    def engine_call(self, call: EngineCall, *, weight_version: str | None = None) -> EngineFanOut:
        return _parse(EngineFanOut, self._send(engine_call_call(call, weight_version)))

    def status(self) -> RouterStatusView:
        return _parse(RouterStatusView, self._send(status_call()))

    def wait_idle(self, timeout_s: float = IDLE_TIMEOUT_S, poll_s: float = IDLE_POLL_S) -> RouterStatusView:
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.status()
            if status.requests_in_flight == 0:
                return status
            if time.monotonic() >= deadline:
                raise PoolNotIdle(f"{status.requests_in_flight} request(s) still in flight after {timeout_s} s")
            self._sleep(poll_s)

    def update_weights(
        self, calls: Sequence[EngineCall], *, version: str, mode: PauseMode | str = PauseMode.ABORT,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
    ) -> WeightUpdateResult:
        keep = PauseMode(mode) == PauseMode.KEEP
        paused = self.pause(mode, reset_prefix_cache=False if keep else None)
        if paused.requests_in_flight and not keep:
            self.wait_idle(idle_timeout_s)
        results = []
        for call in calls:
            result = self.engine_call(call, weight_version=version)
            if not result.ok:
                raise WeightUpdateFailed(call, result)
            results.append(result)
        resumed = self.resume(reset_prefix_cache=True, weight_version=version)
        return WeightUpdateResult(pause=paused, calls=results, resume=resumed)

    def close(self) -> None:
        self._transport.close()

    def __enter__(self) -> SyncAdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
