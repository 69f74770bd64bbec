"""Turn an incoming OpenAI request into what the policy needs (``RequestMeta``).

Rollout metadata comes from headers, or from a top-level ``"rollout"`` object
in the JSON body for clients that cannot set headers:

=====================  ===========================  ==================================
header                 body field                   meaning
=====================  ===========================  ==================================
``X-Rollout-Class``    ``rollout.class``            workload class (``rlvr``, ...)
``X-Session-Id``       ``rollout.session_id``       session id (multi-turn, or a group)
``X-Session-Turn``     ``rollout.turn``             turn number, integer >= 0
``X-Session-End``      ``rollout.end``              last request of the session
``X-Session-Engine``   ``rollout.engine``           engine of the session's previous turn
                                                    (its answer's ``X-Misat-Engine``)
=====================  ===========================  ==================================

The router removes the ``rollout`` object before forwarding (vLLM would reject
an unknown field); without it the body is forwarded byte for byte. When a
header and the body both give a field they must agree. Unlabelled traffic
gets ``workloads.default_class``; without one, and for an unknown class, the
request is refused (``InvalidRequest``).

The prompt: token ids (``prompt`` as a list of ints, or a list of such lists)
give exact ``prompt_tokens``; text (``prompt`` string or list of strings, or
chat ``messages`` rendered as "role\\ncontent" lines) gives a text prefix for
affinity without a round trip to an engine, and ``prompt_tokens`` estimated as
characters / ``policy.prefix.chars_per_token``.

Samples: ``n`` (>= 1) times the prompts of a batch is ``RequestMeta.samples``, the
sequences the engine will run for this one request (vLLM fans it out into that many
children on one engine); the request is placed once and counted that many times.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import orjson

from .errors import InvalidRequest
from .json_codec import decode, dumps, holds_overflow
from .policy.settings import PrefixIndexSettings, WorkloadMix
from .policy.types import RequestMeta

HEADER_CLASS = "X-Rollout-Class"
HEADER_SESSION_ID = "X-Session-Id"
HEADER_TURN = "X-Session-Turn"
HEADER_END = "X-Session-End"
HEADER_ENGINE = "X-Session-Engine"
_LOWER_CLASS, _LOWER_SESSION_ID, _LOWER_TURN, _LOWER_END, _LOWER_ENGINE = (
    h.lower() for h in (HEADER_CLASS, HEADER_SESSION_ID, HEADER_TURN, HEADER_END, HEADER_ENGINE))
BODY_ROLLOUT_FIELD = "rollout"
ROLLOUT_KEYS = ("class", "session_id", "turn", "end", "engine")

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


class EndpointKind(StrEnum):
    COMPLETIONS = "completions"
    CHAT = "chat"


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A validated request: the policy's view, the bytes to forward, and whether it streams."""

    meta: RequestMeta
    body: bytes
    stream: bool
    warning: str | None = None
    """Said back to the client (``X-Misat-Warning``): accepted, but probably not what was meant."""

    @property
    def warning_bytes(self) -> bytes | None:
        """``warning`` as a header value."""
        return None if self.warning is None else self.warning.encode()


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_INT_ONLY = frozenset((int,))
_INT_JSON_CHARS = b"0123456789,-"
"""What orjson writes for a list of ints, besides its brackets."""


def _all_ints(values: list[Any]) -> bool:
    """Every item is an ``int`` and none a ``bool``, checked in C (prompts run to 100K ids).

    orjson writes an int as digits with an optional ``-``, and anything else with some other
    character (a float's ``.`` or ``e``, ``true``, ``null``, a quote, a bracket): so the items
    are ints exactly when their JSON is ``[]`` once digits, commas and minus signs are deleted.
    Two C passes (the rendering, ``bytes.translate``); a set of the items' types is the
    fallback where orjson cannot render (an integer past 64 bits: a TypeError). A generator
    over ``isinstance`` was a quarter of the router's CPU at 10 requests/s of 20K-token
    prompts; ``sum`` plus the rendering, the form before this one, cost a third more.
    """
    try:
        return orjson.dumps(values).translate(None, _INT_JSON_CHARS) == b"[]"
    except TypeError:
        return set(map(type, values)) == _INT_ONLY


