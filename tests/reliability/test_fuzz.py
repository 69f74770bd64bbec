"""Hostile input against the router's HTTP surface (hypothesis).

A router (MISA-T) in front of a small fake engine, both on loopback, driven from one
persistent client session on a private event loop so that each hypothesis example costs
about a millisecond. Every example sends a batch of malformed or adversarial requests:
bad JSON, wrong types, huge and negative numbers, non-finite floats, invalid UTF-8, deep
nesting, 4300+ digit integers, unknown classes and rollout keys, header/body
disagreements, one session id used across classes, unknown paths and methods, admin
calls with forged tokens, bodies over the limit. A second test writes raw bytes on the
socket (header injection, obs-fold, NUL bytes, smuggling-style framing, invalid UTF-8 in
headers), which an HTTP client library would refuse to send.

Every answer must be: not a 5xx of the router's own (an engine's 5xx passes through and
carries ``X-Misat-Engine``), and, for every router error, the OpenAI error shape. After
the run nothing leaks: every hold, in-flight request and session is released.

Volume: each hypothesis example draws up to ``BATCH`` structured requests and sends each
with ``MUTANTS`` cheap byte- and field-level mutants (drawing costs milliseconds, mutating
microseconds). By default about 3,000 HTTP-client requests plus about 900 raw ones
(~15 s); ``-m "slow or not slow"`` adds the x10 run, about 33,000 in all. Figures and
commands: docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from misat_router.app import create_app
from misat_router.service import RouterService, start_service
from misat_router.state import STATE
from tests.support.fake_engine import FakeEngine

from .conftest import MODEL, is_openai_error, policy_books, router_config

TOKEN = "fuzz-admin-token-0b7e"
CLASSES = ["rlvr", "rlhf", "agentic"]
MAX_BODY = 256 * 1024
BATCH = 4
FUZZ_EXAMPLES = int(os.environ.get("MISAT_FUZZ_EXAMPLES", "150"))
"""Hypothesis examples of the HTTP-client fuzz (each a batch of up to ``BATCH`` requests)."""
RAW_EXAMPLES = int(os.environ.get("MISAT_FUZZ_RAW_EXAMPLES", "100"))


# ---- the target: engine + router on a private loop -------------------------------------


def fuzz_engine() -> FakeEngine:
    """The engine behind the router: answers anything (one token), a 500 for bodies saying
    ``engine-500``; roomy and idle, so that admission never has to hold fuzz traffic for long."""
    engine = FakeEngine("fuzz", model=MODEL, num_gpu_blocks=10_000_000, running=0, kv_usage=0.0,
                        max_answer_tokens=1, client_max_size=64 * 1024 * 1024)
    engine.fail_marker = b"engine-500"
    return engine


@dataclass
class Target:
    loop: asyncio.AbstractEventLoop
    url: str = ""
    port: int = 0
    app: web.Application | None = None
    http: aiohttp.ClientSession | None = None
    engine: FakeEngine | None = None
    routers: list[RouterService] = field(default_factory=list)
    sent: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)

    def run(self, coro: Any) -> Any:
        """Run ``coro`` on the target's loop, which runs in its own thread all along (so the
        router's health checks and epochs keep going while hypothesis generates input)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=120)

    async def start(self) -> None:
        self.engine = fuzz_engine()
        await self.engine.start()
        cfg = router_config(
            [self.engine.url], max_body_bytes=MAX_BODY, hold_deadline_s=5.0,
            policy_settings={"footprint": {"bootstrap_tokens": 64},
                             "admission": {"epoch_s": 0.05, "session_idle_timeout_s": 0.5}},
        )
        self.app = create_app(cfg, admin_token=TOKEN)
        router = await start_service(self.app)  # as `misat router` serves
        self.port = router.port
        self.url = router.url
        self.routers = [router]
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=32))
        state = self.app[STATE]
        await state.wait_until(lambda: state.registry.healthy_count() == 1, 10.0)

    async def stop(self) -> None:
        assert self.http is not None
        await self.http.close()
        for r in self.routers:
            await r.stop()
        if self.engine is not None:
            await self.engine.close()


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    t = Target(asyncio.new_event_loop())
    thread = threading.Thread(target=t.loop.run_forever, name="fuzz-target", daemon=True)
    thread.start()
    try:
        t.run(t.start())
        yield t
        t.run(t.stop())
    finally:
        t.loop.call_soon_threadsafe(t.loop.stop)
        thread.join(10)
        t.loop.close()


