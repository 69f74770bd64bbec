"""The data plane's generation endpoints: admit, forward, relay, and report the completion.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (served by
``downstream.DataPlaneServer``; every other path goes to the control app,
``service.py``):

1. the body (bounded by ``max_body_bytes`` in the server) is parsed for the
   rollout metadata (``request_meta.py``); a malformed request never reaches a
   policy;
2. ``Dispatcher.admit``: placed at once, or held until an epoch places it;
3. forward to the engine over the pooled connections of ``upstream.py``: the
   body bytes as the client sent them (or without the ``rollout`` object),
   the client's end-to-end headers. A connection failure before any byte went
   to the client places the request again (at most ``max_placement_attempts``
   engines) and takes the engine out of rotation: at once when the connection
   was refused or broke, after ``unhealthy_after_failures`` in a row (failed
   health checks included) when it timed out; a pooled connection the engine
   had closed is retried once, fresh, without blaming the engine;
4. relay the answer unchanged: status, end-to-end headers, body bytes, and
   for streams each chunk as it arrives (SSE framing intact). Chunks are not
   parsed: ``SseUsageTracker`` looks at bytes, decoding only the events that
   can carry usage, a finish or the stream's id;
5. ``runner.finish`` with the usage the engine reported: ``usage`` of a JSON
   answer (read off its tail), or of the final usage chunk of a stream
   (``stream_options.include_usage``). Without usage the router estimates:
   prompt tokens from the request, completion tokens = streamed content
   events (about one token each in vLLM), or 0 for a JSON answer without usage.

A client that goes away (the server cancels the handler) while held or
streaming releases its ledger entry or its placement, and the upstream
connection is closed so the engine aborts the request. If the engine breaks
mid-stream the client gets an SSE error event and the stream ends.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import time
from dataclasses import dataclass

from .downstream import IncomingRequest, Responder
from .errors import InvalidRequest, RouterError, ShuttingDown, UpstreamUnavailable, openai_error_body
from .http1 import HOP_BY_HOP, NOT_RELAYED_IN_ANSWERS
from .http_errors import error_answer
from .metrics import Outcome
from .policy.types import Completion, RequestMeta
from .request_meta import EndpointKind, ParsedRequest, parse_request
from .state import RouterState
from .upstream import (
    BadAnswer,
    ConnectFailed,
    ConnectionBroke,
    ConnectTimedOut,
    ReadTimeout,
    StaleConnection,
    UpstreamError,
    UpstreamResponse,
)
from .usage import SseUsageTracker, usage_from_json

log = logging.getLogger(__name__)

ENGINE_HEADER = b"X-Misat-Engine"
"""Response header naming the engine that served the request."""
ABORT_HEADER = b"X-Misat-Abort"
"""On an answer the router itself aborted (``router``): output the engine had made was lost."""
WARNING_HEADER = b"X-Misat-Warning"
"""On answers to requests accepted as written but probably not meant so (ParsedRequest.warning)."""
COMPLETIONS_PATH = b"/v1/completions"
CHAT_PATH = b"/v1/chat/completions"
GENERATION_PATHS = {COMPLETIONS_PATH: EndpointKind.COMPLETIONS, CHAT_PATH: EndpointKind.CHAT}
"""The paths the data plane serves itself."""
EVENT_STREAM = b"text/event-stream"

_NOT_FORWARDED = HOP_BY_HOP | {b"accept-encoding", b"expect"}
"""Request headers the router does not pass upstream (it sets ``Accept-Encoding`` itself)."""

CONNECT_FAILURES = (ConnectFailed, ConnectionBroke, StaleConnection, BadAnswer)
"""Upstream errors that mean the engine is unreachable or its connection broke: before any
byte reached the client the request is placed again elsewhere; the engine leaves rotation."""


def forward_headers(headers: list[tuple[bytes, bytes]]) -> bytes:
    """The client's end-to-end header lines for the engine; the answer must be uncompressed
    (relayed byte for byte, and read for usage)."""
    lines = [k + b": " + v + b"\r\n" for k, v in headers if k.lower() not in _NOT_FORWARDED]
    lines.append(b"Accept-Encoding: identity\r\n")
    return b"".join(lines)


def response_headers(upstream: UpstreamResponse, engine: bytes, warning: bytes | None) -> list[tuple[bytes, bytes]]:
    out = [(k, v) for k, v in upstream.headers if k.lower() not in NOT_RELAYED_IN_ANSWERS]
    out.append((ENGINE_HEADER, engine))
    if warning is not None:
        out.append((WARNING_HEADER, warning))
    return out


def sse_error_event(message: str) -> bytes:
    body = openai_error_body(message, "upstream_error", code="engine_stream_broken")
    return b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"


async def _end_stream(out: Responder, tracker: SseUsageTracker, data: bytes) -> None:
    """Write the last events of a relayed stream and end it; a client already gone is fine.
    Cut mid-event, the engine's partial event is terminated first so ``data`` parses on its own."""
    if tracker.mid_event:
        data = b"\n\n" + data
    try:
        await out.write(data)
        out.end_stream()
    except ConnectionError:
        pass


