"""A rollout session: one trajectory (or one GRPO group) as the router sees it.

A session object labels every request it sends with the workload class, the session id and
the turn number (``labels.py``), and each turn after the first with the engine that served the
one before (so a router that restarted, or a shard that took the session over, finds its KV),
counts the turns, retries a request the router held past its
deadline after the answer's ``Retry-After`` (bounded by ``HoldRetry``), and ends the session
at the router when its ``with`` block exits, also when the block raised: a trajectory that
failed half-way must not keep its KV reservation until the router's idle timeout.

Two flavours with one behaviour: ``AsyncRolloutSession`` (``async with``; aiohttp, or any
async callable such as an ``AsyncOpenAI`` method) and ``RolloutSession`` (``with``; the
standard library, or a sync ``OpenAI`` method). With the official ``openai`` client::

    async with AsyncRolloutSession(router_url, "agentic") as s:
        client = s.openai(AsyncOpenAI(base_url=router_url + "/v1", api_key="-"))
        reply = await s.create(client.chat.completions.create, model=m, messages=msgs)

``s.openai(client)`` is ``client.with_options(default_headers=s.headers(), max_retries=0)``
(the session does the hold retries, honouring ``Retry-After``); ``s.create`` adds the turn
header per call (``extra_headers``) and retries. Other clients take ``s.next_headers()`` (a
turn counted) or ``s.headers()`` (class and session only), or ``s.labelled_body(payload)``
where no header can be set.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from .errors import HeldTooLong, MisatClientError, error_code
from .labels import ANSWER_ENGINE_HEADER, RolloutLabels, session_end_path
from .retry import HoldRetry, is_held
from .transport import DEFAULT_TIMEOUT_S, Answer, AsyncTransport, HttpCall, SyncTransport

if TYPE_CHECKING:
    import aiohttp

log = logging.getLogger("misat_client")

T = TypeVar("T")
COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
_NOT_HELD = object()


def new_session_id() -> str:
    """A fresh, unique session id."""
    return uuid.uuid4().hex


class SessionEnded(MisatClientError):
    """A request through a session that has already ended."""


def _held_retry_after(exc: BaseException) -> object:
    """For an exception of the official ``openai`` client (``APIStatusError``, read by its
    attributes so this package need not import openai): the ``Retry-After`` header (or None)
    when it is the router's held answer, else ``_NOT_HELD``."""
    status = getattr(exc, "status_code", None)
    code = getattr(exc, "code", None)
    if not isinstance(status, int) or not is_held(status, code if isinstance(code, str) else None):
        return _NOT_HELD
    headers = getattr(getattr(exc, "response", None), "headers", None)
    value = headers.get("retry-after") if headers is not None else None
    return value if isinstance(value, str) else None


def _answer_headers(result: object) -> Mapping[str, str] | None:
    """The HTTP headers of an SDK call's result where it has them (the official ``openai`` client's
    ``with_raw_response`` answers do; its parsed objects do not, so their engine stays unknown)."""
    headers = getattr(result, "headers", None)
    return headers if isinstance(headers, Mapping) else None


def _held_error(exc: BaseException, attempts: int) -> HeldTooLong:
    body = getattr(exc, "body", None)
    raw = json.dumps({"error": body} if isinstance(body, dict) else {"error": {"message": str(exc)}}).encode()
    url = str(getattr(getattr(exc, "request", None), "url", "") or "")
    return HeldTooLong(503, raw, url=url, attempts=attempts)


class _SessionCore:
    """What both flavours share: the labels, the turn count, whether an end is still owed."""

    def __init__(self, rollout_class: str | None, session_id: str | None, retry: HoldRetry) -> None:
        self.labels = RolloutLabels(rollout_class=rollout_class, session_id=session_id or new_session_id())
        self.retry = retry
        self.turns = 0
        self.closed = False
        self._end_requested = False
        self.engine: str | None = None
        """The engine of the latest answer (``X-Misat-Engine``), sent with the next turn."""

    @property
    def id(self) -> str:
        assert self.labels.session_id is not None
        return self.labels.session_id

    def take_turn(self, end: bool) -> RolloutLabels:
        if self.closed:
            raise SessionEnded(f"session {self.id!r} has ended")
        labels = self.labels.with_turn(self.turns, end=end, engine=self.engine if self.turns else None)
        self.turns += 1
        return labels

    def answered(self, labels: RolloutLabels, headers: Mapping[str, str] | None = None) -> None:
        """A request completed: one sent with ``end`` ended the session at the router. ``headers``
        (any case-insensitive or lower-cased mapping) name the engine that served it."""
        if labels.end:
            self._end_requested = True
        engine = headers.get(ANSWER_ENGINE_HEADER.lower()) if headers is not None else None
        if engine:
            self.engine = engine

    def owes_end(self) -> bool:
        """Whether the router may still hold this session live (a request went out, none ended it)."""
        return not self.closed and self.turns > 0 and not self._end_requested

    def end_call(self) -> HttpCall:
        return HttpCall("POST", session_end_path(self.id))

    def after_held(self, answer: Answer, attempt: int) -> float | None:
        """None when ``answer`` is not the held 503; else the wait before the next attempt, or
        ``HeldTooLong`` when the retry budget is spent."""
        if not is_held(answer.status, error_code(answer.body)):
            return None
        delay = self.retry.delay(answer.headers.get("retry-after"), attempt, time.time())
        if delay is None:
            raise HeldTooLong(answer.status, answer.body, url=answer.url, attempts=attempt)
        return delay