def check_answer(status: int, headers: Any, body: bytes, what: str) -> None:
    from_engine = "X-Misat-Engine" in headers
    assert status < 500 or from_engine, f"router {status} for {what}: {body[:300]!r}"
    if status >= 400 and not from_engine:
        try:
            obj = json.loads(body)
        except ValueError:
            raise AssertionError(f"router {status} not JSON for {what}: {body[:300]!r}") from None
        assert is_openai_error(obj), f"router {status} not OpenAI-shaped for {what}: {obj}"


# ---- strategies ---------------------------------------------------------------------------

ints = st.one_of(st.integers(-3, 5000), st.integers(), st.sampled_from([0, -1, 2**31, 2**63, -(2**63), 10**30]))
floats = st.floats(allow_nan=True, allow_infinity=True)
texts = st.text(max_size=40)
header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x2FFF, blacklist_categories=("Cs", "Cc")),
                      max_size=30)  # what an HTTP client sends; control bytes go through the raw-socket test
scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts)
json_values = st.recursive(scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(texts, c, max_size=4),
                           max_leaves=12)
class_names = st.one_of(st.sampled_from([*CLASSES, "RLVR", "nope", "", " rlvr", "rlvr\x00"]), json_values)
session_ids = st.one_of(st.sampled_from(["s-1", "s-2", "shared"]), texts, json_values)
prompts = st.one_of(
    texts, st.just("engine-500 please"), st.lists(ints, max_size=12), st.lists(st.lists(ints, max_size=4), max_size=3),
    st.lists(texts, max_size=3), st.just([]), st.just([[]]), json_values,
)
messages = st.one_of(
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]) | json_values},
                                   optional={"content": st.one_of(texts, json_values,
                                                                  st.lists(st.fixed_dictionaries(
                                                                      {"type": st.just("text"), "text": texts}),
                                                                      max_size=2)),
                                             "tool_calls": json_values}), max_size=3),
    json_values,
)
rollouts = st.one_of(
    json_values,
    st.fixed_dictionaries({}, optional={"class": class_names, "session_id": session_ids,
                                        "turn": st.one_of(ints, texts, json_values),
                                        "end": st.one_of(st.booleans(), texts, json_values),
                                        "sneaky": json_values}),
)
request_objects = st.fixed_dictionaries({}, optional={
    "model": st.one_of(st.just("sim-tiny"), json_values),
    "prompt": prompts,
    "messages": messages,
    "max_tokens": st.one_of(ints, floats, texts, st.none()),
    "max_completion_tokens": st.one_of(ints, floats, st.none()),
    "stream": st.one_of(st.booleans(), st.none(), json_values),
    "stream_options": json_values,
    "rollout": rollouts,
    "temperature": json_values,
})


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["object", "object", "object", "any-json", "binary", "bad-utf8", "truncated",
                                 "big-int", "deep", "huge-float", "over-limit"]))
    if kind == "object":
        return json.dumps(draw(request_objects)).encode()
    if kind == "any-json":
        return json.dumps(draw(json_values)).encode()
    if kind == "binary":
        return draw(st.binary(max_size=64))
    if kind == "bad-utf8":
        good = json.dumps(draw(request_objects)).encode()
        cut = draw(st.integers(0, len(good)))
        return good[:cut] + draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80\x80"])) + good[cut:]
    if kind == "truncated":
        good = json.dumps(draw(request_objects)).encode()
        return good[: draw(st.integers(0, max(0, len(good) - 1)))]
    if kind == "big-int":
        field_name = draw(st.sampled_from(["max_tokens", "prompt", "turn"]))
        digits = b"9" * draw(st.sampled_from([19, 309, 4301, 20000]))
        if field_name == "prompt":
            return b'{"prompt": [' + digits + b'], "rollout": {"class": "rlvr"}}'
        if field_name == "turn":
            return b'{"prompt": [1], "rollout": {"class": "agentic", "session_id": "b", "turn": ' + digits + b"}}"
        return b'{"prompt": [1], "max_tokens": ' + digits + b', "rollout": {"class": "rlvr"}}'
    if kind == "deep":
        depth = draw(st.sampled_from([100, 900, 995, 5000, 200_000]))
        where = draw(st.sampled_from(["prompt", "rollout", "messages", "top"]))
        nest = b"[" * depth + b"]" * depth
        if where == "top":
            return nest
        if where == "messages":
            return (b'{"messages": [{"role": "user", "content": "x", "tool_calls": ' + nest
                    + b'}], "rollout": {"class": "rlvr"}}')
        return b'{"' + where.encode() + b'": ' + nest + b', "model": "m"}'
    if kind == "huge-float":
        return b'{"prompt": [1], "max_tokens": 1e999, "temperature": -1e999, "rollout": {"class": "rlvr"}}'
    return b'{"prompt": "' + b"x" * (MAX_BODY + draw(st.integers(1, 4096))) + b'"}'