# ---- forwarding -----------------------------------------------------------


class _RetryElsewhere(Exception):
    """The attempt failed before any byte reached the client."""


@dataclass(slots=True)
class Forwarder:
    """One admitted request's trip to an engine and back."""

    state: RouterState
    request: IncomingRequest
    out: Responder
    parsed: ParsedRequest
    path: bytes
    arrived: float
    aborted: bool = False
    """Set by ``abort``: the admin API aborted this request (``/admin/pause?mode=abort``)."""
    _task: asyncio.Task[object] | None = None
    _headers: bytes | None = None

    async def run(self) -> None:
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
                s.metrics.overhead(max(0.0, s.clock() - self.arrived - held_total))
            try:
                await self._attempt(engine)
                return
            except _RetryElsewhere:
                continue
        raise UpstreamUnavailable(
            f"no engine answered after {s.config.max_placement_attempts} attempts",
            code="upstream_unavailable",
        )

    def _engine_failed(self, engine: str, exc: BaseException) -> None:
        s = self.state
        s.metrics.engine_failures.labels(engine).inc()
        error = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, ConnectTimedOut):
            # Slow to accept is not gone: one timeout taking an engine out moved its load onto
            # the others, which then timed out in turn (both engines of the e2e suite, docs/e2e.md).
            s.registry.count_failure(engine, error, down_after=s.config.unhealthy_after_failures)
        else:
            s.registry.mark_failed(engine, error)

    async def _open(self, engine: str) -> UpstreamResponse:
        """POST upstream; a pooled connection found closed by the engine is retried once, fresh."""
        pool = self.state.engine_pool()
        origin = pool.origin(engine)
        if self._headers is None:
            self._headers = forward_headers(self.request.headers)
        try:
            return await pool.request(origin, b"POST", self.path, self._headers, self.parsed.body)
        except StaleConnection:
            return await pool.request(origin, b"POST", self.path, self._headers, self.parsed.body, fresh=True)

    def abort(self) -> None:
        """End the request now with vLLM's abort answer (``finish_reason: "abort"``): used when the
        engine could not abort it itself. Cancels the forwarding task, whose handlers answer."""
        if not self.aborted and self._task is not None:
            self.aborted = True
            self._task.cancel()

    def _take_abort(self, engine: str, completion: Completion) -> bool:
        """On a cancellation: True when it was ``abort`` alone (not also the client leaving), in
        which case the request is finished here and the caller answers the client."""
        if not self.aborted or self._task is None or self._task.uncancel() > 0 or self.out.client_gone:
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

    def _answer_abort(self, engine: str) -> None:
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
        self.out.respond_json(200, json.dumps(body).encode(),
                              [(ENGINE_HEADER, engine.encode()), (ABORT_HEADER, b"router")])

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

    async def _write_abort_tail(self, tracker: SseUsageTracker) -> None:
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
        await _end_stream(self.out, tracker, data)

    async def _attempt(self, engine: str) -> None:
        s = self.state
        meta = self.parsed.meta
        s.dispatcher.on_abort(meta.request_id, self.abort)
        try:
            upstream = await self._open(engine)
            try:
                if upstream.content_type == EVENT_STREAM:
                    await self._relay_stream(engine, upstream)
                else:
                    await self._relay_body(engine, upstream)
            finally:
                upstream.close()
        except CONNECT_FAILURES as exc:
            self._engine_failed(engine, exc)
            s.dispatcher.finish(meta, engine, _failed(meta), Outcome.RETRIED)
            raise _RetryElsewhere from exc
        except ReadTimeout as exc:  # before the answer: the engine took the work and went silent
            s.dispatcher.finish(meta, engine, _failed(meta), Outcome.UPSTREAM_FAILED)
            raise UpstreamUnavailable(
                f"engine did not answer: {type(exc).__name__}", code="upstream_timeout"
            ) from exc
        except asyncio.CancelledError:
            if self._take_abort(engine, _failed(meta)):
                self._answer_abort(engine)
                return
            s.dispatcher.finish(meta, engine, _failed(meta), Outcome.CLIENT_DISCONNECT)
            raise
        except Exception:
            # Anything unforeseen still releases the placement (finish is idempotent),
            # so an odd request can never leak a session or an in-flight count.
            s.dispatcher.finish(meta, engine, _failed(meta), Outcome.UPSTREAM_FAILED)
            raise

    async def _relay_body(self, engine: str, upstream: UpstreamResponse) -> None:
        body = await upstream.read()  # CONNECT_FAILURES here: nothing sent yet, retry
        ok = upstream.status < 400
        # The client first, the books right after, in the same step (no await between): nothing
        # the client sends next can be decided before the finish is counted.
        try:
            self.out.respond(upstream.status,
                             response_headers(upstream, engine.encode(), self.parsed.warning_bytes), body)
        finally:
            completion = usage_from_json(body, self.parsed.meta, ok)
            self.state.dispatcher.finish(
                self.parsed.meta, engine, completion, Outcome.OK if ok else Outcome.ENGINE_ERROR
            )

    async def _relay_stream(self, engine: str, upstream: UpstreamResponse) -> None:
        s = self.state
        meta = self.parsed.meta
        out = self.out
        tracker = SseUsageTracker()
        outcome = Outcome.OK if upstream.status < 400 else Outcome.ENGINE_ERROR
        try:
            out.start_stream(upstream.status, response_headers(upstream, engine.encode(),
                                                               self.parsed.warning_bytes))
            while True:
                try:
                    chunk = await upstream.read_chunk()
                except UpstreamError as exc:
                    outcome = Outcome.UPSTREAM_FAILED
                    if isinstance(exc, CONNECT_FAILURES):
                        self._engine_failed(engine, exc)
                    await _end_stream(out, tracker, sse_error_event(f"engine stream broke: {type(exc).__name__}"))
                    break
                if not chunk:
                    break
                tracker.feed(chunk)
                await out.write(chunk)
            if outcome != Outcome.UPSTREAM_FAILED:
                out.end_stream()
        except ConnectionError:  # the client went away mid-stream
            outcome = Outcome.CLIENT_DISCONNECT
        except asyncio.CancelledError:
            if self._take_abort(engine, tracker.completion(meta, ok=False)):
                await self._write_abort_tail(tracker)
                return
            s.dispatcher.finish(meta, engine, tracker.completion(meta, ok=False), Outcome.CLIENT_DISCONNECT)
            raise
        s.dispatcher.finish(meta, engine, tracker.completion(meta, ok=outcome == Outcome.OK), outcome)


