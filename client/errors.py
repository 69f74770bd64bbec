"""What can go wrong between a rollout worker and the router, as exceptions.

The router answers every refusal with the OpenAI error shape
``{"error": {"message", "type", "param", "code"}}`` (``docs/router.md``, "Errors");
``RouterHTTPError`` keeps those fields, so a caller can branch on ``code``.
"""

from __future__ import annotations

import json
from typing import Any


class MisatClientError(Exception):
    """Base class of this package's errors."""


class RouterHTTPError(MisatClientError):
    """The router (or an engine behind it) answered with an error status."""

    def __init__(self, status: int, body: bytes, *, url: str) -> None:
        self.status = status
        self.url = url
        self.raw = body
        error = _error_object(body)
        self.message: str = str(error.get("message") or body[:200].decode("utf-8", "replace"))
        self.type: str | None = _opt_str(error.get("type"))
        self.code: str | None = _opt_str(error.get("code"))
        self.param: str | None = _opt_str(error.get("param"))
        super().__init__(f"{url}: {status} {self.code or self.type or ''}: {self.message}".replace("  ", " "))


class HeldTooLong(RouterHTTPError):
    """A request was held past the router's hold deadline on every attempt the retry policy allowed."""

    def __init__(self, status: int, body: bytes, *, url: str, attempts: int) -> None:
        super().__init__(status, body, url=url)
        self.attempts = attempts
        self.args = (f"{url}: still held after {attempts} attempt(s): {self.message}",)


class RouterUnreachable(MisatClientError):
    """No HTTP answer at all (connection refused, reset, timeout)."""


def _opt_str(value: object) -> str | None:
    return None if value is None else str(value)


def _error_object(body: bytes) -> dict[str, Any]:
    """The ``error`` object of an OpenAI-style (or vLLM-style) error body; {} for anything else."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return {}
    if not isinstance(doc, dict):
        return {}
    error = doc.get("error", doc)
    return error if isinstance(error, dict) else {"message": str(error)}


def error_code(body: bytes) -> str | None:
    """``error.code`` of an error body, None when there is none."""
    return _opt_str(_error_object(body).get("code"))