def _parse_bool(value: object, param: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise InvalidRequest(f"{param} must be a boolean (true/false), got {value!r}", param=param)


def _parse_turn(value: object, param: str) -> int:
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise InvalidRequest(f"{param} must be an integer >= 0", param=param) from None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidRequest(f"{param} must be an integer >= 0", param=param)
    return value


def _merge(header: object | None, body: object | None, param: str) -> object | None:
    if header is not None and body is not None and header != body:
        raise InvalidRequest(
            f"header and body disagree on {param}: {header!r} vs {body!r}", param=param
        )
    return header if header is not None else body


def _string_label(header: str | None, rollout: dict[str, Any], key: str, what: str) -> str | None:
    """A label given as its header or as ``rollout.<key>`` (they must agree): a string, never empty."""
    param = f"{BODY_ROLLOUT_FIELD}.{key}"
    body = rollout.get(key)
    if body is not None and not isinstance(body, str):
        raise InvalidRequest(f"{param} must be a string", param=param)
    value = _merge(header, body, param)
    if value == "":
        raise InvalidRequest(f"{what} must not be empty", param=param)
    assert value is None or isinstance(value, str)
    return value


def _rollout_fields(obj: dict[str, Any]) -> dict[str, Any]:
    raw = obj.get(BODY_ROLLOUT_FIELD)
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise InvalidRequest("rollout must be an object", param=BODY_ROLLOUT_FIELD)
    unknown = sorted(set(raw) - set(ROLLOUT_KEYS))
    if unknown:
        raise InvalidRequest(
            f"unknown rollout field(s) {unknown}; allowed: {list(ROLLOUT_KEYS)}",
            param=f"{BODY_ROLLOUT_FIELD}.{unknown[0]}",
        )
    return raw


def _text_of_content(content: object, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict):
                raise InvalidRequest(f"{param}[{i}] must be an object", param=f"{param}[{i}]")
            if part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
        return "".join(parts)
    raise InvalidRequest(f"{param} must be a string or a list of parts", param=param)


def render_messages(messages: object) -> str:
    """Chat messages as one deterministic text ("role\\ncontent\\n" each) for prefix affinity."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list", param="messages")
    lines = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise InvalidRequest(
                f"messages[{i}] must be an object with a string 'role'", param=f"messages[{i}]"
            )
        text = _text_of_content(msg.get("content"), f"messages[{i}].content")
        if msg.get("tool_calls") is not None:
            text += json.dumps(msg["tool_calls"], sort_keys=True, separators=(",", ":"))
        lines.append(f"{msg['role']}\n{text}\n")
    return "".join(lines)


@dataclass(frozen=True, slots=True)
class _Prompt:
    token_ids: tuple[int, ...] | None
    text: str | None
    tokens: int
    count: int = 1
    """Prompts in the request (a batch has several)."""


def _estimate(text: str, chars_per_token: float) -> int:
    return math.ceil(len(text) / chars_per_token)


def _completion_prompt(prompt: object, chars_per_token: float) -> _Prompt:
    """The first prompt gives affinity; the length counts every prompt of a batch."""
    if isinstance(prompt, str):
        return _Prompt(None, prompt, _estimate(prompt, chars_per_token))
    if isinstance(prompt, list) and prompt:
        if _all_ints(prompt):
            return _Prompt(tuple(prompt), None, len(prompt))
        if all(isinstance(p, str) for p in prompt):
            return _Prompt(None, prompt[0], sum(_estimate(p, chars_per_token) for p in prompt), len(prompt))
        if all(isinstance(p, list) and p and _all_ints(p) for p in prompt):
            return _Prompt(tuple(prompt[0]), None, sum(len(p) for p in prompt), len(prompt))
    raise InvalidRequest(
        "prompt must be a string, a non-empty list of token ids, or a list of either",
        param="prompt",
    )


def decode_json_object(raw: bytes) -> dict[str, Any]:
    """A (small) request body that must be one JSON object, decoded as ``json.loads`` decodes it
    (integers past 64 bits included); ``InvalidRequest`` otherwise."""
    obj, by_orjson = _decode_object(raw)
    if by_orjson and holds_overflow(obj):
        return _decode_object(raw, exact=True)[0]
    return obj


def _decode_object(raw: bytes, *, exact: bool = False) -> tuple[dict[str, Any], bool]:
    """The body's object and whether orjson decoded it (``json_codec.decode``); ``exact``: by the
    standard library."""
    try:
        obj, by_orjson = (json.loads(raw), False) if exact else decode(raw)
    except (ValueError, RecursionError) as exc:
        # ValueError: bad JSON, bad UTF-8, an integer over Python's 4300-digit limit;
        # RecursionError: nesting deeper than the decoder's stack.
        raise InvalidRequest(f"request body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(obj, dict):
        raise InvalidRequest("request body must be a JSON object")
    return obj, by_orjson


def _check_common(obj: dict[str, Any]) -> bool:
    if "model" in obj and not isinstance(obj["model"], str):
        raise InvalidRequest("model must be a string", param="model")
    for key in ("max_tokens", "max_completion_tokens"):
        v = obj.get(key)
        if v is not None and (not _is_int(v) or v < 1):
            raise InvalidRequest(f"{key} must be an integer >= 1, got {v!r}", param=key)
    n = obj.get("n")
    if n is not None and (not _is_int(n) or n < 1):
        raise InvalidRequest(f"n must be an integer >= 1, got {n!r}", param="n")
    stream = obj.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise InvalidRequest("stream must be a boolean", param="stream")
    return stream


def _workload_class(value: object | None, mix: WorkloadMix) -> str:
    if value is None:
        if mix.default_class is None:
            raise InvalidRequest(
                f"no workload class: set the {HEADER_CLASS} header or rollout.class "
                "(this router has no default class)",
                param=BODY_ROLLOUT_FIELD + ".class",
                code="missing_rollout_class",
            )
        return mix.default_class
    if not isinstance(value, str) or mix.get(value) is None:
        known = [c.name for c in mix.classes]
        raise InvalidRequest(
            f"unknown workload class {value!r}; known: {known}",
            param=BODY_ROLLOUT_FIELD + ".class",
            code="unknown_rollout_class",
        )
    return value


def parse_request(
    raw: bytes,
    headers: Mapping[str, str],
    kind: EndpointKind,
    *,
    mix: WorkloadMix,
    prefix: PrefixIndexSettings,
    request_id: str,
) -> ParsedRequest:
    """Validate ``raw`` and the rollout headers; raise ``InvalidRequest`` on any problem.

    ``headers`` is looked up by lower-case names (a dict of lower-cased names, or a
    case-insensitive mapping such as aiohttp's ``request.headers``).
    """
    obj, by_orjson = _decode_object(raw)
    try:
        return _parse_object(obj, by_orjson, raw, headers, kind, mix=mix, prefix=prefix, request_id=request_id)
    except InvalidRequest:
        if not by_orjson:
            raise
    # orjson reads an integer past 64 bits as a float, which a check refuses where the integer
    # may pass: the standard library's reading decides (rare: only refused bodies pay for it).
    return _parse_object(_decode_object(raw, exact=True)[0], False, raw, headers, kind,
                         mix=mix, prefix=prefix, request_id=request_id)


def _parse_object(
    obj: dict[str, Any],
    by_orjson: bool,
    raw: bytes,
    headers: Mapping[str, str],
    kind: EndpointKind,
    *,
    mix: WorkloadMix,
    prefix: PrefixIndexSettings,
    request_id: str,
) -> ParsedRequest:
    stream = _check_common(obj)
    rollout = _rollout_fields(obj)

    cls_header = headers.get(_LOWER_CLASS)
    cls = _workload_class(_merge(cls_header, rollout.get("class"), "rollout.class"), mix)

    session_id = _string_label(headers.get(_LOWER_SESSION_ID), rollout, "session_id", "session id")

    turn_h = headers.get(_LOWER_TURN)
    turn_b = rollout.get("turn")
    turn = _merge(
        None if turn_h is None else _parse_turn(turn_h, HEADER_TURN),
        None if turn_b is None else _parse_turn(turn_b, "rollout.turn"),
        "rollout.turn",
    )
    end_h = headers.get(_LOWER_END)
    end_b = rollout.get("end")
    end = _merge(
        None if end_h is None else _parse_bool(end_h, HEADER_END),
        None if end_b is None else _parse_bool(end_b, "rollout.end"),
        "rollout.end",
    )

    engine_hint = _string_label(headers.get(_LOWER_ENGINE), rollout, "engine", "the session's engine")

    if kind is EndpointKind.COMPLETIONS:
        if "prompt" not in obj:
            raise InvalidRequest("prompt is required", param="prompt")
        prompt = _completion_prompt(obj["prompt"], prefix.chars_per_token)
        max_tokens = obj.get("max_tokens")
    else:
        text = render_messages(obj.get("messages"))
        prompt = _Prompt(None, text, _estimate(text, prefix.chars_per_token))
        max_tokens = obj.get("max_completion_tokens", obj.get("max_tokens"))

    if BODY_ROLLOUT_FIELD in obj:
        # The engine gets the body without the router's labels. Written back through orjson where
        # orjson decoded it: a 24K-token body in about 0.12 ms, against 1.9 ms by json.dumps.
        del obj[BODY_ROLLOUT_FIELD]
        # A token-id prompt is all ints (checked above); anything else orjson read may hide an
        # integer past 64 bits as a float, which the engine must get back as the integer.
        if by_orjson and holds_overflow(obj, skip="prompt" if prompt.token_ids is not None else None):
            obj, by_orjson = json.loads(raw), False
            del obj[BODY_ROLLOUT_FIELD]
        body = dumps(obj, orjson_decoded=by_orjson)
    else:
        body = raw

    meta = RequestMeta(
        request_id=request_id,
        workload_class=cls,
        session_id=session_id,
        turn=int(turn or 0),  # type: ignore[call-overload]
        prompt_token_ids=prompt.token_ids,
        prompt_text=prompt.text,
        prompt_tokens=prompt.tokens,
        max_tokens=max_tokens,
        end_of_session=bool(end),
        engine_hint=engine_hint,
        samples=prompt.count * int(obj.get("n") or 1),
    )
    spec = mix.get(cls)
    warning = None
    if spec is not None and spec.multi_turn and session_id is None:
        warning = (f"class {cls!r} is multi-turn but the request has no session id ({HEADER_SESSION_ID} or "
                   "rollout.session_id): each turn is admitted as a new session and loses its engine's prefix cache")
    return ParsedRequest(meta=meta, body=body, stream=stream, warning=warning)
