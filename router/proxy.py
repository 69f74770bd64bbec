"""The OpenAI-compatible endpoints: admit, forward, relay, and report the completion.

``/v1/completions`` and ``/v1/chat/completions``:

1. read the body (bounded by ``max_body_bytes``) and parse the rollout
   metadata (``request_meta.py``); a malformed request never reaches a policy;
2. ``Dispatcher.admit``: placed at once, or held until an epoch places it;
3. forward to the engine; a connection failure before any byte went to the
   client takes the engine out of rotation and places the request again
   (at most ``max_placement_attempts`` engines);
4. relay the answer unchanged: status, end-to-end headers, body bytes, and
   for streams each chunk as it arrives (SSE framing intact);
5. ``runner.finish`` with the usage the engine reported: ``usage`` of a JSON
   answer, or of the final usage chunk of a stream (``stream_options.
   include_usage``). Without usage the router estimates: prompt tokens from
   the request, completion tokens = streamed content events (about one token
   each in vLLM), or 0 for a JSON answer without usage.

A client that goes away (handler cancelled) while held or streaming releases
its ledger entry or its placement, and the upstream connection is closed so
the engine aborts the request. If the engine breaks mid-stream the client
gets an SSE error event and the stream ends.

``/v1/models`` and ``/tokenize`` go to any healthy engine, no admission.
``POST /v1/sessions/{id}/end`` ends a multi-turn session explicitly.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from .errors import BodyTooLarge, InvalidRequest, NotFound, ShuttingDown, UpstreamUnavailable, openai_error_body
from .metrics import Outcome
from .policy.types import Completion, RequestMeta
from .request_meta import EndpointKind, ParsedRequest, parse_request
from .state import STATE, RouterState
from .usage import SseUsageTracker, usage_from_json

log = logging.getLogger(__name__)

ENGINE_HEADER = "X-Misat-Engine"
"""Response header naming the engine that served the request."""
ABORT_HEADER = "X-Misat-Abort"
WARNING_HEADER = "X-Misat-Warning"
"""On answers to requests accepted as written but probably not meant so (ParsedRequest.warning)."""
"""On an answer the router itself aborted (``router``): output the engine had made was lost."""
COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
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
"""Upstream errors that mean the engine is unreachable or its connection broke: before any
byte reached the client the request is placed again elsewhere; the engine leaves rotation."""

READ_FAILURES = (aiohttp.ClientError, TimeoutError)

STALE_CONNECTION = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)
"""A pooled keep-alive connection the engine closed while idle (vLLM's uvicorn does after a few
seconds) fails the next request this way; it says nothing about the engine's health, so the
request is sent once more on a fresh connection before the engine is counted as failed."""


_NOT_FORWARDED = HOP_BY_HOP | {"accept-encoding"}
"""Request headers the router does not pass upstream (it sets ``Accept-Encoding`` itself)."""


def _forward_headers(headers: Mapping[str, str]) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in headers.items():
        if k.lower() not in _NOT_FORWARDED:
            out.add(k, v)
    # Byte-for-byte relay and usage parsing both need an uncompressed body.
    out["Accept-Encoding"] = "identity"
    return out


def _response_headers(headers: Mapping[str, str], engine_id: str, warning: str | None = None) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in headers.items():
        if k.lower() not in HOP_BY_HOP:
            out.add(k, v)
    out[ENGINE_HEADER] = engine_id
    if warning is not None:
        out[WARNING_HEADER] = warning
    return out


async def _end_stream(resp: web.StreamResponse, tracker: SseUsageTracker, data: bytes) -> None:
    """Write the last events of a relayed stream and close it; a client already gone is fine.
    Cut mid-event, the engine's partial event is terminated first so ``data`` parses on its own."""
    if tracker.mid_event:
        data = b"\n\n" + data
    try:
        await resp.write(data)
        await resp.write_eof()
    except ConnectionError:
        pass


async def read_body(request: web.Request, limit: int) -> bytes:
    """The request body, refused (``BodyTooLarge``) past ``limit`` bytes without reading it all."""
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


def sse_error_event(message: str) -> bytes:
    body = openai_error_body(message, "upstream_error", code="engine_stream_broken")
    return b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"


