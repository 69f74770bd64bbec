"""The data plane's HTTP/1.1 server: client connections in, requests to a handler, answers out.

Why not aiohttp's server: on the proxy benchmark (docs/scale.md) aiohttp's
request and response machinery was about 40% of the router's CPU per request.
This server does what a proxy's front needs and nothing else:

- requests are parsed by httptools (llhttp, as uvicorn uses it): bodies by
  Content-Length or chunked encoding, keep-alive by the HTTP version and the
  ``Connection`` header, malformed requests refused with 400 (and the
  connection closed: a parser that lost its framing cannot resync);
- limits, each refused with its status and an error body (``error_body``):
  the request target (414), each header line and the number of headers (431),
  the body (413: ``max_body_bytes``, read from the live config per request,
  checked against ``Content-Length`` before any of the body is read);
- ``Expect: 100-continue`` is answered when the body is wanted (curl sends it
  for bodies over 1 KiB and waits a second without it);
- pipelined requests are answered in order, one at a time; reading goes on
  while a request is served (a client that leaves is noticed at once and its
  handler cancelled, so the engine aborts the request), and pauses only when
  ``max_pipelined`` requests wait;
- answers are written whole (``Responder.respond``) or streamed
  (``start_stream``, ``write``, ``end_stream``) with chunked encoding (close-
  delimited for HTTP/1.0), with write back-pressure: ``write`` waits while the
  client's socket buffer is full;
- idle keep-alive connections close after ``keepalive_timeout_s`` (one sweep
  a second for all of them, which also refreshes the cached ``Date``).

Each connection's requests are answered by one task, in order; a client that
goes away cancels it (and so the handler), as aiohttp's ``handler_cancellation``
did.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import email.utils
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httptools

from .http1 import REASONS, first_header

log = logging.getLogger(__name__)

SWEEP_INTERVAL_S = 1.0
"""How often idle connections are checked and the cached ``Date`` header refreshed."""



@dataclass(frozen=True, slots=True)
class ServerLimits:
    """What one client may send (aiohttp's limits, where it has one)."""

    max_target_bytes: int = 8190
    """Longest request target (path and query), bytes: 414 past it."""
    max_header_bytes: int = 8190
    """Longest header line (name and value), bytes: 431 past it."""
    max_headers: int = 128
    """Most header lines in one request: 431 past it."""
    max_pipelined: int = 16
    """Requests read ahead of the one being answered before reading pauses."""
    keepalive_timeout_s: float = 75.0
    """An idle keep-alive connection (no request in progress) is closed after this."""


DEFAULT_LIMITS = ServerLimits()

ErrorBody = Callable[[int, str, str], bytes]
"""Builds an error answer's JSON body from (status, message, code): the router's OpenAI shape."""


class IncomingRequest:
    """One parsed request: method, target, raw headers, the whole body."""

    __slots__ = ("_mapping", "body", "headers", "keep_alive", "method", "path", "query", "target", "version")

    def __init__(self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes,
                 version: str, keep_alive: bool) -> None:
        self.method = method
        self.target = target
        path, _, query = target.partition(b"?")
        self.path = path
        self.query = query
        self.headers = headers
        """(name, value) pairs as the client sent them."""
        self.body = body
        self.version = version
        """``"1.1"`` or ``"1.0"``."""
        self.keep_alive = keep_alive
        self._mapping: dict[str, str] | None = None

    def header(self, name: bytes) -> bytes | None:
        """The first value of header ``name`` (give it in lower case), or None."""
        return first_header(self.headers, name)

    @property
    def mapping(self) -> dict[str, str]:
        """The headers as strings keyed by lower-case name, the first of repeated ones (built once)."""
        if self._mapping is None:
            self._mapping = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in reversed(self.headers)}
        return self._mapping


class ClientGone(ConnectionError):
    """The client closed the connection: nothing more can be written to it."""


