"""Domain errors of the router, and the OpenAI-style body every error is sent with.

The classes here say *what* went wrong in the router's own terms; they carry
no HTTP status. ``http_errors`` (the edge: the control app's ``error_middleware``
and the data plane's ``error_answer``) maps each class to a status code in one
table, so handlers and core code raise domain errors and never build HTTP error
responses themselves.
"""

from __future__ import annotations


class RouterError(Exception):
    """Base of the router's domain errors; ``message`` is safe to show the client."""

    error_type = "server_error"
    """The OpenAI ``error.type`` string clients see."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequest(RouterError):
    """The request is malformed: bad JSON, a wrong field type, a missing or unknown class."""

    error_type = "invalid_request_error"


class BodyTooLarge(InvalidRequest):
    """The request body exceeds ``max_body_bytes``."""


class NotFound(RouterError):
    """The named resource (a session) is not known."""

    error_type = "not_found_error"


class HoldDeadlineExceeded(RouterError):
    """A held request was not placed within ``hold_deadline_s``; the client should retry later."""

    error_type = "service_unavailable_error"

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message, code="hold_deadline_exceeded")
        self.retry_after_s = retry_after_s


class NoHealthyEngine(HoldDeadlineExceeded):
    """No engine was healthy for ``no_healthy_engine_wait_s``: the request fails fast, with why."""

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.code = "no_healthy_engine"


class ShuttingDown(RouterError):
    """The router is draining for shutdown and takes no new work."""

    error_type = "service_unavailable_error"


class UpstreamUnavailable(RouterError):
    """Every engine tried for this request failed before answering."""

    error_type = "upstream_error"


class Unauthorized(RouterError):
    """An admin call without a valid bearer token."""

    error_type = "authentication_error"


class AdminDisabled(RouterError):
    """An admin call while no admin token is configured."""

    error_type = "permission_error"


class ConfigRejected(InvalidRequest):
    """A new config is invalid or cannot be applied; the old one stays."""


class StaleConfig(RouterError):
    """A new config carries an older generation than the applied one."""

    error_type = "conflict_error"


def openai_error_body(
    message: str, error_type: str, *, param: str | None = None, code: str | None = None
) -> dict[str, dict[str, str | None]]:
    """The error object OpenAI clients parse: ``{"error": {message, type, param, code}}``."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_body(exc: RouterError) -> dict[str, dict[str, str | None]]:
    return openai_error_body(exc.message, exc.error_type, param=exc.param, code=exc.code)