# ---- forwarding -----------------------------------------------------------


class _RetryElsewhere(Exception):
    """The attempt failed before any byte reached the client."""


@dataclass(slots=True)
class Forwarder:
    """One admitted request's trip to an engine and back."""

    state: RouterState
    request: web.Request
    parsed: ParsedRequest
    path: str
    arrived: float
    aborted: bool = False
    """Set by ``abort``: the admin API aborted this request (``/admin/pause?mode=abort``)."""
    _task: asyncio.Task[object] | None = None

    async def run(self) -> web.StreamResponse:
        self._task = asyncio.current_task()
        s = self.state
        meta = self.parsed.meta
        deadline_at = self.arrived + s.config.hold_deadline_s
        held_total = 0.0
        for attempt in range(1, s.config.max_placement_attempts + 1):
            remaining = max(0.0, deadline_at - s.clock())
            engine, held_s = await s.dispatcher.admit(meta, remaining)
            held_total += held_s
            if attempt == 1:
                s.metrics.overhead.observe(max(0.0, s.clock() - self.arrived - held_total))
            try:
                return await self._attempt(engine)
            except _RetryElsewhere:
                continue
        raise UpstreamUnavailable(
            f"no engine answered after {s.config.max_placement_attempts} attempts",
            code="upstream_unavailable",
        )

    def _timeout(self) -> aiohttp.ClientTimeout:
        cfg = self.state.config
        return upstream_timeout(cfg.upstream_connect_timeout_s, cfg.upstream_timeout_s)

    def _engine_failed(self, engine: str, exc: BaseException) -> None:
        s = self.state
        s.metrics.engine_failures.labels(engine).inc()
        s.registry.mark_failed(engine, f"{type(exc).__name__}: {exc}")

    async def _open(self, engine: str) -> aiohttp.ClientResponse:
        """POST upstream; a connection found closed by the engine is retried once, fresh."""
        session = self.state.session()
        for retry in (False, True):
            try:
                return await session.post(
                    engine + self.path,
                    data=self.parsed.body,
                    headers=_forward_headers(self.request.headers),
                    timeout=self._timeout(),
                )
            except STALE_CONNECTION:
                if retry:
                    raise
        raise AssertionError("unreachable")

    def abort(self) -> None:
        """End the request now with vLLM's abort answer (``finish_reason: "abort"``): used when the
        engine could not abort it itself. Cancels the forwarding task, whose handlers answer."""
        if not self.aborted and self._task is not None:
            self.aborted = True
            self._task.cancel()

    def _take_abort(self, engine: str, completion: Completion) -> bool:
        """On a cancellation: True when it was ``abort`` alone (not also the client leaving), in
        which case the request is finished here and the caller answers the client."""
        if not self.aborted or self._task is None or self._task.uncancel() > 0:
            return False
        meta = self.parsed.meta
        self.state.metrics.aborted.labels(meta.workload_class, "router").inc()
        self.state.dispatcher.finish(meta, engine, completion, Outcome.ABORTED)
        return True

    def _abort_choices(self, skip: set[int], *, stream: bool) -> list[dict[str, object]]:
        chat = self.path == CHAT_PATH
        out: list[dict[str, object]] = []
        for i in range(self.parsed.meta.samples):
            if i in skip:
                continue
            c: dict[str, object] = {"index": i, "logprobs": None, "finish_reason": "abort", "stop_reason": None}
            if chat:
                c["delta" if stream else "message"] = {} if stream else {"role": "assistant", "content": ""}
            else:
                c["text"] = ""
            out.append(c)
        return out

    def _abort_usage(self, completion_tokens: int) -> dict[str, int]:
        prompt = self.parsed.meta.prompt_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                "total_tokens": prompt + completion_tokens}

    def _abort_answer(self, engine: str) -> web.Response:
        """A JSON answer for a request aborted before the engine answered: no output reached the
        router, so every choice is empty (``X-Misat-Abort: router`` says so)."""
        chat = self.path == CHAT_PATH
        body = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{self.parsed.meta.request_id}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self._model(),
            "choices": self._abort_choices(set(), stream=False),
            "usage": self._abort_usage(0),
        }
        return web.json_response(body, headers={ENGINE_HEADER: engine, ABORT_HEADER: "router"})

    def _model(self) -> str:
        try:
            obj = json.loads(self.parsed.body)
        except (ValueError, RecursionError):
            obj = None
        model = obj.get("model") if isinstance(obj, dict) else None
        return model if isinstance(model, str) else self.state.config.model

    def _include_usage(self) -> bool:
        try:
            obj = json.loads(self.parsed.body)
        except (ValueError, RecursionError):
            return False
        opts = obj.get("stream_options") if isinstance(obj, dict) else None
        return isinstance(opts, dict) and bool(opts.get("include_usage"))

    async def _write_abort_tail(self, resp: web.StreamResponse, tracker: SseUsageTracker) -> None:
        """Close a relayed stream as vLLM closes an aborted one: a final chunk with
        ``finish_reason: "abort"`` for every choice still open, the usage if asked, ``[DONE]``."""
        chat = self.path == CHAT_PATH
        chunk: dict[str, object] = {
            "id": tracker.stream_id or f"{'chatcmpl' if chat else 'cmpl'}-{self.parsed.meta.request_id}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": self._model(),
        }
        events: list[dict[str, object]] = [{**chunk, "choices": self._abort_choices(tracker.finished, stream=True)}]
        if self._include_usage():
            events.append({**chunk, "choices": [], "usage": self._abort_usage(tracker.events)})
        data = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
        await _end_stream(resp, tracker, data)

    async def _attempt(self, engine: str) -> web.StreamResponse:
        s = self.state
        meta = self.parsed.meta
        s.dispatcher.on_abort(meta.request_id, self.abort)
        try:
            async with await self._open(engine) as upstream:
                if upstream.content_type == "text/event-stream":
                    response = await self._relay_stream(engine, upstream)
                else:
                    response = await self._relay_body(engine, upstream)
                return response
        except CONNECT_FAILURES as exc:
            self._engine_failed(engine, exc)
            s.dispatcher.finish(meta, engine, _failed(meta), Outcome.RETRIED)
            raise _RetryElsewhere from exc
        except READ_FAILURES as exc:  # read timeout before the answer: the engine took the work
            s.dispatcher.finish(meta, engine, _failed(meta), Outcome.UPSTREAM_FAILED)
            raise UpstreamUnavailable(
                f"engine did not answer: {type(exc).__name__}", code="upstream_timeout"
            ) from exc
        except asyncio.CancelledError:
            if self._take_abort(engine, _failed(meta)):
                return self._abort_answer(engine)
            s.dispatcher.finish(meta, engine, _failed(meta), Outcome.CLIENT_DISCONNECT)
            raise
        except Exception:
            # Anything unforeseen still releases the placement (finish is idempotent),
            # so an odd request can never leak a session or an in-flight count.
            s.dispatcher.finish(meta, engine, _failed(meta), Outcome.UPSTREAM_FAILED)
            raise

    async def _relay_body(
        self, engine: str, upstream: aiohttp.ClientResponse
    ) -> web.Response:
        body = await upstream.read()  # CONNECT_FAILURES here: nothing sent yet, retry
        ok = upstream.status < 400
        completion = usage_from_json(body, self.parsed.meta, ok)
        self.state.dispatcher.finish(
            self.parsed.meta, engine, completion, Outcome.OK if ok else Outcome.ENGINE_ERROR
        )
        return web.Response(
            status=upstream.status,
            body=body,
            headers=_response_headers(upstream.headers, engine, self.parsed.warning),
        )

    async def _relay_stream(
        self, engine: str, upstream: aiohttp.ClientResponse
    ) -> web.StreamResponse:
        s = self.state
        meta = self.parsed.meta
        resp = web.StreamResponse(
            status=upstream.status, headers=_response_headers(upstream.headers, engine, self.parsed.warning)
        )
        tracker = SseUsageTracker()
        outcome = Outcome.OK if upstream.status < 400 else Outcome.ENGINE_ERROR
        try:
            await resp.prepare(self.request)
            while True:
                try:
                    chunk = await upstream.content.readany()
                except READ_FAILURES as exc:
                    outcome = Outcome.UPSTREAM_FAILED
                    if isinstance(exc, CONNECT_FAILURES):
                        self._engine_failed(engine, exc)
                    await self._write_error(resp, tracker, f"engine stream broke: {type(exc).__name__}")
                    break
                if not chunk:
                    break
                tracker.feed(chunk)
                await resp.write(chunk)
            if outcome != Outcome.UPSTREAM_FAILED:
                await resp.write_eof()
        except ConnectionError:  # the client went away mid-stream
            outcome = Outcome.CLIENT_DISCONNECT
        except asyncio.CancelledError:
            if self._take_abort(engine, tracker.completion(meta, ok=False)):
                if not resp.prepared:
                    await resp.prepare(self.request)
                await self._write_abort_tail(resp, tracker)
                return resp
            s.dispatcher.finish(meta, engine, tracker.completion(meta, ok=False),
                                Outcome.CLIENT_DISCONNECT)
            raise
        s.dispatcher.finish(meta, engine, tracker.completion(meta, ok=outcome == Outcome.OK), outcome)
        return resp

    @staticmethod
    async def _write_error(resp: web.StreamResponse, tracker: SseUsageTracker, msg: str) -> None:
        await _end_stream(resp, tracker, sse_error_event(msg))