def _ended(answer: Answer) -> bool:
    """The answer to a session end: True when it was live, False when the router did not know it
    (404: never admitted as a multi-turn session, already ended, or ended idle)."""
    if answer.status == 404:
        return False
    answer.raise_for_status()
    return True


class _Labelled:
    """What both session flavours share: the labels and turn count, and the headers, body and
    ``openai`` client derived from them (no I/O)."""

    _core: _SessionCore

    @property
    def id(self) -> str:
        """The session id sent as ``X-Session-Id``."""
        return self._core.id

    @property
    def labels(self) -> RolloutLabels:
        return self._core.labels

    @property
    def engine(self) -> str | None:
        """The engine that served the latest turn (its answer's ``X-Misat-Engine``), sent with the next
        turn as ``X-Session-Engine``; None before an answer named one."""
        return self._core.engine

    @property
    def turns(self) -> int:
        """Requests sent so far (a retried request counts once)."""
        return self._core.turns

    def headers(self) -> dict[str, str]:
        """Class and session headers, for a client's ``default_headers`` (no turn)."""
        return self._core.labels.headers()

    def next_headers(self, *, end: bool = False) -> dict[str, str]:
        """Headers for the next request, with its turn number (a turn is counted)."""
        return self._core.take_turn(end).headers()

    def labelled_body(self, payload: dict[str, Any], *, end: bool = False) -> dict[str, Any]:
        """``payload`` with the labels as its ``"rollout"`` object (a turn is counted), for clients
        that cannot set headers."""
        return self._core.take_turn(end).add_to_body(payload)

    def openai(self, client: T) -> T:
        """``client.with_options(default_headers=self.headers(), max_retries=0)`` for an
        official ``openai`` client: every call carries the class and session, and held answers
        come back to ``create`` to be retried after ``Retry-After``."""
        with_options: Callable[..., T] = client.with_options  # type: ignore[attr-defined]
        return with_options(default_headers=self.headers(), max_retries=0)