_REQUEST_ID_PREFIX = os.urandom(8).hex()
_request_ids = itertools.count()


def new_request_id() -> str:
    """A request id unique in this process (a counter) and across processes (a random prefix):
    32 hex digits, as ``uuid4().hex`` was, at a tenth of its cost."""
    return f"{_REQUEST_ID_PREFIX}{next(_request_ids):016x}"


def _failed(meta: RequestMeta) -> Completion:
    return Completion(prompt_tokens=meta.prompt_tokens, completion_tokens=0, ok=False)


# ---- the handler --------------------------------------------------------------

_warned_classes: set[str] = set()


async def generation(s: RouterState, req: IncomingRequest, out: Responder, kind: EndpointKind) -> None:
    """Answer one generation request; domain errors become their OpenAI-style answers here."""
    arrived = s.clock()
    try:
        if s.dispatcher.draining:
            raise ShuttingDown("router is shutting down")
        try:
            parsed = parse_request(
                req.body, req.mapping, kind,
                mix=s.config.workloads, prefix=s.config.policy.prefix, request_id=new_request_id(),
            )
        except InvalidRequest:
            s.metrics.invalid.inc()
            raise
        if parsed.warning is not None and parsed.meta.workload_class not in _warned_classes:
            _warned_classes.add(parsed.meta.workload_class)  # once per class and process: not per request
            log.warning("%s (further such requests are answered with %s only)", parsed.warning,
                        WARNING_HEADER.decode())
        await Forwarder(s, req, out, parsed, req.path, arrived).run()
    except RouterError as exc:
        if out.started:
            raise
        status, headers, body = error_answer(exc)
        out.respond(status, headers, body)
