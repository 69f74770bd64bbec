"""The usage an engine reported, read off its answer without parsing the whole answer.

A JSON answer (``usage_from_json``): vLLM writes ``usage`` as one of the last
members of the top-level object (``..., "choices": [...], "usage": {...},
"kv_transfer_params": null}``), after the choices, which hold the bulk (text,
logprobs). So the last ``"usage"`` key of the body is found from the end, only
its object is decoded, and it is taken only when what follows it provably
closes the top-level object (the rest, from its comma, must decode as an
object of its own: a ``usage`` nested deeper leaves closing brackets over and
fails that). Anything else (no such key, ``usage`` not last-but-a-few, an odd
layout) falls back to decoding the whole body, so the answer is always what
``json.loads(body)["usage"]`` would give for a valid body.

A stream (``SseUsageTracker``): chunks are relayed as they come; the tracker
looks at bytes. The complete events of a chunk are searched as one block, in
C, for what can matter: a ``"usage": {`` (vLLM's final usage chunk, or every
chunk with continuous usage stats), a string ``finish_reason`` (which choices
finished), an empty ``choices``, ``[DONE]``. Without any (every token of a
stream), its events are counted by their ``data:`` lines and nothing else is
done; otherwise they are split and only those that can matter decoded, as is
the stream's first (its ``id``).
"""

from __future__ import annotations

import re

import orjson

from .json_codec import loads
from .policy.types import Completion, RequestMeta

USAGE_KEY = b'"usage"'
USAGE_CANDIDATES = 4
"""``"usage"`` keys tried from the end of a JSON answer before decoding the whole body (vLLM has one)."""
USAGE_CLOSING_BRACES = 8
"""Closing braces tried as the end of a ``usage`` object (vLLM's nests one: ``prompt_tokens_details``)."""

_WS = b" \t\r\n"
_FINISHED = re.compile(rb'"finish_reason" *: *"')
_NO_CHOICES = re.compile(rb'"choices" *: *\[ *\]')
_USAGE_OBJECT = re.compile(rb'"usage"[ \t]*:[ \t]*\{')


def _completion_from_usage(usage: object, meta: RequestMeta, ok: bool, completion_estimate: int) -> Completion:
    if isinstance(usage, dict):
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if isinstance(prompt, int) and isinstance(completion, int):
            return Completion(prompt, completion, cached if isinstance(cached, int) else None, ok=ok)
    return Completion(meta.prompt_tokens, completion_estimate, None, ok=ok)


def _escaped(body: bytes, quote: int) -> bool:
    """Whether the quote at ``quote`` is escaped (an odd run of backslashes before it)."""
    n = 0
    while quote - n - 1 >= 0 and body[quote - n - 1] == 0x5C:
        n += 1
    return n % 2 == 1


def _closes_top_level(rest: bytes) -> bool:
    """Whether ``rest`` (what follows a member's value) ends the top-level object it is in."""
    rest = rest.strip(_WS)
    if rest == b"}":
        return True
    if not rest.startswith(b","):
        return False
    try:
        return isinstance(orjson.loads(b"{" + rest[1:]), dict)
    except orjson.JSONDecodeError:
        return False


def _value_at(body: bytes, start: int) -> tuple[object, int] | None:
    """The value of the member whose key ends at ``start`` and where it ends; None if not found."""
    i = start
    n = len(body)
    while i < n and body[i] in _WS:
        i += 1
    if i >= n or body[i] != 0x3A:  # ':'
        return None
    i += 1
    while i < n and body[i] in _WS:
        i += 1
    if body.startswith(b"null", i):
        return None, i + 4
    if i >= n or body[i] != 0x7B:  # '{': usage is an object or null in vLLM
        return None
    end = i
    for _ in range(USAGE_CLOSING_BRACES):
        end = body.find(b"}", end)
        if end < 0:
            return None
        end += 1
        try:
            return orjson.loads(body[i:end]), end
        except orjson.JSONDecodeError:
            continue
    return None


def find_top_level_usage(body: bytes) -> tuple[bool, object]:
    """(found, value) of the top-level ``usage`` member, from the end of ``body`` only.

    ``found`` False means "not decided here" (decode the whole body instead)."""
    if not body.rstrip(_WS).endswith(b"}"):
        return False, None
    end = len(body)
    for _ in range(USAGE_CANDIDATES):
        at = body.rfind(USAGE_KEY, 0, end)
        if at < 0:
            return False, None
        end = at
        if _escaped(body, at):
            continue
        found = _value_at(body, at + len(USAGE_KEY))
        if found is not None and _closes_top_level(body[found[1]:]):
            return True, found[0]
    return False, None


def usage_from_json(body: bytes, meta: RequestMeta, ok: bool) -> Completion:
    """``usage`` of a JSON answer; estimated (prompt from the request, 0 out) without it."""
    found, usage = find_top_level_usage(body)
    if not found:
        try:
            obj = loads(body)
        except (ValueError, RecursionError):
            obj = None
        usage = obj.get("usage") if isinstance(obj, dict) else None
    return _completion_from_usage(usage, meta, ok, 0)


def _is_index(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class SseUsageTracker:
    """Watches an SSE byte stream for the last ``usage`` object and counts content events;
    it also notes the stream's ``id`` and the choices that finished (an abort ends the others)."""

    __slots__ = ("_buf", "events", "finished", "stream_id", "usage")

    def __init__(self) -> None:
        self._buf = b""
        self.events = 0
        self.usage: dict[str, object] | None = None
        self.stream_id: str | None = None
        self.finished: set[int] = set()

    def feed(self, chunk: bytes) -> None:
        buf = self._buf + chunk if self._buf else chunk
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        end = buf.rfind(b"\n\n")
        if end < 0:
            self._buf = buf
            return
        region, self._buf = buf[:end], buf[end + 2:]
        if (self.stream_id is not None and b"[DONE]" not in region and not _USAGE_OBJECT.search(region)
                and not _FINISHED.search(region) and not _NO_CHOICES.search(region)):
            # Only content events (every token of a stream): counted by their data lines, in C.
            self.events += region.count(b"\ndata:") + region.startswith(b"data:")
            return
        for event in region.split(b"\n\n"):
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    self._data(line[5:].strip())

    def _data(self, payload: bytes) -> None:
        if payload == b"[DONE]":
            return
        obj: object = None
        if _USAGE_OBJECT.search(payload):
            obj = _decode(payload)
            if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
                self.usage = obj["usage"]
        if self.stream_id is None or _FINISHED.search(payload):
            self._take_choices(obj if obj is not None else _decode(payload))
        if not _NO_CHOICES.search(payload):
            self.events += 1

    def _take_choices(self, obj: object) -> None:
        if not isinstance(obj, dict):
            return
        if self.stream_id is None and isinstance(obj.get("id"), str):
            self.stream_id = obj["id"]
        choices = obj.get("choices")
        for c in choices if isinstance(choices, list) else ():
            if isinstance(c, dict) and c.get("finish_reason") is not None and _is_index(c.get("index")):
                self.finished.add(c["index"])

    @property
    def mid_event(self) -> bool:
        """Whether the stream stopped inside an event (an error event must start afresh)."""
        return bool(self._buf.strip())

    def completion(self, meta: RequestMeta, ok: bool) -> Completion:
        return _completion_from_usage(self.usage, meta, ok, self.events)


def _decode(payload: bytes) -> object:
    try:
        return loads(payload)
    except (ValueError, RecursionError):
        return None