class AsyncRolloutSession(_Labelled):
    """One rollout session, async (``async with``). See the module docstring.

    ``base_url`` is the router (``http://host:port``, no ``/v1``); ``rollout_class`` one of its
    classes (None: its default class); ``session_id`` defaults to a fresh one. ``http`` is an
    ``aiohttp.ClientSession`` to reuse (else one is opened and closed with the session);
    ``sleep`` is how a retry waits (``asyncio.sleep``; tests pass their own).
    """

    def __init__(
        self,
        base_url: str,
        rollout_class: str | None = None,
        session_id: str | None = None,
        *,
        retry: HoldRetry | None = None,
        http: aiohttp.ClientSession | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._core = _SessionCore(rollout_class, session_id, retry or HoldRetry())
        self._transport = AsyncTransport(base_url, http=http, timeout_s=timeout_s)
        self._sleep = sleep
        self.base_url = self._transport.base_url

    async def create(self, fn: Callable[..., Awaitable[T]], /, *args: Any, end: bool = False, **kwargs: Any) -> T:
        """``await fn(*args, **kwargs)`` as one turn: the turn header added to ``extra_headers``,
        the router's held answer retried (``HoldRetry``); ``end=True`` marks the last turn."""
        labels = self._core.take_turn(end)
        kwargs["extra_headers"] = {**(kwargs.get("extra_headers") or {}), **labels.headers()}
        attempt = 1
        while True:
            try:
                result = await fn(*args, **kwargs)
            except Exception as exc:
                retry_after = _held_retry_after(exc)
                if retry_after is _NOT_HELD:
                    raise
                delay = self._core.retry.delay(retry_after if isinstance(retry_after, str) else None,
                                               attempt, time.time())
                if delay is None:
                    raise _held_error(exc, attempt) from exc
                await self._sleep(delay)
                attempt += 1
                continue
            self._core.answered(labels, _answer_headers(result))
            return result

    async def post(self, path: str, payload: dict[str, Any], *, end: bool = False) -> dict[str, Any]:
        """POST ``payload`` to ``path`` as one turn (headers, hold retries); the JSON answer,
        or ``RouterHTTPError`` / ``HeldTooLong``."""
        labels = self._core.take_turn(end)
        call = HttpCall("POST", path, json=payload, headers=labels.headers())
        attempt = 1
        while True:
            answer = await self._transport.send(call)
            delay = self._core.after_held(answer, attempt)
            if delay is None:
                break
            await self._sleep(delay)
            attempt += 1
        answer.raise_for_status()
        self._core.answered(labels, answer.headers)
        result: dict[str, Any] = answer.json()
        return result

    async def completions(self, *, end: bool = False, **payload: Any) -> dict[str, Any]:
        """``POST /v1/completions`` with ``payload`` as one turn."""
        return await self.post(COMPLETIONS_PATH, payload, end=end)

    async def chat(self, *, end: bool = False, **payload: Any) -> dict[str, Any]:
        """``POST /v1/chat/completions`` with ``payload`` as one turn."""
        return await self.post(CHAT_PATH, payload, end=end)

    async def end(self) -> bool:
        """End the session at the router now. True when it was live there, False when the
        router did not know it (404). Later requests through this object raise ``SessionEnded``."""
        if self._core.closed:
            return False
        answer = await self._transport.send(self._core.end_call())
        self._core.closed = True
        return _ended(answer)

    async def close(self) -> None:
        """End the session if it may still be live, and release the HTTP session if owned."""
        try:
            if self._core.owes_end():
                await self.end()
            self._core.closed = True
        finally:
            await self._transport.close()

    async def __aenter__(self) -> AsyncRolloutSession:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            await self.close()
            return
        # The block failed: end the session anyway, but never hide the block's own error.
        try:
            await self.close()
        except Exception as end_exc:
            log.warning("session %s: could not end it after an error: %s", self.id, end_exc)
            exc.add_note(f"misat_client: ending session {self.id!r} also failed: {end_exc}")


class RolloutSession(_Labelled):
    """One rollout session, sync (``with``): ``AsyncRolloutSession``'s behaviour over the
    standard library (``urllib``), or around a sync ``openai.OpenAI`` method."""

    def __init__(
        self,
        base_url: str,
        rollout_class: str | None = None,
        session_id: str | None = None,
        *,
        retry: HoldRetry | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._core = _SessionCore(rollout_class, session_id, retry or HoldRetry())
        self._transport = SyncTransport(base_url, timeout_s=timeout_s)
        self._sleep = sleep
        self.base_url = self._transport.base_url

    def create(self, fn: Callable[..., T], /, *args: Any, end: bool = False, **kwargs: Any) -> T:
        labels = self._core.take_turn(end)
        kwargs["extra_headers"] = {**(kwargs.get("extra_headers") or {}), **labels.headers()}
        attempt = 1
        while True:
            try:
                result = fn(*args, **kwargs)
            except Exception as exc:
                retry_after = _held_retry_after(exc)
                if retry_after is _NOT_HELD:
                    raise
                delay = self._core.retry.delay(retry_after if isinstance(retry_after, str) else None,
                                               attempt, time.time())
                if delay is None:
                    raise _held_error(exc, attempt) from exc
                self._sleep(delay)
                attempt += 1
                continue
            self._core.answered(labels, _answer_headers(result))
            return result

    def post(self, path: str, payload: dict[str, Any], *, end: bool = False) -> dict[str, Any]:
        labels = self._core.take_turn(end)
        call = HttpCall("POST", path, json=payload, headers=labels.headers())
        attempt = 1
        while True:
            answer = self._transport.send(call)
            delay = self._core.after_held(answer, attempt)
            if delay is None:
                break
            self._sleep(delay)
            attempt += 1
        answer.raise_for_status()
        self._core.answered(labels, answer.headers)
        result: dict[str, Any] = answer.json()
        return result

    def completions(self, *, end: bool = False, **payload: Any) -> dict[str, Any]:
        return self.post(COMPLETIONS_PATH, payload, end=end)

    def chat(self, *, end: bool = False, **payload: Any) -> dict[str, Any]:
        return self.post(CHAT_PATH, payload, end=end)

    def end(self) -> bool:
        if self._core.closed:
            return False
        answer = self._transport.send(self._core.end_call())
        self._core.closed = True
        return _ended(answer)

    def close(self) -> None:
        if self._core.owes_end():
            self.end()
        self._core.closed = True

    def __enter__(self) -> RolloutSession:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except Exception as end_exc:
            log.warning("session %s: could not end it after an error: %s", self.id, end_exc)
            exc.add_note(f"misat_client: ending session {self.id!r} also failed: {end_exc}")
