"""The HTTP exchange under the sessions and the admin helper: one call shape, two transports.

``HttpCall`` says what to send; ``AsyncTransport`` sends it with aiohttp (imported when first
used, so the rest of the package works without it) and ``SyncTransport`` with the standard
library's ``urllib``. Both answer an ``Answer`` (status, lower-cased headers, body bytes) and
raise ``RouterUnreachable`` only when no HTTP answer came at all.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import RouterHTTPError, RouterUnreachable

if TYPE_CHECKING:
    import aiohttp

DEFAULT_TIMEOUT_S = 600.0
"""Longest wait for one answer: the official ``openai`` client's default, above the router's
default ``hold_deadline_s`` (300 s), so a held request gets the router's 503 before the client
gives up."""


CONNECTION_LIMIT = 0
"""Connections a session the client opens itself may hold at once (aiohttp's ``limit``; 0: no
cap). aiohttp's default, 100, would queue a worker's 101st concurrent rollout inside the client,
where the router's admission (its holds, its mixture, its deadlines) never sees it."""


def open_http() -> aiohttp.ClientSession:
    """An aiohttp session for requests to the router, without a client-side connection cap."""
    import aiohttp

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=CONNECTION_LIMIT))


@dataclass(frozen=True, slots=True)
class HttpCall:
    """One request: method, path (under the base URL), query, JSON body, extra headers."""

    method: str
    path: str
    query: Mapping[str, str] = field(default_factory=dict)
    json: Any = None
    headers: Mapping[str, str] = field(default_factory=dict)

    def url(self, base_url: str) -> str:
        url = base_url.rstrip("/") + self.path
        return f"{url}?{urllib.parse.urlencode(dict(self.query))}" if self.query else url


@dataclass(frozen=True, slots=True)
class Answer:
    """One HTTP answer."""

    status: int
    headers: Mapping[str, str]
    body: bytes
    url: str

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def json(self) -> Any:
        return json.loads(self.body)

    def raise_for_status(self) -> Answer:
        """``self`` when 2xx, else ``RouterHTTPError`` with the error body's fields."""
        if not self.ok:
            raise RouterHTTPError(self.status, self.body, url=self.url)
        return self


def query_flag(value: bool) -> str:
    """A boolean as the router's query strings spell it."""
    return "true" if value else "false"


class AsyncTransport:
    """aiohttp under ``base_url``: the given ``aiohttp.ClientSession``, or one of its own,
    opened on first use and closed by ``close()``."""

    def __init__(
        self, base_url: str, *, http: aiohttp.ClientSession | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._http = http
        self._owned = http is None

    async def send(self, call: HttpCall) -> Answer:
        import aiohttp

        if self._http is None:
            self._http = open_http()
        url = call.url(self.base_url)
        data = None if call.json is None else json.dumps(call.json).encode()
        headers = dict(call.headers)
        if data is not None:
            headers.setdefault("Content-Type", "application/json")
        try:
            async with self._http.request(call.method, url, data=data, headers=headers,
                                          timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as resp:
                body = await resp.read()
                return Answer(resp.status, {k.lower(): v for k, v in resp.headers.items()}, body, url)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise RouterUnreachable(f"{call.method} {url}: {type(exc).__name__}: {exc}") from exc

    async def close(self) -> None:
        if self._owned and self._http is not None:
            await self._http.close()
            self._http = None


class SyncTransport:
    """``urllib.request`` under ``base_url``: no dependency beyond the standard library."""

    def __init__(self, base_url: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    def send(self, call: HttpCall) -> Answer:
        url = call.url(self.base_url)
        data = None if call.json is None else json.dumps(call.json).encode()
        headers = dict(call.headers)
        if data is not None:
            headers.setdefault("Content-Type", "application/json")
        req = urllib.request.Request(url, data=data, headers=headers, method=call.method)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return Answer(resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read(), url)
        except urllib.error.HTTPError as exc:  # an answer with an error status
            with exc:
                return Answer(exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read(), url)
        except (urllib.error.URLError, OSError) as exc:
            raise RouterUnreachable(f"{call.method} {url}: {type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        """Nothing pooled; for symmetry with ``AsyncTransport``."""
