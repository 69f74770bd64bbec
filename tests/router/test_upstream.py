"""The data plane's HTTP/1.1 client (``misat_router.upstream``) against scripted engines.

Each engine here is a raw asyncio server whose answers the test writes byte by byte, so
what is checked is the client: reuse (newest first), the keep-alive sweep, stale
connections, connect and read timeouts, body framings, HEAD, abandoning an answer, and
the total connection limit.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from misat_router.upstream import (
    STREAM_HIGH_WATER_BYTES,
    ConnectFailed,
    ConnectionBroke,
    ConnectTimedOut,
    Origin,
    ReadTimeout,
    StaleConnection,
    UpstreamPool,
)

WAIT_S = 5.0
OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


class Engine:
    """A scripted engine: ``script(reader, writer, connection_number)`` runs per connection."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.accepted = 0
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self.writers.append(writer)
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            await self.script(reader, writer, self.accepted)

    async def read_request(self, reader: asyncio.StreamReader) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        req = head + await reader.readexactly(length)
        self.requests.append(req)
        return req

    async def close(self) -> None:
        for w in self.writers:
            w.close()
        if self.server is not None:
            self.server.close()


def answers_forever(answer: bytes = OK) -> Script:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while True:
            await engine_of[script].read_request(reader)
            writer.write(answer)
    return script


engine_of: dict[Script, Engine] = {}


@pytest.fixture
async def make() -> AsyncIterator[Callable[..., Awaitable[tuple[Engine, UpstreamPool, Origin]]]]:
    made: list[tuple[Engine, UpstreamPool]] = []

    async def build(script: Script, **pool_args: float) -> tuple[Engine, UpstreamPool, Origin]:
        engine = Engine(script)
        engine_of[script] = engine
        url = await engine.start()
        args = {"keepalive_s": 30.0, "connect_timeout_s": 1.0, "read_timeout_s": 5.0, **pool_args}
        pool = UpstreamPool(**args)  # type: ignore[arg-type]
        made.append((engine, pool))
        return engine, pool, pool.origin(url)

    yield build
    for engine, pool in made:
        await pool.close()
        await engine.close()


async def get(pool: UpstreamPool, origin: Origin, body: bytes = b"{}", **kw: bool) -> tuple[int, bytes]:
    resp = await pool.request(origin, b"POST", b"/v1/completions", b"X-A: 1\r\n", body, **kw)
    async with resp:
        return resp.status, await resp.read()


async def test_the_request_is_sent_as_written_and_the_connection_is_reused(make) -> None:
    engine, pool, origin = await make(answers_forever())
    for _ in range(3):
        assert await get(pool, origin) == (200, b"{}")
    assert engine.accepted == 1 and pool.idle_connections(origin) == 1
    host = origin.host_header
    assert engine.requests[0] == (b"POST /v1/completions HTTP/1.1\r\nHost: " + host +
                                  b"\r\nX-A: 1\r\nContent-Length: 2\r\n\r\n{}")


async def test_the_newest_idle_connection_is_used_first(make) -> None:
    release = asyncio.Event()

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while True:
            await engine.read_request(reader)
            if n == 1 and not release.is_set():
                await release.wait()  # connection 1 answers last, so it is released last: the newest
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n%d" % n)

    engine, pool, origin = await make(script)
    first = asyncio.create_task(get(pool, origin))
    await _until(lambda: engine.accepted == 1 and len(engine.requests) == 1)
    assert await get(pool, origin) == (200, b"2")  # connection 2, released first
    release.set()
    assert await first == (200, b"1")
    assert await get(pool, origin) == (200, b"1")  # newest first: connection 1
    assert pool.idle_connections(origin) == 2


async def test_idle_connections_are_closed_after_keepalive(make) -> None:
    engine, pool, origin = await make(answers_forever(), keepalive_s=0.05)
    await get(pool, origin)
    assert pool.open_connections == 1
    await asyncio.wait_for(_until(lambda: pool.open_connections == 0), WAIT_S)  # the sweep, once a second
    await get(pool, origin)
    assert engine.accepted == 2


async def test_a_pooled_connection_the_engine_closed_is_stale_and_a_fresh_one_works(make) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await engine.read_request(reader)
        writer.write(OK)
        await writer.drain()
        if n == 1:
            await reader.read(1)  # the next request's first byte: close instead of answering
            writer.transport.abort()

    engine, pool, origin = await make(script)
    await get(pool, origin)
    with pytest.raises(StaleConnection):
        await get(pool, origin)
    assert await get(pool, origin, fresh=True) == (200, b"{}")
    assert pool.open_connections == 1


async def test_refused_and_timed_out_connects_fail_as_connect_failures(make) -> None:
    engine, pool, origin = await make(answers_forever())
    await engine.close()
    with pytest.raises(ConnectFailed, match="cannot connect") as refused:
        await get(pool, origin)
    assert not isinstance(refused.value, ConnectTimedOut)  # gone: the proxy takes it out at once

    async def never(origin: Origin, factory: object) -> object:
        await asyncio.Event().wait()
        raise AssertionError

    slow = UpstreamPool(keepalive_s=1.0, connect_timeout_s=0.05, read_timeout_s=1.0, connector=never)
    with pytest.raises(ConnectTimedOut, match="timed out"):  # maybe only slow: counted as a failed check
        await get(slow, origin)
    assert slow.open_connections == 0 and pool.open_connections == 0
    await slow.close()


