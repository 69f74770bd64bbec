"""HTTP/1.1 vocabulary the data plane's server (``downstream.py``) and client (``upstream.py``) share."""

from __future__ import annotations

from collections.abc import Iterable
from http import HTTPStatus

REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
"""Status code -> reason phrase for status lines."""

HOP_BY_HOP = frozenset((
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer",
    b"transfer-encoding", b"upgrade", b"content-length", b"host",
))
"""Headers that describe one connection (and the framing each side sets itself): never relayed."""

NOT_RELAYED_IN_ANSWERS = HOP_BY_HOP | {b"date"}
"""Headers of an upstream answer a relay drops: the connection's own, and ``Date`` (the server sets it)."""


def first_header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """The first value of header ``name`` (give it in lower case) among raw (name, value) pairs, or None."""
    for k, v in headers:
        if k.lower() == name:
            return v
    return None
