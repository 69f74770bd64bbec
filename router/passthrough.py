"""Control-app handlers that talk to any engine, without admission: ``/v1/models``, ``/tokenize``;
and ``POST /v1/sessions/{id}/end``. Served by aiohttp behind the data plane (``service.py``);
the generation endpoints are the data plane's own (``proxy.py``).

A pass-through call goes to the healthy engines in turn until one answers, with the upstream
session of the control plane (``RouterState.session``): rare calls, so aiohttp's client is fine.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from .errors import BodyTooLarge, InvalidRequest, NotFound, UpstreamUnavailable
from .state import STATE

ENGINE_HEADER = "X-Misat-Engine"
"""Response header naming the engine that served the request."""
GENERATION_PREFIX = "/v1/"
"""Engine paths that generate: never reachable through the admin pass-through."""

HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE",
        "Trailer", "Transfer-Encoding", "Upgrade", "Content-Length", "Host",
    )
)
"""Headers that describe one connection, never forwarded in either direction."""

CONNECT_FAILURES = (
    aiohttp.ClientConnectorError,
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientOSError,
    aiohttp.ConnectionTimeoutError,
    aiohttp.ClientPayloadError,
)
"""aiohttp errors that mean the engine is unreachable or its connection broke: the call goes to the
next engine, and this one leaves rotation (a connect timeout counts as a failed health check)."""

READ_FAILURES = (aiohttp.ClientError, TimeoutError)

_NOT_FORWARDED = HOP_BY_HOP | {"accept-encoding"}
"""Request headers not passed upstream (``Accept-Encoding`` is set to identity)."""


def forward_headers(headers: Mapping[str, str]) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in headers.items():
        if k.lower() not in _NOT_FORWARDED:
            out.add(k, v)
    out["Accept-Encoding"] = "identity"
    return out


def response_headers(headers: Mapping[str, str], engine_id: str) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in headers.items():
        if k.lower() not in HOP_BY_HOP:
            out.add(k, v)
    out[ENGINE_HEADER] = engine_id
    return out


_BODY = web.RequestKey("misat_body", bytes)
"""Where ``read_body`` keeps the body on the request, so a second reader gets it too."""


async def read_body(request: web.Request, limit: int) -> bytes:
    """The request body, refused (``BodyTooLarge``) past ``limit`` bytes without reading it all;
    read once per request (a later call answers from the request)."""
    if _BODY in request:
        return request[_BODY]
    request[_BODY] = body = await _read_body(request, limit)
    return body


async def _read_body(request: web.Request, limit: int) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLarge(f"request body is larger than {limit} bytes")
    buf = bytearray()
    try:
        while chunk := await request.content.readany():
            buf += chunk
            if len(buf) > limit:
                raise BodyTooLarge(f"request body is larger than {limit} bytes")
    except web.RequestPayloadError as exc:  # broken chunked framing, bad Content-Encoding
        raise InvalidRequest(f"request body could not be read: {exc}") from None
    return bytes(buf)


_pass_cursor = itertools.count()


async def _pass_through(request: web.Request, path: str) -> web.Response:
    """Send to healthy engines in turn until one answers; no admission, no accounting."""
    s = request.app[STATE]
    body = await read_body(request, s.config.max_body_bytes) if request.can_read_body else None
    healthy = [e for e, snap in sorted(s.registry.snapshots().items()) if snap.healthy]
    if not healthy:
        raise UpstreamUnavailable("no healthy engine", code="no_healthy_engine")
    start = next(_pass_cursor)
    timeout = aiohttp.ClientTimeout(
        total=None,
        connect=s.config.upstream_connect_timeout_s,
        sock_read=s.config.upstream_timeout_s,
    )
    tries = min(len(healthy), s.config.max_placement_attempts)
    for i in range(tries):
        engine = healthy[(start + i) % len(healthy)]
        try:
            async with s.session().request(
                request.method, engine + path, data=body,
                headers=forward_headers(request.headers), timeout=timeout,
            ) as upstream:
                payload = await upstream.read()
                return web.Response(
                    status=upstream.status, body=payload,
                    headers=response_headers(upstream.headers, engine),
                )
        except CONNECT_FAILURES as exc:
            s.metrics.engine_failures.labels(engine).inc()
            error = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, aiohttp.ConnectionTimeoutError):  # slow to accept, maybe not gone (proxy.py)
                s.registry.count_failure(engine, error, down_after=s.config.unhealthy_after_failures)
            else:
                s.registry.mark_failed(engine, error)
        except READ_FAILURES as exc:  # the engine took the call and went silent
            raise UpstreamUnavailable(
                f"engine did not answer {path}: {type(exc).__name__}", code="upstream_timeout"
            ) from exc
    raise UpstreamUnavailable(f"no engine answered {path}", code="upstream_unavailable")


async def handle_models(request: web.Request) -> web.Response:
    return await _pass_through(request, "/v1/models")


async def handle_tokenize(request: web.Request) -> web.Response:
    return await _pass_through(request, "/tokenize")


async def handle_session_end(request: web.Request) -> web.Response:
    session_id = request.match_info["session_id"]
    s = request.app[STATE]
    if not s.dispatcher.end_session(session_id):
        raise NotFound(f"no live session {session_id!r}", param="session_id", code="unknown_session")
    return web.json_response({"id": session_id, "ended": True})


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/models", handle_models)
    app.router.add_post("/tokenize", handle_tokenize)
    app.router.add_post("/v1/sessions/{session_id}/end", handle_session_end)