async def test_silence_past_the_read_timeout_fails_and_bytes_keep_it_alive(make) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        req = await engine.read_request(reader)
        if b"silent" in req:
            await asyncio.Event().wait()
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(6):  # 6 x 0.05 s: longer than the timeout in all, never silent that long
            await asyncio.sleep(0.05)
            writer.write(b"1\r\nx\r\n")
        writer.write(b"0\r\n\r\n")

    engine, pool, origin = await make(script, read_timeout_s=0.15)
    with pytest.raises(ReadTimeout):
        await get(pool, origin, b"silent")
    assert await get(pool, origin) == (200, b"x" * 6)
    assert pool.open_connections == 1  # the timed-out connection was closed, not pooled


@pytest.mark.parametrize("answer, body, reusable", [
    pytest.param(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", b"hello", True, id="content-length"),
    pytest.param(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhe\r\n3\r\nllo\r\n0\r\n\r\n", b"hello",
                 True, id="chunked"),
    pytest.param(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nhello", b"hello", False, id="until-close"),
    pytest.param(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", b"ok", True,
                 id="interim-answer-first"),
])
async def test_answer_framings(make, answer: bytes, body: bytes, reusable: bool) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await engine.read_request(reader)
        writer.write(answer)
        if not reusable:
            writer.close()
            return
        await engine.read_request(reader)
        writer.write(answer)

    engine, pool, origin = await make(script)
    assert await get(pool, origin) == (200, body)
    assert pool.idle_connections(origin) == (1 if reusable else 0)
    assert await get(pool, origin) == (200, body)
    assert engine.accepted == (1 if reusable else 2)


async def test_head_answers_have_no_body(make) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 123\r\n\r\n")

    _engine, pool, origin = await make(script)
    resp = await pool.request(origin, b"HEAD", b"/health", b"")
    assert resp.status == 200 and resp.header(b"content-length") == b"123"
    assert await asyncio.wait_for(resp.read(), WAIT_S) == b""


async def test_an_abandoned_answer_closes_its_connection(make) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await engine.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        gone.set_result(await reader.read())  # b"": the router closed the connection

    gone: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
    engine, pool, origin = await make(script)
    resp = await pool.request(origin, b"POST", b"/x", b"", b"{}")
    assert await resp.read_chunk() == b"first"
    resp.close()
    assert await asyncio.wait_for(gone, WAIT_S) == b""
    assert pool.open_connections == 0


async def test_a_connection_cut_mid_answer_breaks(make) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await engine.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this")
        await writer.drain()
        writer.transport.abort()

    engine, pool, origin = await make(script)
    resp = await pool.request(origin, b"POST", b"/x", b"", b"{}")
    with pytest.raises(ConnectionBroke):
        await resp.read()
    resp.close()
    assert pool.open_connections == 0


async def test_the_connection_limit_queues_requests_first_come_first_served(make) -> None:
    gates: list[asyncio.Event] = []

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while True:
            req = await engine.read_request(reader)
            gate = asyncio.Event()
            gates.append(gate)
            await gate.wait()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(req.split(b"\r\n\r\n")[1]),
                                                                              req.split(b"\r\n\r\n")[1]))

    engine, pool, origin = await make(script, max_connections=1)
    first = asyncio.create_task(get(pool, origin, b"1"))
    await _until(lambda: len(gates) == 1)
    second = asyncio.create_task(get(pool, origin, b"2"))
    cancelled = asyncio.create_task(get(pool, origin, b"3"))
    await asyncio.sleep(0.05)
    assert engine.accepted == 1 and len(engine.requests) == 1  # the others wait for the one slot
    cancelled.cancel()
    gates[0].set()
    assert await first == (200, b"1")
    await _until(lambda: len(gates) == 2)
    gates[1].set()
    assert await second == (200, b"2")
    assert pool.open_connections == 1 and [r.split(b"\r\n\r\n")[1] for r in engine.requests] == [b"1", b"2"]


async def _until(predicate: Callable[[], bool]) -> None:
    async with asyncio.timeout(WAIT_S):
        while not predicate():
            await asyncio.sleep(0.01)


async def test_a_slow_reader_pauses_reading_from_the_engine_and_loses_nothing(make) -> None:
    piece = 65536
    pieces = 4 * STREAM_HIGH_WATER_BYTES // piece

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await engine.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (pieces * piece))
        for i in range(pieces):
            writer.write(bytes([i % 251]) * piece)
            await writer.drain()  # blocks while the router has stopped reading

    engine, pool, origin = await make(script)
    resp = await pool.request(origin, b"POST", b"/x", b"", b"{}")
    await _until(lambda: resp._conn._reading_paused)  # nothing read yet: past the high-water mark
    body = await resp.read()
    assert body == b"".join(bytes([i % 251]) * piece for i in range(pieces))
    assert pool.idle_connections(origin) == 1
