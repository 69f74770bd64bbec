"""The edge: domain errors (``errors.py``) become HTTP answers here and nowhere else.

Every refusal has the OpenAI error shape (``{"error": {"message", "type",
"param", "code"}}``): the router's own ``RouterError`` subclasses by the
status table below, aiohttp's own refusals (unknown path, wrong method) with
their status, and anything unforeseen as a 500 ``internal_error`` (logged
with its traceback, never shown to the client).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from .errors import (
    AdminDisabled,
    BodyTooLarge,
    ConfigRejected,
    HoldDeadlineExceeded,
    InvalidRequest,
    NotFound,
    RouterError,
    ShuttingDown,
    StaleConfig,
    Unauthorized,
    UpstreamUnavailable,
    error_body,
    openai_error_body,
)

log = logging.getLogger(__name__)

_HTTP_STATUS: dict[type[RouterError], int] = {
    BodyTooLarge: 413,
    ConfigRejected: 400,
    InvalidRequest: 400,
    NotFound: 404,
    Unauthorized: 401,
    AdminDisabled: 403,
    StaleConfig: 409,
    UpstreamUnavailable: 502,
    HoldDeadlineExceeded: 503,
    ShuttingDown: 503,
}
INTERNAL_ERROR_STATUS = 500


def http_status(exc: RouterError) -> int:
    for cls in type(exc).__mro__:
        if cls in _HTTP_STATUS:
            return _HTTP_STATUS[cls]
    return INTERNAL_ERROR_STATUS


def error_headers(exc: RouterError) -> dict[str, str]:
    """Headers an error answer carries besides its body (``Retry-After``, ``WWW-Authenticate``)."""
    headers = {}
    if isinstance(exc, HoldDeadlineExceeded):
        headers["Retry-After"] = str(exc.retry_after_s)
    if isinstance(exc, Unauthorized):
        headers["WWW-Authenticate"] = "Bearer"
    return headers


def error_answer(exc: RouterError) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """The whole answer to a domain error as the data plane sends it: (status, headers, JSON body)."""
    headers = [(b"Content-Type", b"application/json")]
    headers += [(k.encode(), v.encode()) for k, v in error_headers(exc).items()]
    return http_status(exc), headers, json.dumps(error_body(exc)).encode()


def http_error_body(status: int, message: str, code: str) -> bytes:
    """An error body for a refusal at the HTTP level (malformed request, limits), OpenAI-shaped."""
    return json.dumps(openai_error_body(message, _HTTP_ERROR_TYPES.get(status, "invalid_request_error"),
                                        code=code)).encode()


def error_response(exc: RouterError) -> web.Response:
    return web.json_response(error_body(exc), status=http_status(exc), headers=error_headers(exc))


def error_middleware(on_invalid: Callable[[], None]) -> Middleware:
    """The edge's one mapping of failures to OpenAI-style error answers.

    ``on_invalid`` is called once per refused malformed request (the router
    counts them in ``misat_invalid_requests_total``).
    """

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        return await _answer_errors(request, handler, on_invalid)

    return middleware


async def _answer_errors(
    request: web.Request, handler: Handler, on_invalid: Callable[[], None]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except RouterError as exc:
        if isinstance(exc, InvalidRequest):
            on_invalid()
        return error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        # aiohttp's own refusals (unknown path, wrong method) in the same OpenAI shape.
        body = openai_error_body(
            exc.reason, _HTTP_ERROR_TYPES.get(exc.status, "invalid_request_error"),
            code=exc.reason.lower().replace(" ", "_"),
        )
        headers = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
        return web.json_response(body, status=exc.status, headers=headers)
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        body = openai_error_body("internal router error", "server_error", code="internal_error")
        return web.json_response(body, status=INTERNAL_ERROR_STATUS)


_HTTP_ERROR_TYPES = {404: "not_found_error", 405: "invalid_request_error", 500: "server_error",
                     501: "invalid_request_error"}
"""OpenAI ``error.type`` of HTTP-level refusals, aiohttp's or the data plane's (others: ``invalid_request_error``)."""