rollout_headers = st.fixed_dictionaries({}, optional={
    "X-Rollout-Class": st.one_of(st.sampled_from(CLASSES), header_text),
    "X-Session-Id": st.one_of(st.sampled_from(["s-1", "s-2", "shared", ""]), header_text),
    "X-Session-Turn": st.one_of(st.sampled_from(["0", "1", "-1", "1.5", " 2 ", "9" * 5000, "", "٣"]), header_text),
    "X-Session-End": st.one_of(st.sampled_from(["true", "no", "1", "maybe", ""]), header_text),
    "Content-Type": st.sampled_from(["application/json", "text/plain", "multipart/form-data; boundary=x", ""]),
    "Authorization": st.one_of(st.just(f"Bearer {TOKEN}"), st.just(f"Bearer {TOKEN}x"), header_text),
    "Accept-Encoding": st.sampled_from(["gzip", "br", "identity", "*"]),
    "Content-Encoding": st.sampled_from(["gzip", "deflate", "br"]),
})
paths = st.one_of(
    st.sampled_from([("POST", "/v1/completions")] * 6 + [("POST", "/v1/chat/completions")] * 4),
    st.sampled_from([("POST", "/v1/completions"), ("POST", "/v1/chat/completions")]),
    st.sampled_from([("POST", "/v1/completions"), ("POST", "/v1/chat/completions")]),
    st.sampled_from([("GET", "/v1/completions"), ("GET", "/v1/models"), ("POST", "/tokenize"),
                     ("PUT", "/admin/config"), ("GET", "/admin/config"), ("POST", "/admin/resume"),
                     ("GET", "/status"), ("GET", "/metrics"), ("GET", "/ready"), ("DELETE", "/v1/completions"),
                     ("POST", "/v1/../admin/config"), ("GET", "/nope"), ("POST", "/v1/completions/"),
                     ("POST", "/v1/sessions/shared/end"), ("POST", "/v1/sessions/%00%ff/end")]),
    st.tuples(st.just("POST"), st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=20)
              .map(lambda p: "/v1/sessions/" + p + "/end")),
)


@dataclass(frozen=True)
class Req:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


adversarial_requests = st.builds(lambda mp, h, b: Req(mp[0], mp[1], h, b), paths, rollout_headers, bodies())