@functools.lru_cache(maxsize=8)
def upstream_timeout(connect_s: float, read_s: float) -> aiohttp.ClientTimeout:
    """The upstream timeouts (one object per config value, not one per request)."""
    return aiohttp.ClientTimeout(total=None, connect=connect_s, sock_read=read_s)


_REQUEST_ID_PREFIX = os.urandom(8).hex()
_request_ids = itertools.count()


def new_request_id() -> str:
    """A request id unique in this process (a counter) and across processes (a random prefix):
    32 hex digits, as ``uuid4().hex`` was, at a tenth of its cost."""
    return f"{_REQUEST_ID_PREFIX}{next(_request_ids):016x}"


def _failed(meta: RequestMeta) -> Completion:
    return Completion(prompt_tokens=meta.prompt_tokens, completion_tokens=0, ok=False)


# ---- handlers -------------------------------------------------------------


async def _generation(request: web.Request, kind: EndpointKind, path: str) -> web.StreamResponse:
    s = request.app[STATE]
    arrived = s.clock()
    if s.dispatcher.draining:
        raise ShuttingDown("router is shutting down")
    raw = await read_body(request, s.config.max_body_bytes)
    parsed = parse_request(
        raw,
        request.headers,
        kind,
        mix=s.config.workloads,
        prefix=s.config.policy.prefix,
        request_id=new_request_id(),
    )
    if parsed.warning is not None and parsed.meta.workload_class not in _warned_classes:
        _warned_classes.add(parsed.meta.workload_class)  # once per class and process: not per request
        log.warning("%s (further such requests are answered with %s only)", parsed.warning, WARNING_HEADER)
    return await Forwarder(s, request, parsed, path, arrived).run()


_warned_classes: set[str] = set()


async def handle_completions(request: web.Request) -> web.StreamResponse:
    return await _generation(request, EndpointKind.COMPLETIONS, COMPLETIONS_PATH)


async def handle_chat(request: web.Request) -> web.StreamResponse:
    return await _generation(request, EndpointKind.CHAT, CHAT_PATH)


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
                headers=_forward_headers(request.headers), timeout=timeout,
            ) as upstream:
                payload = await upstream.read()
                return web.Response(
                    status=upstream.status, body=payload,
                    headers=_response_headers(upstream.headers, engine),
                )
        except CONNECT_FAILURES as exc:
            s.metrics.engine_failures.labels(engine).inc()
            s.registry.mark_failed(engine, f"{type(exc).__name__}: {exc}")
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
    app.router.add_post("/v1/completions", handle_completions)
    app.router.add_post("/v1/chat/completions", handle_chat)
    app.router.add_get("/v1/models", handle_models)
    app.router.add_post("/tokenize", handle_tokenize)
    app.router.add_post("/v1/sessions/{session_id}/end", handle_session_end)


