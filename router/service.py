"""The served router: the data plane on the listening port, the control app behind it.

One port, two halves:

- the **data plane** (``downstream.DataPlaneServer``) owns every client
  connection. It answers ``POST /v1/completions`` and ``POST
  /v1/chat/completions`` itself (``proxy.py``: admission, forwarding over
  ``upstream.py``'s pooled connections, relaying);
- every other request (``/health``, ``/ready``, ``/status``, ``/metrics``,
  ``/admin/*``, ``/v1/models``, ``/tokenize``, ``/v1/sessions/{id}/end``) is
  relayed, unchanged, to the **control app**: the aiohttp application of
  ``app.create_app``, which owns the state, the background loops and the
  admin API. The relay runs over connected socket pairs handed to aiohttp's
  own connection handler: in-process, nothing listening, nothing reachable
  from outside but through the public port.

Why split: the control endpoints are many, rare and want aiohttp's routing,
middlewares and lifecycle; the generation endpoints are two, hot, and were
four fifths of the router's CPU on aiohttp (docs/scale.md).

``RouterService.stop`` drains as the router always has: no new connections,
held requests answered 503, in-flight ones given ``drain_timeout_s``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import Any

from aiohttp import web

from .downstream import DEFAULT_LIMITS, DataPlaneServer, IncomingRequest, Responder, ServerLimits
from .http1 import HOP_BY_HOP, NOT_RELAYED_IN_ANSWERS
from .http_errors import http_error_body
from .proxy import GENERATION_PATHS, generation
from .sharding import SHARD_HEADER
from .state import STATE, RouterState
from .upstream import Origin, StaleConnection, UpstreamError, UpstreamPool

log = logging.getLogger(__name__)

CONTROL_ORIGIN = Origin(key="control", host="control", port=0, tls=False, host_header=b"control", base_path=b"")
"""The control app, as the relay addresses it (the Host header it sees)."""
_NOT_RELAYED = HOP_BY_HOP | {b"expect"}
"""Request headers the relay does not pass (the body travels whole: nothing to continue)."""
CONTROL_KEEPALIVE_S = 30.0
"""Idle relay connections to the control app are kept this long."""
CONTROL_SERVER_OPTIONS: dict[str, object] = {
    # Bodies are validated and forwarded as sent: never inflated (a Content-Encoding body is
    # not JSON to the router, as to vLLM), so no decompression bomb and no mislabelled relay.
    "auto_decompress": False,
    "access_log": None,
    "handler_cancellation": True,  # a client that goes away cancels the control handler too
}
"""``AppRunner`` options of the control app."""


class RouterService:
    """A running router: ``start`` binds the port and starts the background loops; ``stop`` drains."""

    def __init__(self, app: web.Application, *, limits: ServerLimits = DEFAULT_LIMITS) -> None:
        self.app = app
        self.state: RouterState = app[STATE]
        self.limits = limits
        self.runner: web.AppRunner | None = None
        self.server: DataPlaneServer | None = None
        self.control: UpstreamPool | None = None
        self.host = ""
        self.port = 0
        self._stopping: asyncio.Future[None] | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self, host: str, port: int, *, backlog: int, sock: socket.socket | None = None) -> None:
        """Start the control app's loops, then listen (``port`` 0 picks a free one; see ``url``)."""
        s = self.state
        cfg = s.config
        self.runner = web.AppRunner(self.app, shutdown_timeout=cfg.drain_timeout_s,
                                    **CONTROL_SERVER_OPTIONS)  # type: ignore[arg-type]
        await self.runner.setup()
        # No read timeout on the relay: the control app bounds its own calls (to engines, by the
        # config's timeouts), and a relay that gave up first would turn its answer into a 500.
        self.control = UpstreamPool(keepalive_s=CONTROL_KEEPALIVE_S, connect_timeout_s=cfg.upstream_connect_timeout_s,
                                    read_timeout_s=None, connector=self._control_connection)
        server = DataPlaneServer(self._handle, error_body=http_error_body,
                                 max_body_bytes=lambda: s.config.max_body_bytes, limits=self.limits,
                                 on_refused=s.metrics.invalid.inc)
        if s.shard_index is not None:
            server.extra_header = b"%s: %d\r\n" % (SHARD_HEADER.encode(), s.shard_index)
        self.server = server
        try:
            await server.listen(host, port, backlog=backlog, sock=sock)
        except BaseException:
            await self._close_rest()
            raise
        bound = server.sockets[0].getsockname()
        self.host, self.port = bound[0], bound[1]

    async def _control_connection(self, origin: Origin, factory: Callable[[], Any]) -> Any:
        """A connected socket pair: one end served by the control app's aiohttp handler, the other ours."""
        assert self.runner is not None and self.runner.server is not None
        ours, theirs = socket.socketpair()
        loop = asyncio.get_running_loop()
        try:
            await loop.connect_accepted_socket(self.runner.server, theirs)
        except BaseException:
            ours.close()
            theirs.close()
            raise
        return await loop.create_connection(factory, sock=ours)

    async def _handle(self, req: IncomingRequest, out: Responder) -> None:
        kind = GENERATION_PATHS.get(req.path)
        if kind is not None:
            if req.method != b"POST":
                body = http_error_body(405, "Method Not Allowed", "method_not_allowed")
                out.respond_json(405, body, [(b"Allow", b"POST")])
                return
            await generation(self.state, req, out, kind)
            return
        await self._relay(req, out)

    async def _relay(self, req: IncomingRequest, out: Responder) -> None:
        """Pass a request to the control app and its answer back, unchanged but for framing."""
        assert self.control is not None
        headers = b"".join(k + b": " + v + b"\r\n" for k, v in req.headers if k.lower() not in _NOT_RELAYED)
        try:
            try:
                answer = await self.control.request(CONTROL_ORIGIN, req.method, req.target, headers, req.body)
            except StaleConnection:  # aiohttp closed an idle relay connection: once more, fresh
                answer = await self.control.request(CONTROL_ORIGIN, req.method, req.target, headers, req.body,
                                                    fresh=True)
        except UpstreamError as exc:
            log.error("control app unreachable: %s", exc)
            out.respond_json(500, http_error_body(500, "internal router error", "internal_error"))
            return
        async with answer:
            relayed = [(k, v) for k, v in answer.headers if k.lower() not in NOT_RELAYED_IN_ANSWERS]
            if answer.header(b"content-length") is not None or req.method == b"HEAD":
                out.respond(answer.status, relayed, await answer.read())
                return
            out.start_stream(answer.status, relayed)
            while chunk := await answer.read_chunk():
                await out.write(chunk)
            out.end_stream()

    async def stop(self) -> None:
        """Drain and close: no new connections; held requests 503; in-flight ones get ``drain_timeout_s``.
        Idempotent."""
        if self._stopping is not None:
            await self._stopping
            return
        self._stopping = asyncio.get_running_loop().create_future()
        try:
            await self._drain_and_close()
        finally:
            self._stopping.set_result(None)

    async def _drain_and_close(self) -> None:
        s = self.state
        if self.server is not None:
            await self.server.stop_listening()
        s.begin_drain()
        d = s.dispatcher
        if d.in_flight:
            log.info("draining %d in-flight requests", len(d.in_flight))
            if not await d.wait_idle(s.config.drain_timeout_s):
                log.warning("drain timeout: %d requests still in flight", len(d.in_flight))
        await self._close_rest()

    async def _close_rest(self) -> None:
        if self.server is not None:
            await self.server.close()
            self.server = None
        if self.control is not None:
            await self.control.close()
            self.control = None
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


async def start_service(
    app: web.Application, host: str = "127.0.0.1", port: int = 0, *, backlog: int = 2048,
    limits: ServerLimits = DEFAULT_LIMITS, sock: socket.socket | None = None,
) -> RouterService:
    """Start a router for ``app`` (``create_app``); stop it with ``await service.stop()``."""
    service = RouterService(app, limits=limits)
    await service.start(host, port, backlog=backlog, sock=sock)
    return service