class Responder:
    """How a handler answers one request: whole (``respond``) or streamed."""

    __slots__ = ("_conn", "_http10", "_keep", "finished", "started", "status")

    def __init__(self, conn: ClientConnection, *, http10: bool, keep_alive: bool) -> None:
        self._conn = conn
        self._http10 = http10
        self._keep = keep_alive
        self.started = False
        self.finished = False
        self.status = 0

    @property
    def client_gone(self) -> bool:
        return self._conn.closed

    def _head(self, status: int, headers: list[tuple[bytes, bytes]], framing: bytes) -> bytearray:
        conn = self._conn
        keep = self._keep and not conn.server.closing
        self._keep = keep
        out = bytearray(b"HTTP/1.1 %d %s\r\n" % (status, REASONS.get(status, b"Unknown")))
        for k, v in headers:
            out += k + b": " + v + b"\r\n"
        out += b"Date: " + conn.server.date + b"\r\n"
        shard = conn.server.extra_header
        if shard:
            out += shard
        out += framing
        if not keep:
            out += b"Connection: close\r\n"
        elif self._http10:
            out += b"Connection: keep-alive\r\n"
        out += b"\r\n"
        return out

    def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes = b"") -> None:
        """Send a whole answer (headers must not include framing: Content-Length is set here)."""
        if self.started:
            raise RuntimeError("answer already started")
        self.started = self.finished = True
        self.status = status
        out = self._head(status, headers, b"Content-Length: %d\r\n" % len(body))
        out += body
        self._conn.write(out)

    def respond_json(self, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        self.respond(status, [(b"Content-Type", b"application/json"), *(headers or ())], body)

    def start_stream(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Send the head of a streamed answer (chunked; close-delimited for an HTTP/1.0 client)."""
        if self.started:
            raise RuntimeError("answer already started")
        self.started = True
        self.status = status
        if self._http10:
            self._keep = False
            self._conn.write(self._head(status, headers, b""))
        else:
            self._conn.write(self._head(status, headers, b"Transfer-Encoding: chunked\r\n"))

    async def write(self, data: bytes) -> None:
        """Send a piece of a streamed answer; waits while the client is not reading."""
        if not data:
            return
        conn = self._conn
        if conn.closed:
            raise ClientGone("the client went away")
        conn.write(data if self._http10 else b"%x\r\n%s\r\n" % (len(data), data))
        if conn.write_paused:
            await conn.drained()

    def end_stream(self) -> None:
        """End a streamed answer."""
        if self.finished:
            return
        self.finished = True
        if not self._http10 and not self._conn.closed:
            self._conn.write(b"0\r\n\r\n")

    @property
    def keep_alive(self) -> bool:
        return self._keep


Handler = Callable[[IncomingRequest, Responder], Awaitable[None]]


class ClientConnection(asyncio.Protocol):
    """One client connection (see the module docstring)."""

    def __init__(self, server: DataPlaneServer) -> None:
        self.server = server
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.closed = False
        self.write_paused = False
        self.last_io = self.loop.time()
        self._drain: asyncio.Future[None] | None = None
        self._queue: collections.deque[IncomingRequest] = collections.deque()
        self._task: asyncio.Task[None] | None = None
        """The connection's serving task (``_serve_loop``), from its first request on."""
        self._wakeup: asyncio.Future[None] | None = None
        self._serving = False
        self._refusal: tuple[int, str, str] | None = None
        self._reading_paused = False
        self._refused = False
        # the message being parsed
        self._target = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._body_len = 0
        self._body_limit = 0
        self._continue_pending = False

    # ---- asyncio.Protocol --------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):  # answers are written whole or as events: never batch
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        self.last_io = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(400, "protocol upgrades (Upgrade: ...) are not supported", "upgrade_not_supported")
        except httptools.HttpParserError as exc:
            if not self._refused:
                self._refuse(400, f"malformed HTTP request: {exc}", "bad_request")

    def eof_received(self) -> bool | None:
        return None  # the client will send no more: close (and cancel what it asked), as aiohttp does

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        self._queue.clear()
        if self._task is not None and not self._task.done():
            self._task.cancel()
        d = self._drain
        if d is not None and not d.done():
            d.set_exception(ClientGone("the client went away"))

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        d = self._drain
        if d is not None and not d.done():
            d.set_result(None)

    async def drained(self) -> None:
        if self.closed:
            raise ClientGone("the client went away")
        self._drain = self.loop.create_future()
        try:
            await self._drain
        finally:
            self._drain = None

    # ---- httptools callbacks -------------------------------------------------------

    def on_message_begin(self) -> None:
        self._target = b""
        self._headers = []
        self._body = []
        self._body_len = 0
        self._continue_pending = False

    def on_url(self, url: bytes) -> None:
        if self._refused:
            return
        self._target += url
        if len(self._target) > self.server.limits.max_target_bytes:
            self._refuse(414, f"request target longer than {self.server.limits.max_target_bytes} bytes",
                         "uri_too_long")

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._refused:
            return
        limits = self.server.limits
        if len(name) + len(value) > limits.max_header_bytes:
            self._refuse(431, f"header {name[:64].decode('latin-1')!r} longer than {limits.max_header_bytes} bytes",
                         "header_too_large")
        elif len(self._headers) >= limits.max_headers:
            self._refuse(431, f"more than {limits.max_headers} headers", "too_many_headers")
        else:
            self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        limit = self._body_limit = self.server.max_body_bytes()
        expect = None
        for k, v in self._headers:
            lk = k.lower()
            if lk == b"content-length":
                try:
                    declared = int(v)
                except ValueError:
                    declared = 0  # llhttp already refused a malformed length
                if declared > limit:
                    self._refuse(413, f"request body is larger than {limit} bytes", "body_too_large")
                    return
            elif lk == b"expect":
                expect = v.strip().lower()
        if expect is not None:
            if expect != b"100-continue":
                self._refuse(417, "only 'Expect: 100-continue' is supported", "expectation_failed")
            elif not self._serving and not self._queue:
                self.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            else:
                self._continue_pending = True  # sent when the requests ahead of it are answered

    def on_body(self, body: bytes) -> None:
        if self._refused:
            return
        self._body_len += len(body)
        if self._body_len > self._body_limit:
            self._refuse(413, f"request body is larger than {self._body_limit} bytes", "body_too_large")
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        p = self.parser
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        req = IncomingRequest(p.get_method(), self._target, self._headers, body, p.get_http_version(),
                              p.should_keep_alive())
        self._queue.append(req)
        self._continue_pending = False
        if len(self._queue) >= self.server.limits.max_pipelined and not self._reading_paused:
            self._reading_paused = True
            assert self.transport is not None
            self.transport.pause_reading()
        if self._task is None:
            self._task = self.loop.create_task(self._serve_loop())
        elif self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    # ---- serving -----------------------------------------------------------------

    def write(self, data: bytes | bytearray) -> None:
        if not self.closed and self.transport is not None:
            self.transport.write(data)

    async def _serve_loop(self) -> None:
        """The connection's one task: its requests in order, then wait for the next.

        One task per connection, not per request: a keep-alive client sends thousands of
        requests, and creating a task for each was a measurable share of the router's CPU.
        """
        try:
            while not self.closed:
                if not self._queue:
                    if self._continue_pending:
                        self._continue_pending = False
                        self.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                    if self.server.closing:
                        self._close()
                        return
                    self._wakeup = self.loop.create_future()
                    try:
                        await self._wakeup
                    finally:
                        self._wakeup = None
                    continue
                req = self._queue.popleft()
                if self._reading_paused and len(self._queue) < self.server.limits.max_pipelined // 2:
                    self._reading_paused = False
                    assert self.transport is not None
                    self.transport.resume_reading()
                if not await self._serve(req):
                    return
        except asyncio.CancelledError:
            return  # the client left (connection_lost) while nothing was being answered

    async def _serve(self, req: IncomingRequest) -> bool:
        """Answer one request; True when the connection goes on to the next."""
        out = Responder(self, http10=req.version == "1.0", keep_alive=req.keep_alive)
        self._serving = True
        try:
            await self.server.handler(req, out)
        except asyncio.CancelledError:
            if not self.closed:
                self._abort()  # cancelled for another reason (shutdown): the answer cannot be finished
            return False
        except ClientGone:
            return False
        except Exception:
            log.exception("unhandled error answering %s %s", req.method.decode(), req.path.decode("latin-1"))
            if out.started:
                self._abort()
                return False
            out.respond_json(500, self.server.error_body(500, "internal router error", "internal_error"))
        finally:
            self._serving = False
        if self.closed:
            return False
        if not out.finished:
            if out.started:
                self._abort()  # a stream the handler left open cannot be ended cleanly
                return False
            out.respond_json(500, self.server.error_body(500, "the router gave no answer", "internal_error"))
        if self._refusal is not None:
            self._send_refusal(*self._refusal)
            return False
        self.last_io = self.loop.time()
        if not out.keep_alive:
            self._close()
            return False
        return True

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer a request this server cannot take and close: the rest of the byte stream is not trusted."""
        self._refused = True
        self.server.on_refused()
        self._queue.clear()
        if self._serving:
            self._refusal = (status, message, code)  # answers stay in order: after the one in progress
        else:
            self._send_refusal(status, message, code)

    def _send_refusal(self, status: int, message: str, code: str) -> None:
        if self.closed:
            return
        out = Responder(self, http10=False, keep_alive=False)
        out.respond_json(status, self.server.error_body(status, message, code))
        self._close()

    def _close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()  # after what is buffered is written

    def _abort(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.abort()

    @property
    def busy(self) -> bool:
        return self._serving or bool(self._queue)

    def close_if_idle(self, horizon: float | None) -> None:
        """Close when no request is in progress (and, given ``horizon``, idle since before it)."""
        if not self.busy and (horizon is None or self.last_io < horizon):
            self._close()


class DataPlaneServer:
    """The listening socket and its connections."""

    def __init__(
        self,
        handler: Handler,
        *,
        error_body: ErrorBody,
        max_body_bytes: Callable[[], int],
        limits: ServerLimits = DEFAULT_LIMITS,
        on_refused: Callable[[], None] = lambda: None,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.handler = handler
        self.error_body = error_body
        self.max_body_bytes = max_body_bytes
        self.limits = limits
        self.on_refused = on_refused
        """Called once per request refused at the HTTP level (a malformed or oversized request)."""
        self.connections: set[ClientConnection] = set()
        self.closing = False
        self.extra_header = b""
        """A header line (with CRLF) every answer carries, e.g. the router shard's ``X-Misat-Shard``."""
        self.date = b""
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.TimerHandle | None = None
        self._sweep()

    async def listen(self, host: str, port: int, *, backlog: int, sock: socket.socket | None = None) -> None:
        if sock is not None:
            self._server = await self.loop.create_server(lambda: ClientConnection(self), sock=sock, backlog=backlog)
        else:
            self._server = await self.loop.create_server(
                lambda: ClientConnection(self), host, port, backlog=backlog, reuse_address=True)

    @property
    def sockets(self) -> list[socket.socket]:
        return list(self._server.sockets) if self._server is not None else []

    def _sweep(self) -> None:
        self.date = email.utils.formatdate(usegmt=True).encode()
        horizon = self.loop.time() - self.limits.keepalive_timeout_s
        for conn in list(self.connections):
            conn.close_if_idle(horizon)
        self._sweeper = self.loop.call_later(SWEEP_INTERVAL_S, self._sweep)

    async def stop_listening(self) -> None:
        """Take no new connections; idle ones close, busy ones finish their request (then close)."""
        self.closing = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.close_if_idle(None)

    async def close(self) -> None:
        """Close every connection now (what is still running is cancelled)."""
        self.closing = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn._abort()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        await asyncio.sleep(0)  # let connection_lost run, which cancels the handlers
