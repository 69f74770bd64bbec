"""The data plane's HTTP/1.1 server (``misat_router.downstream``) against raw sockets.

Each test speaks HTTP/1.1 bytes to a ``DataPlaneServer`` whose handler is written in the
test, so what is checked is the server itself: framing, keep-alive, pipelining, limits,
``Expect: 100-continue``, streaming and its back-pressure, and a client that leaves.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from misat_router.downstream import DataPlaneServer, IncomingRequest, Responder, ServerLimits
from misat_router.http_errors import http_error_body

WAIT_S = 5.0
MAX_BODY = 4096

Handler = Callable[[IncomingRequest, Responder], Awaitable[None]]


async def echo(req: IncomingRequest, out: Responder) -> None:
    """Answers with what it was sent: method, target, body, and one header."""
    body = json.dumps({"method": req.method.decode(), "target": req.target.decode(), "body": req.body.decode(),
                       "x": (req.header(b"x-test") or b"").decode(), "keep_alive": req.keep_alive}).encode()
    out.respond_json(200, body, [(b"X-Echo", b"1")])


class Served:
    def __init__(self, server: DataPlaneServer) -> None:
        self.server = server
        self.port = server.sockets[0].getsockname()[1]
        self.writers: list[asyncio.StreamWriter] = []

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A raw client connection, closed at the test's end if the test did not (an unclosed one
        is finalised later and could unregister a file descriptor reused meanwhile: docs/e2e.md)."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        self.writers.append(writer)
        return reader, writer


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., Awaitable[Served]]]:
    served: list[Served] = []

    async def make(handler: Handler = echo, **limits: object) -> Served:
        server = DataPlaneServer(handler, error_body=http_error_body, max_body_bytes=lambda: MAX_BODY,
                                 limits=ServerLimits(**limits))  # type: ignore[arg-type]
        await server.listen("127.0.0.1", 0, backlog=16)
        served.append(Served(server))
        return served[-1]

    yield make
    for one in served:
        for writer in one.writers:
            writer.close()
        await one.server.close()


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One answer: status, headers (lower-case names), body (Content-Length or chunked)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            k, _, v = line.partition(":")
            assert k.lower() not in headers, f"header {k} twice"
            headers[k.lower()] = v.strip()
    if "content-length" in headers:
        body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), WAIT_S)
    elif headers.get("transfer-encoding") == "chunked":
        parts = []
        while True:
            size = int((await asyncio.wait_for(reader.readuntil(b"\r\n"), WAIT_S)).strip(), 16)
            data = await asyncio.wait_for(reader.readexactly(size + 2), WAIT_S)
            if size == 0:
                break
            parts.append(data[:-2])
        body = b"".join(parts)
    else:
        body = await asyncio.wait_for(reader.read(), WAIT_S)
    return status, headers, body


def post(target: str, body: bytes, *extra: str, version: str = "1.1") -> bytes:
    lines = [f"POST {target} HTTP/{version}", "Host: x", f"Content-Length: {len(body)}", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def closed(reader: asyncio.StreamReader) -> bool:
    return await asyncio.wait_for(reader.read(), WAIT_S) == b""


async def test_keep_alive_answers_each_request_on_one_connection(serve) -> None:
    s = await serve()
    reader, writer = await s.connect()
    for i in range(3):
        writer.write(post("/v1/completions?x=1", b'{"i": %d}' % i, "X-Test: hello"))
        status, headers, body = await read_answer(reader)
        assert status == 200 and headers["x-echo"] == "1" and headers["content-type"] == "application/json"
        assert "date" in headers and "connection" not in headers
        assert json.loads(body) == {"method": "POST", "target": "/v1/completions?x=1", "body": f'{{"i": {i}}}',
                                    "x": "hello", "keep_alive": True}
    writer.close()


async def test_pipelined_requests_are_answered_in_order(serve) -> None:
    gates = [asyncio.Event(), asyncio.Event()]

    async def slow_first(req: IncomingRequest, out: Responder) -> None:
        if req.body == b"0":
            await gates[0].wait()  # the second request is parsed meanwhile, but must be answered after
        out.respond(200, [], req.body)

    s = await serve(slow_first)
    reader, writer = await s.connect()
    writer.write(post("/a", b"0") + post("/a", b"1"))
    await asyncio.sleep(0)
    gates[0].set()
    assert (await read_answer(reader))[2] == b"0"
    assert (await read_answer(reader))[2] == b"1"
    writer.close()


async def test_http10_without_keep_alive_is_answered_and_closed(serve) -> None:
    s = await serve()
    reader, writer = await s.connect()
    writer.write(post("/x", b"{}", version="1.0"))
    status, headers, _ = await read_answer(reader)
    assert status == 200 and headers["connection"] == "close"
    assert await closed(reader)


async def test_http10_keep_alive_is_kept(serve) -> None:
    s = await serve()
    reader, writer = await s.connect()
    for _ in range(2):
        writer.write(post("/x", b"{}", "Connection: keep-alive", version="1.0"))
        status, headers, _ = await read_answer(reader)
        assert status == 200 and headers["connection"] == "keep-alive"
    writer.close()


async def test_chunked_request_body_is_decoded(serve) -> None:
    s = await serve()
    reader, writer = await s.connect()
    writer.write(b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                 b"3\r\nabc\r\n4\r\ndefg\r\n0\r\n\r\n")
    status, _, body = await read_answer(reader)
    assert status == 200 and json.loads(body)["body"] == "abcdefg"
    writer.close()


async def test_expect_100_continue_is_answered_before_the_body_is_sent(serve) -> None:
    s = await serve()
    reader, writer = await s.connect()
    writer.write(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n")
    interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
    assert interim.startswith(b"HTTP/1.1 100 Continue")
    writer.write(b"{}")
    status, _, body = await read_answer(reader)
    assert status == 200 and json.loads(body)["body"] == "{}"
    writer.close()


@pytest.mark.parametrize("request_bytes, status, code", [
    pytest.param(post("/x", b"x" * (MAX_BODY + 1)), 413, "body_too_large", id="content-length-over-limit"),
    pytest.param(b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                 + (b"400\r\n" + b"x" * 1024 + b"\r\n") * 5, 413, "body_too_large", id="chunked-over-limit"),
    pytest.param(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\nExpect: 100-continue\r\n\r\n",
                 413, "body_too_large", id="expect-continue-over-limit"),
    pytest.param(b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414, "uri_too_long", id="long-target"),
    pytest.param(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n", 431, "header_too_large",
                 id="long-header"),
    pytest.param(b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(200)) + b"\r\n", 431,
                 "too_many_headers", id="too-many-headers"),
    pytest.param(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: magic\r\n\r\n{}", 417,
                 "expectation_failed", id="unknown-expectation"),
    pytest.param(b"NOT HTTP AT ALL\r\n\r\n", 400, "bad_request", id="garbage"),
    pytest.param(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n", 400,
                 "upgrade_not_supported", id="upgrade"),
    pytest.param(b"POST /x HTTP/1.1\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n", 400, "bad_request",
                 id="length-and-chunked"),
])
async def test_refusals_carry_an_error_body_and_close(serve, request_bytes: bytes, status: int, code: str) -> None:
    refused = []
    s = await serve()
    s.server.on_refused = lambda: refused.append(1)
    reader, writer = await s.connect()
    writer.write(request_bytes)
    got, headers, body = await read_answer(reader)
    assert got == status
    assert headers["connection"] == "close" and headers["content-type"] == "application/json"
    error = json.loads(body)["error"]
    assert error["code"] == code and error["message"]
    assert await closed(reader)
    assert refused == [1]


async def test_a_client_that_leaves_cancels_its_handler(serve) -> None:
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def waits(req: IncomingRequest, out: Responder) -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    s = await serve(waits)
    _reader, writer = await s.connect()
    writer.write(post("/x", b"{}"))
    await asyncio.wait_for(started.wait(), WAIT_S)
    writer.close()
    await asyncio.wait_for(cancelled.wait(), WAIT_S)
    await asyncio.wait_for(_until(lambda: not s.server.connections), WAIT_S)


async def _until(predicate: Callable[[], bool]) -> None:
    while not predicate():
        await asyncio.sleep(0.01)


async def test_streams_are_chunked_and_http10_streams_end_with_the_connection(serve) -> None:
    async def stream(req: IncomingRequest, out: Responder) -> None:
        out.start_stream(200, [(b"Content-Type", b"text/event-stream")])
        for i in range(3):
            await out.write(b"data: %d\n\n" % i)
        out.end_stream()

    s = await serve(stream)
    reader, writer = await s.connect()
    writer.write(post("/x", b"{}"))
    status, headers, body = await read_answer(reader)
    assert status == 200 and headers["transfer-encoding"] == "chunked"
    assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    writer.write(post("/x", b"{}", version="1.0"))  # the connection is still usable; this one closes it
    status, headers, body = await read_answer(reader)
    assert "transfer-encoding" not in headers and headers["connection"] == "close"
    assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"


async def test_a_stream_waits_while_the_client_does_not_read(serve) -> None:
    chunk = b"x" * 65536
    progress: list[int] = []
    done = asyncio.Event()

    async def big(req: IncomingRequest, out: Responder) -> None:
        conn = out._conn
        assert conn.transport is not None
        conn.transport.set_write_buffer_limits(high=65536)
        out.start_stream(200, [])
        for i in range(64):  # 4 MiB: far more than socket buffers hold
            await out.write(chunk)
            progress.append(i)
        out.end_stream()
        done.set()

    s = await serve(big)
    reader, writer = await s.connect()
    writer.write(post("/x", b"{}"))
    await asyncio.wait_for(_until(lambda: bool(progress)), WAIT_S)
    await asyncio.sleep(0.2)  # the handler is now blocked on the unread socket, not done
    assert not done.is_set() and len(progress) < 64
    _, _, body = await read_answer(reader)
    assert len(body) == 64 * len(chunk) and done.is_set()
    writer.close()


@pytest.mark.parametrize("started", [False, True], ids=["before-the-answer", "mid-stream"])
async def test_a_failing_handler_gets_a_500_or_a_cut_connection(serve, started: bool) -> None:
    async def fails(req: IncomingRequest, out: Responder) -> None:
        if started:
            out.start_stream(200, [])
            await out.write(b"partial")
        raise RuntimeError("bug")

    s = await serve(fails)
    reader, writer = await s.connect()
    writer.write(post("/x", b"{}"))
    if not started:
        status, _, body = await read_answer(reader)
        assert status == 500 and json.loads(body)["error"]["code"] == "internal_error"
        writer.close()
    else:
        data = await asyncio.wait_for(reader.read(), WAIT_S)
        assert data.startswith(b"HTTP/1.1 200") and not data.endswith(b"0\r\n\r\n")  # no clean end


async def test_idle_keep_alive_connections_are_closed(serve) -> None:
    s = await serve(keepalive_timeout_s=0.05)
    reader, writer = await s.connect()
    writer.write(post("/x", b"{}"))
    await read_answer(reader)
    assert await closed(reader)  # by the next sweep (once a second)