@st.composite
def plausible_requests(draw: st.DrawFn) -> Req:
    """Well-formed enough to be admitted and forwarded, with odd but legal values."""
    chat = draw(st.booleans())
    obj: dict[str, Any] = {"model": "sim-tiny",
                           "max_tokens": draw(st.one_of(st.integers(1, 64), st.just(10**30), st.none())),
                           "stream": draw(st.booleans())}
    if obj["stream"] and draw(st.booleans()):
        obj["stream_options"] = {"include_usage": True}
    if chat:
        obj["messages"] = [{"role": "user", "content": draw(st.one_of(texts, st.just("engine-500")))}]
    else:
        obj["prompt"] = draw(st.one_of(texts.filter(bool), st.lists(st.integers(0, 2**40), min_size=1, max_size=30)))
    cls = draw(st.sampled_from(CLASSES))
    sid = draw(st.one_of(st.none(), st.sampled_from(["s-1", "s-2", "shared"]), header_text.filter(str.strip)))
    rollout: dict[str, Any] = {"class": cls}
    if sid is not None:
        rollout |= {"session_id": sid, "turn": draw(st.integers(0, 3)), "end": draw(st.booleans())}
    headers: dict[str, str] = {}
    if draw(st.booleans()):
        obj["rollout"] = rollout
    else:
        headers = {"X-Rollout-Class": cls}
        if sid is not None:
            headers |= {"X-Session-Id": sid, "X-Session-Turn": str(rollout["turn"]),
                        "X-Session-End": str(rollout["end"]).lower()}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return Req("POST", path, headers, json.dumps(obj).encode())


requests_ = st.one_of(adversarial_requests, plausible_requests())

# ---- cheap mutations: each hypothesis-drawn request is sent with MUTANTS variants -----------
# (drawing a structured request costs milliseconds; a byte- or field-level mutation of it
# microseconds, so most of the volume comes from here, seeded by hypothesis's Random.)

MUTANTS = 7
SPLICES = [b"\xff", b"\x00", b'"', b"{", b"]", b",", b"1e999", b"-0", b"NaN", b"\\ud800", b'"\\u0000"',
           b"9" * 400, b"[" * 50, b'{"rollout":']
FIELD_VALUES: list[object] = [None, True, -1, 0, 2**64, 1.5, "x", "", [], {}, [[]], "rlvr", "agentic", "nope",
                              float("nan"), 10**100, {"class": "agentic", "session_id": "shared", "turn": 1}]
FIELDS = ["model", "prompt", "messages", "max_tokens", "stream", "stream_options", "rollout"]
ROLLOUT_FIELDS = ["class", "session_id", "turn", "end", "other"]


def mutate(req: Req, rnd: random.Random) -> Req:
    body, headers = req.body, dict(req.headers)
    op = rnd.randrange(7)
    if op == 0 and body:
        i = rnd.randrange(len(body))
        body = body[:i] + bytes([body[i] ^ rnd.randrange(1, 256)]) + body[i + 1:]
    elif op == 1:
        body = body[: rnd.randrange(len(body) + 1)]
    elif op == 2:
        i = rnd.randrange(len(body) + 1)
        body = body[:i] + rnd.choice(SPLICES) + body[i:]
    elif op in (3, 4):
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError):
            obj = {}
        if not isinstance(obj, dict):
            obj = {"prompt": obj}
        if op == 3:
            obj[rnd.choice(FIELDS)] = rnd.choice(FIELD_VALUES)
        else:
            ro = obj.get("rollout")
            ro = ro if isinstance(ro, dict) else {}
            ro[rnd.choice(ROLLOUT_FIELDS)] = rnd.choice(FIELD_VALUES)
            obj["rollout"] = ro
        body = json.dumps(obj).encode()
    elif op == 5:  # one session id, several classes (and turns)
        headers["X-Session-Id"] = "shared"
        headers["X-Rollout-Class"] = rnd.choice(CLASSES)
        headers["X-Session-Turn"] = str(rnd.randrange(3))
    else:
        key = rnd.choice(["X-Rollout-Class", "X-Session-Id", "X-Session-Turn", "X-Session-End", "Authorization"])
        if key in headers and rnd.random() < 0.5:
            del headers[key]
        else:
            headers[key] = rnd.choice(["rlvr", "agentic", "", "0", "-1", "true", f"Bearer {TOKEN}", "x" * 100])
    return Req(req.method, req.path, headers, body)


