"""The data plane's HTTP/1.1 client: pooled keep-alive connections to the engines.

One request at a time per connection, as vLLM's uvicorn serves them. Why not
aiohttp's client: on the proxy benchmark (docs/scale.md) its request and
connector machinery was a quarter of the router's CPU per request, for
features a proxy to known engines does not use (cookies, redirects, auth,
decompression, per-request timeouts objects, tracing). What is kept:

- **Pools per origin**, newest idle connection first (a stack): under a steady
  stream only the connections the current concurrency needs are touched, the
  surplus ages out after ``keepalive_s`` (the sweep), so each engine's pool
  follows its recent concurrency, not its all-time peak (the 1,000-session soak
  held 1,720 sockets for 906 requests in flight with a queue-ordered pool).
- **An optional total limit** (``max_connections``): a request past it waits,
  first come first served, for a connection to be released.
- **Timeouts**: connecting (``connect_timeout_s``), and the longest silence of
  an engine during a request (``read_timeout_s``: no byte for that long),
  checked for all requests by the pool's one sweep (no timer per request).
- **Stale keep-alive connections**: an engine closes an idle connection after
  its own keep-alive limit; a request that finds its reused connection closed
  before any byte of the answer raises ``StaleConnection``, so the caller can
  send it once more on a fresh one without counting the engine as failed.
- **Back-pressure**: a streamed answer whose reader falls behind (a slow
  client) stops reading from the engine past ``STREAM_HIGH_WATER_BYTES``.

Answers are parsed by httptools (llhttp, Node.js's parser, as uvicorn uses
it): status, headers, and the body framed by Content-Length, chunked encoding
or the connection's end.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httptools

from .http1 import first_header

STREAM_HIGH_WATER_BYTES = 256 * 1024
"""Unread answer bytes at which reading from the engine pauses (resumes below a quarter)."""
SWEEP_INTERVAL_S = 1.0
"""How often idle pooled connections are checked against ``keepalive_s``, and busy ones for silence."""
SILENCE_CHECKS_PER_TIMEOUT = 0.25
"""With a read timeout under four sweep intervals, the sweep runs every quarter of it instead."""


class UpstreamError(Exception):
    """A request to an engine failed at the transport level."""


class ConnectFailed(UpstreamError):
    """No connection could be opened (refused, unreachable, name not resolved, connect timeout)."""


class ConnectTimedOut(ConnectFailed):
    """No connection within ``connect_timeout_s``: the engine may be gone, or only slow to accept
    (a full listen backlog drops SYNs under a burst of connects; a starved host answers late)."""


class StaleConnection(UpstreamError):
    """A reused keep-alive connection was closed by the engine before any byte of the answer."""


class ConnectionBroke(UpstreamError):
    """The connection closed or reset before the answer was complete."""


class ReadTimeout(UpstreamError):
    """The engine sent nothing for ``read_timeout_s`` while an answer was due."""


class BadAnswer(UpstreamError):
    """The engine's answer is not valid HTTP/1.1."""


@dataclass(frozen=True, slots=True)
class Origin:
    """Where an engine is: how to connect, what to send as ``Host``, the path prefix of its URL."""

    key: str
    host: str
    port: int
    tls: bool
    host_header: bytes
    base_path: bytes

    @classmethod
    def from_url(cls, url: str) -> Origin:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"engine URL {url!r} must be http:// or https:// with a host")
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        return cls(
            key=url,
            host=parts.hostname,
            port=port,
            tls=tls,
            host_header=parts.netloc.rsplit("@", 1)[-1].encode("idna"),  # without any user:password@
            base_path=parts.path.rstrip("/").encode(),
        )


