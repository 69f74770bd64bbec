"""JSON decoding on the hot path: orjson's speed with the standard library's verdicts.

orjson decodes valid JSON to the same values as ``json.loads``, about three times
faster on a token-id prompt, with two exceptions. It refuses some input the standard
library takes (``NaN``/``Infinity``, a UTF-8 byte-order mark, UTF-16/32 bytes): those
bodies go to ``json.loads``. And it decodes an integer past 64 bits (below -2**63 or
from 2**64) as a float, where ``json.loads`` gives the integer: such a float has a
magnitude of 2**63 or more (``OVERFLOW_FLOAT``), and ``holds_overflow`` finds one, so
a caller for which the difference matters decodes that body again with ``json.loads``
(request_meta.py does, for its verdicts and for a body it writes back).
"""

from __future__ import annotations

import json
from typing import Any

import orjson


def loads(raw: bytes | str) -> Any:
    """``json.loads(raw)``, through orjson where orjson can (an integer past 64 bits comes back
    as orjson's float: for reading counts, such as an answer's usage, that cannot matter)."""
    return decode(raw)[0]


def decode(raw: bytes | str) -> tuple[Any, bool]:
    """``json.loads(raw)`` and whether orjson decoded it: a value orjson decoded, orjson writes
    back as the same JSON value (``dumps``), at about a fifteenth of ``json.dumps``' cost."""
    try:
        return orjson.loads(raw), True
    except orjson.JSONDecodeError:
        return json.loads(raw), False


OVERFLOW_FLOAT = 2.0**63
"""The smallest magnitude of the float orjson makes of an integer past 64 bits."""


def holds_overflow(value: Any, *, skip: str | None = None) -> bool:
    """Whether ``value`` holds a float of magnitude ``OVERFLOW_FLOAT`` or more, perhaps an
    integer past 64 bits as orjson decoded it (a float written that large reads the same; a
    caller then decodes again with ``json.loads``, which is exact, only slower). ``skip``: a key
    of the top-level object not to look into (one the caller checked already)."""
    stack = [v for k, v in value.items() if k != skip] if isinstance(value, dict) else [value]
    while stack:
        v = stack.pop()
        if isinstance(v, float):
            if not -OVERFLOW_FLOAT < v < OVERFLOW_FLOAT:
                return True
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


def dumps(obj: Any, *, orjson_decoded: bool) -> bytes:
    """``obj`` as JSON bytes. Only what orjson decoded goes through orjson: what the standard
    library alone takes (NaN, infinities) orjson would write as null, so it is written back by
    the standard library, as it came. (What orjson decoded may still hold an integer past 64 bits
    as a float: see ``holds_overflow``.)"""
    if orjson_decoded:
        return orjson.dumps(obj)
    return json.dumps(obj).encode()
