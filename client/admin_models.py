"""The router's admin answers as typed models (``docs/router.md``, "Admin API").

Unknown fields are kept (``extra="allow"``), so a newer router's additions reach the caller
instead of failing the parse.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict


class PauseMode(StrEnum):
    """How ``/admin/pause`` treats work in flight."""

    WAIT = "wait"
    """New work is held; requests in flight finish."""
    ABORT = "abort"
    """Also abort every request in flight; each answers with what it generated so far and
    ``finish_reason: "abort"``, so a partial rollout can resume after the update."""
    KEEP = "keep"
    """Freeze every request in flight where it is (vLLM's keep pause on each engine serving
    one); they go on after the resume. All or nothing: the router answers 502
    ``engines_not_frozen`` and pauses nothing when an engine cannot freeze."""


class EngineOp(StrEnum):
    """The engine control operations ``/admin/engines/{op}`` fans out (vLLM's endpoints)."""

    SLEEP = "sleep"
    WAKE_UP = "wake_up"
    RESET_PREFIX_CACHE = "reset_prefix_cache"


class _Answer(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)


class PauseResult(_Answer):
    """The answer of ``POST /admin/pause`` (and the base of resume's)."""

    paused: bool
    mode: str | None = None
    requests_in_flight: int
    held_requests: int
    aborted_requests: int = 0
    frozen_engines: list[str] = []
    """Engines whose requests a keep pause froze (empty otherwise, and after the resume)."""
    prefix_cache_reset: dict[str, str] | None = None
    """Per engine: ``ok``, ``status N`` or ``failed: <error>``; None when no reset was asked."""

    def reset_failures(self) -> dict[str, str]:
        """Engines whose prefix-cache reset did not answer ``ok``."""
        return {e: r for e, r in (self.prefix_cache_reset or {}).items() if r != "ok"}


class ResumeResult(PauseResult):
    """The answer of ``POST /admin/resume``."""

    weight_version: str | None = None


class EngineResult(_Answer):
    """One engine's answer to a fanned-out call: its status and body, or the error that kept
    it from answering."""

    status: int | None = None
    body: Any = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.status is not None and 200 <= self.status < 300


class EngineFanOut(_Answer):
    """The answer of ``POST /admin/engines/{op}`` (with ``op``) and ``POST /admin/engines/call``
    (with the ``method`` and ``path`` passed through): a result per engine."""

    op: str | None = None
    method: str | None = None
    path: str | None = None
    engines: dict[str, EngineResult]

    @property
    def ok(self) -> bool:
        """Every engine answered 2xx (and there was at least one)."""
        return bool(self.engines) and all(r.ok for r in self.engines.values())

    def failed(self) -> dict[str, EngineResult]:
        """Engines that did not answer 2xx."""
        return {e: r for e, r in self.engines.items() if not r.ok}


class EngineStatus(_Answer):
    """An engine row of ``GET /status`` (the fields a trainer reads; the rest are kept)."""

    id: str
    healthy: bool
    in_flight: int = 0
    weight_version: str | None = None


class RouterStatusView(_Answer):
    """``GET /status``, the fields a trainer reads (the rest are kept as extra fields)."""

    generation: int
    model: str
    policy: str
    paused: bool
    pause_mode: str | None = None
    ready: bool
    requests_in_flight: int
    held_requests: int
    engines: list[EngineStatus]

    def weight_versions(self) -> dict[str, str | None]:
        """Engine id -> its weight version (None until known)."""
        return {e.id: e.weight_version for e in self.engines}


class WeightUpdateResult(_Answer):
    """What ``update_weights`` did, step by step."""

    pause: PauseResult
    calls: list[EngineFanOut]
    resume: ResumeResult