class UpstreamResponse:
    """An engine's answer: status and headers at once, the body as it arrives.

    Read it whole (``read``) or in pieces (``read_chunk`` until ``b""``). The
    connection goes back to the pool when the body has been read to its end;
    ``close`` abandons it (the engine sees the client side close and aborts
    the request), which is what a caller does when it stops reading early.
    """

    __slots__ = ("_conn", "headers", "status")

    def __init__(self, conn: _Connection, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self._conn = conn
        self.status = status
        self.headers = headers
        """Header (name, value) pairs as the engine sent them."""

    def header(self, name: bytes) -> bytes | None:
        """The first value of header ``name`` (lower case), or None."""
        return first_header(self.headers, name)

    @property
    def content_type(self) -> bytes:
        """The media type, lower case, without parameters (b"" when absent)."""
        value = self.header(b"content-type")
        return value.split(b";", 1)[0].strip().lower() if value else b""

    async def read(self) -> bytes:
        """The whole body (the connection is released)."""
        return await self._conn.read_all()

    async def read_chunk(self) -> bytes:
        """The next piece of the body as it arrived; ``b""`` at its end (the connection is released)."""
        return await self._conn.read_chunk()

    def close(self) -> None:
        """Abandon the answer: a connection not read to the end is closed, never reused."""
        self._conn.abandon()

    async def __aenter__(self) -> UpstreamResponse:
        return self

    async def __aexit__(self, *_: object) -> None:
        self.close()


class _Connection(asyncio.Protocol):
    """One keep-alive connection to an origin; one request at a time."""

    def __init__(self, pool: UpstreamPool, origin: Origin) -> None:
        self.pool = pool
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.reused = False
        self.idle_since = 0.0
        self.closed = False
        self._head: asyncio.Future[UpstreamResponse] | None = None
        self._status = 0
        self._headers: list[tuple[bytes, bytes]] = []
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._complete = False
        self._got_bytes = False
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._reading_paused = False
        self._last_io = 0.0
        self._head_only = False
        self._keep = False
        self._busy = False

    # ---- asyncio.Protocol ------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if not self._busy:
            # Bytes nobody asked for: an engine answering twice, or junk. The connection is unusable.
            self._fail(BadAnswer("the engine sent bytes outside any request"))
            return
        self._got_bytes = True
        self._last_io = self.pool.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(BadAnswer("the engine switched protocols"))
        except httptools.HttpParserError as exc:
            self._fail(BadAnswer(f"the engine's answer is not valid HTTP/1.1: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._forget(self)
        if not self._busy or self._complete or self._error is not None:
            return
        if self._head is not None and not self._got_bytes and self.reused:
            self._fail(StaleConnection("the engine closed the pooled connection"))
        elif self._head is None and not self._head_only and self._body_until_close():
            self._complete = True  # a body delimited by the connection's end
            self._keep = False
            self._wake()
        else:
            reason = f": {exc}" if exc else ""
            self._fail(ConnectionBroke(f"the engine closed the connection before the answer ended{reason}"))

    # ---- httptools callbacks -------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # an interim answer (never asked for): wait for the final one
            self._headers = []
            return
        self._status = status
        head = self._head
        self._head = None
        if head is not None and not head.done():
            head.set_result(UpstreamResponse(self, status, self._headers))
        if self._head_only:  # the answer to HEAD has no body, whatever its headers say
            self._complete = True
            self._keep = False
            self._wake()

    def on_body(self, body: bytes) -> None:
        if self._head_only:
            return
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > STREAM_HIGH_WATER_BYTES and not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._status == 0:
            return  # the end of an interim answer
        self._complete = True
        self._keep = self.parser.should_keep_alive()
        self._wake()

    # ---- requests -------------------------------------------------------------

    def start(self, data: bytes, *, head_only: bool) -> asyncio.Future[UpstreamResponse]:
        assert self.transport is not None
        loop = self.pool.loop
        self._busy = True
        self._head_only = head_only
        self._status = 0
        self._headers = []
        self._complete = False
        self._got_bytes = False
        self._error = None
        self._keep = False
        self._head = fut = loop.create_future()
        self._last_io = loop.time()
        self.pool._busy.add(self)
        self.transport.write(data)
        return fut

    def check_silence(self, now: float, timeout: float) -> None:
        """Fail the request when the engine has sent nothing for ``timeout`` (the pool's sweep asks)."""
        if self._complete or self._error is not None or self._reading_paused:
            return  # done, failed, or waiting on our own slow reader rather than on the engine
        if now - self._last_io >= timeout:
            self._fail(ReadTimeout(f"the engine sent nothing for {timeout:g} s"))

    def _body_until_close(self) -> bool:
        """Whether the answer's body is delimited by the connection's end (no length, not chunked)."""
        has_length = chunked = False
        for k, v in self._headers:
            lk = k.lower()
            if lk == b"content-length":
                has_length = True
            elif lk == b"transfer-encoding" and b"chunked" in v.lower():
                chunked = True
        return not has_length and not chunked and not (self._status in (204, 304) or self._status < 200)

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, error: UpstreamError) -> None:
        if self._error is None:
            self._error = error
        head = self._head
        self._head = None
        if head is not None and not head.done():
            head.set_exception(error)
        w = self._waiter
        if w is not None and not w.done():
            w.set_exception(error)
        self._close_transport()

    def _close_transport(self) -> None:
        self.pool._busy.discard(self)
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.abort()
        self.pool._forget(self)

    async def read_chunk(self) -> bytes:
        while True:
            if self._chunks:
                chunk = self._chunks.popleft()
                self._buffered -= len(chunk)
                if self._reading_paused and self._buffered < STREAM_HIGH_WATER_BYTES // 4 and self.transport:
                    self._reading_paused = False
                    self._last_io = self.pool.loop.time()
                    self.transport.resume_reading()
                return chunk
            if self._error is not None:
                raise self._error
            if self._complete:
                self._finished()
                return b""
            self._waiter = self.pool.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def read_all(self) -> bytes:
        parts = []
        while chunk := await self.read_chunk():
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _finished(self) -> None:
        """The answer was read to its end: back to the pool, or closed if the engine said so."""
        if not self._busy:
            return
        self._busy = False
        self.pool._busy.discard(self)
        if self._keep and not self.closed:
            self.pool._release(self)
        else:
            self._close_transport()
            self.pool._released_slot()

    def abandon(self) -> None:
        if not self._busy:
            return
        if self._complete and not self._chunks and self._error is None:
            self._finished()
            return
        self._busy = False
        self._close_transport()
        self.pool._released_slot()


class UpstreamPool:
    """Keep-alive connections to every origin, newest idle first (see the module docstring)."""

    def __init__(
        self,
        *,
        keepalive_s: float,
        connect_timeout_s: float,
        read_timeout_s: float | None,
        max_connections: int | None = None,
        connector: Callable[[Origin, Callable[[], asyncio.Protocol]], Any] | None = None,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.keepalive_s = keepalive_s
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.max_connections = max_connections
        self._connector = connector or self._tcp_connect
        self._origins: dict[str, Origin] = {}
        self._idle: dict[str, collections.deque[_Connection]] = {}
        self._open = 0
        """Connections open or being opened (the limit counts these)."""
        self._slot_waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._ssl: ssl.SSLContext | None = None
        self._busy: set[_Connection] = set()
        """Connections with a request in progress (checked for the engine's silence by the sweep)."""
        self._frozen: set[str] = set()
        """Origin keys whose engines a keep pause froze: their silence is not a failure until ``thaw``."""
        first = SWEEP_INTERVAL_S if read_timeout_s is None else min(SWEEP_INTERVAL_S,
                                                                   read_timeout_s * SILENCE_CHECKS_PER_TIMEOUT)
        self._sweeper: asyncio.TimerHandle | None = self.loop.call_later(first, self._sweep)
        self._closed = False

    # ---- public ---------------------------------------------------------------

    def origin(self, url: str) -> Origin:
        """The parsed origin of an engine base URL (cached)."""
        o = self._origins.get(url)
        if o is None:
            o = self._origins[url] = Origin.from_url(url)
        return o

    async def request(
        self, origin: Origin, method: bytes, target: bytes, headers: bytes, body: bytes = b"",
        *, fresh: bool = False,
    ) -> UpstreamResponse:
        """Send one request; returns when the answer's status and headers are in.

        ``target`` is the path (and query) after the origin's base path; ``headers``
        the header lines to send besides ``Host`` and ``Content-Length`` (each ending
        in CRLF). ``fresh``: never reuse an idle connection (the retry after a stale one).
        """
        conn = None if fresh else self._take_idle(origin)
        if conn is None:
            conn = await self._connect(origin)
        head = b"%s %s%s HTTP/1.1\r\nHost: %s\r\n%sContent-Length: %d\r\n\r\n" % (
            method, origin.base_path, target, origin.host_header, headers, len(body))
        fut = conn.start(head + body if body else head, head_only=method == b"HEAD")
        try:
            return await fut
        except BaseException:
            conn.abandon()
            raise

    def freeze(self, urls: Iterable[str]) -> None:
        """The engines at ``urls`` froze their requests (vLLM's keep pause): the sweep stops
        counting their silence against ``read_timeout_s``."""
        self._frozen.update(self.origin(u).key for u in urls)

    def thaw(self) -> None:
        """Every frozen engine goes on: their requests' silence counts again, from now."""
        if not self._frozen:
            return
        now = self.loop.time()
        for conn in self._busy:
            if conn.origin.key in self._frozen:
                conn._last_io = now
        self._frozen.clear()

    async def close(self) -> None:
        """Close every connection (requests still running fail with ``ConnectionBroke``)."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for stack in self._idle.values():
            while stack:
                stack.pop()._close_transport()
        for w in self._slot_waiters:
            if not w.done():
                w.set_exception(ConnectFailed("the router is shutting down"))

    @property
    def open_connections(self) -> int:
        return self._open

    def idle_connections(self, origin: Origin | None = None) -> int:
        if origin is not None:
            return len(self._idle.get(origin.key, ()))
        return sum(len(s) for s in self._idle.values())

    # ---- connections ------------------------------------------------------------

    def _take_idle(self, origin: Origin) -> _Connection | None:
        stack = self._idle.get(origin.key)
        while stack:
            conn = stack.pop()
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                conn.reused = True
                return conn
        return None

    async def _connect(self, origin: Origin) -> _Connection:
        if self._closed:
            raise ConnectFailed("the router is shutting down")
        limit = self.max_connections
        if limit is not None and self._open >= limit and not self._evict_one_idle():
            # Wait for a slot, first come first served; a releaser hands its slot over (the count stays).
            fut: asyncio.Future[None] = self.loop.create_future()
            self._slot_waiters.append(fut)
            try:
                await fut
            except BaseException:
                if fut.done() and not fut.cancelled() and fut.exception() is None:
                    self._released_slot()  # handed a slot this request will not use: pass it on
                elif fut in self._slot_waiters:
                    self._slot_waiters.remove(fut)
                raise
        else:
            self._open += 1
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, proto = await self._connector(origin, lambda: _Connection(self, origin))
        except TimeoutError:
            self._released_slot()
            raise ConnectTimedOut(
                f"connecting to {origin.key} timed out after {self.connect_timeout_s:g} s") from None
        except OSError as exc:
            self._released_slot()
            raise ConnectFailed(f"cannot connect to {origin.key}: {exc.strerror or exc}") from None
        except BaseException:
            self._released_slot()
            raise
        return proto

    async def _tcp_connect(self, origin: Origin, factory: Callable[[], asyncio.Protocol]) -> Any:
        tls: ssl.SSLContext | None = None
        if origin.tls:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            tls = self._ssl
        return await self.loop.create_connection(
            factory, origin.host, origin.port, ssl=tls, server_hostname=origin.host if tls else None)

    def _release(self, conn: _Connection) -> None:
        if self._closed:
            conn._close_transport()
            self._released_slot()
            return
        while self._slot_waiters and self._slot_waiters[0].done():
            self._slot_waiters.popleft()  # given up (cancelled)
        if self._slot_waiters:
            # Someone waits for a slot: this connection's origin may not be theirs, so close it.
            conn._close_transport()
            self._released_slot()
            return
        conn.idle_since = self.loop.time()
        self._idle.setdefault(conn.origin.key, collections.deque()).append(conn)

    def _released_slot(self) -> None:
        """A connection's slot is free: handed to the first waiter, else the count drops."""
        while self._slot_waiters:
            w = self._slot_waiters.popleft()
            if not w.done():
                w.set_result(None)
                return
        self._open -= 1

    def _forget(self, conn: _Connection) -> None:
        """A connection closed: drop it from its idle stack (it no longer counts once released)."""
        stack = self._idle.get(conn.origin.key)
        if stack and conn in stack and not conn._busy:
            stack.remove(conn)
            self._released_slot()

    def _evict_one_idle(self) -> bool:
        """Close the oldest idle connection of any origin to make room for a new one."""
        for stack in self._idle.values():
            if stack:
                stack.popleft()._close_transport()
                self._open -= 1  # not handed to a waiter: the caller opens the replacement at once
                return True
        return False

    def _sweep(self) -> None:
        """Close connections idle longer than ``keepalive_s`` (the oldest sit at each stack's bottom), and
        fail requests whose engine has been silent for ``read_timeout_s``: one timer for the pool, none per
        request (so a silence is noticed up to a sweep interval late)."""
        now = self.loop.time()
        horizon = now - self.keepalive_s
        for stack in self._idle.values():
            while stack and stack[0].idle_since < horizon:
                conn = stack.popleft()
                conn._close_transport()
                self._released_slot()
        timeout = self.read_timeout_s
        interval = SWEEP_INTERVAL_S
        if timeout is not None:
            interval = min(interval, timeout * SILENCE_CHECKS_PER_TIMEOUT)
            frozen = self._frozen
            for conn in list(self._busy):
                if not frozen or conn.origin.key not in frozen:
                    conn.check_silence(now, timeout)
        self._sweeper = None if self._closed else self.loop.call_later(interval, self._sweep)