def with_mutants(batch: list[Req], rnd: random.Random) -> list[Req]:
    return [m for r in batch for m in (r, *(mutate(r, rnd) for _ in range(MUTANTS)))]


async def send(t: Target, req: Req) -> None:
    assert t.http is not None
    t.sent["http"] += 1
    try:
        async with t.http.request(req.method, t.url + req.path, headers=req.headers, data=req.body,
                                  skip_auto_headers=("Content-Type",)) as resp:
            body = await resp.read()
            t.statuses[resp.status] += 1
            check_answer(resp.status, resp.headers, body, f"{req.method} {req.path} {req.headers} {req.body[:200]!r}")
    except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError) as exc:
        # The router may refuse an over-limit body before the client finished sending it.
        assert len(req.body) > MAX_BODY, f"connection dropped for {req}: {exc!r}"


def fuzz_settings(examples: int, *, explore: bool = False) -> settings:
    # `make test` replays the same derandomized examples every run (a CI failure is then
    # reproducible); the slow run explores new ones each time.
    return settings(max_examples=examples, deadline=None, database=None, derandomize=not explore,
                    suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("scale", [pytest.param(1, id="default"),
                                   pytest.param(10, id="x10", marks=pytest.mark.slow)])
def test_fuzz_http_surface(target: Target, scale: int) -> None:
    @fuzz_settings(FUZZ_EXAMPLES * scale, explore=scale > 1)
    @given(st.lists(requests_, min_size=1, max_size=BATCH), st.randoms(use_true_random=False))
    def run(batch: list[Req], rnd: random.Random) -> None:
        async def go() -> None:
            await asyncio.gather(*(send(target, r) for r in with_mutants(batch, rnd)))
        target.run(go())

    run()


# ---- raw bytes on the socket -------------------------------------------------------------

header_lines = st.sampled_from([
    b"X-Rollout-Class: rlvr", b"X-Rollout-Class: rlvr\r\nX-Rollout-Class: agentic",
    b"X-Rollout-Class: rlvr\r\n\tagentic",  # obs-fold
    b"X-Session-Id: a\x00b", b"X-Session-Id: \xff\xfe\xfd", b"X-Rollout-Class: \xc3\xa9",
    b"X-Session-Turn: 1\rX-Injected: 1", b"X-Session-Turn: 1\nX-Injected: 1",
    b"Authorization: Bearer " + TOKEN.encode() + b"\x00", b"Authorization: Bearer \xff" + TOKEN.encode(),
    b"Transfer-Encoding: chunked", b"Transfer-Encoding: gzip, chunked", b"Content-Length: 5\r\nContent-Length: 6",
    b"Content-Length: -1", b"Content-Length: 99999999999999999999", b"Content-Length: abc",
    b"Expect: 100-continue", b"Host:", b": novalue", b"NoColon", b"X-A: " + b"a" * 9000,
    b"Connection: keep-alive, Upgrade\r\nUpgrade: websocket",
])
request_lines = st.sampled_from([
    b"POST /v1/completions HTTP/1.1", b"POST /v1/chat/completions HTTP/1.1", b"POST /v1/completions HTTP/1.0",
    b"POST /v1/completions HTTP/2.0", b"POST  /v1/completions HTTP/1.1", b"POST /v1/completions",
    b"GET /v1/models?x=\xff HTTP/1.1", b"POST /admin/pause HTTP/1.1", b"PUT /admin/config HTTP/1.1",
    b"POST http://evil.example/v1/completions HTTP/1.1", b"POST /v1/sessions/\xff\xfe/end HTTP/1.1",
    b"BREW /coffee HTCPCP/1.0", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",
])


@st.composite
def raw_requests(draw: st.DrawFn) -> bytes:
    line = draw(request_lines)
    lines = [b"Host: router"] + draw(st.lists(header_lines, max_size=4))
    body = draw(st.one_of(st.just(b'{"prompt": [1, 2], "model": "m"}'), bodies()))
    body = body[:4096]
    if draw(st.booleans()):
        lines.append(b"Content-Length: " + str(len(body)).encode())
    lines.append(b"Connection: close")
    return line + b"\r\n" + b"\r\n".join(lines) + b"\r\n\r\n" + body


async def send_raw(t: Target, data: bytes) -> None:
    t.sent["raw"] += 1
    reader, writer = await asyncio.open_connection("127.0.0.1", t.port)
    try:
        writer.write(data)
        if writer.can_write_eof():
            writer.write_eof()
        async with asyncio.timeout(10.0):
            answer = await reader.read()
    except ConnectionResetError:
        return  # the parser gave up on the connection: refused, no crash
    finally:
        writer.close()
    if not answer:
        return
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *header_lines_ = head.split(b"\r\n")
    status = int(status_line.split(b" ")[1])
    headers = {k.strip().decode("latin-1"): v.strip().decode("latin-1")
               for k, _, v in (h.partition(b":") for h in header_lines_)}
    if status >= 400 and headers.get("Content-Type", "").startswith("text/plain"):
        # aiohttp's HTTP parser refused the request before any router code ran (documented).
        assert status < 500, f"parser {status} for {data[:200]!r}: {body[:200]!r}"
        return
    if headers.get("Transfer-Encoding") == "chunked":
        return  # a relayed stream (engine answer); its status was checked above
    check_answer(status, headers, body, repr(data[:300]))


def test_fuzz_raw_socket(target: Target) -> None:
    @fuzz_settings(RAW_EXAMPLES)
    @given(st.lists(raw_requests(), min_size=1, max_size=BATCH), st.randoms(use_true_random=False))
    def run(batch: list[bytes], rnd: random.Random) -> None:
        mutants = [d[:i] + rnd.choice(SPLICES + [b"\r\n", b"\r\n\r\n", b":"]) + d[i:]
                   for d in batch for i in (rnd.randrange(len(d) + 1) for _ in range(3))]

        async def go() -> None:
            await asyncio.gather(*(send_raw(target, d) for d in batch + mutants))
        target.run(go())

    run()


def test_after_the_fuzz_nothing_leaked(target: Target) -> None:
    """Runs last in this module: every request ended, every session can be ended, books are zero."""
    assert target.app is not None
    state = target.app[STATE]

    async def drain() -> None:
        await state.wait_until(lambda: not state.dispatcher.in_flight and state.runner.held_count() == 0, 10.0)
        for key in list(state.runner.sessions):
            state.dispatcher.end_session(key)
        async with target.http.get(target.url + "/status") as resp:  # type: ignore[union-attr]
            assert resp.status == 200
            status = await resp.json()
        assert status["requests_in_flight"] == 0 and status["held_requests"] == 0
        assert all(c["active_sessions"] == 0 for c in status["classes"])
        async with target.http.get(target.url + "/metrics") as resp:  # type: ignore[union-attr]
            assert resp.status == 200

    target.run(drain())
    books = policy_books(state)
    assert books["load_total"] == 0 and books["engine_sessions"] == {} and books["class_sessions"] == {}, books
    assert books["class_known_tokens"] == {} and books["sessions"] == 0 and books["held_ids"] == 0, books
    total = sum(target.sent.values())
    print(f"fuzz: {dict(target.sent)} requests, {total} in all; statuses {dict(sorted(target.statuses.items()))}")
    assert total >= FUZZ_EXAMPLES  # the suite really ran
    assert target.statuses[200] > 0 and target.statuses[400] > 0
