"""Talking to one pool's router: push a config (``PUT /admin/config``), read ``/status``.

The base URL comes from a template (``OperatorSettings.router_url``), so tests
point it at a router on a local port while a cluster uses the router
Service's DNS name. Answers are parsed into the router's own pydantic models
(``RouterStatus``), so a contract change fails here, loudly, not as a
missing key somewhere in the status code.
"""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp
from pydantic import ValidationError

from misat_router.config import RouterConfig
from misat_router.status import RouterStatus


class RouterUnavailable(Exception):
    """The router could not be reached or answered with an error (message says which)."""


class ConfigRefused(RouterUnavailable):
    """The router answered and refused the config (400: invalid or not applicable now, e.g. it drops
    a class with live sessions; 409: an older generation): it keeps the one it runs."""


REFUSAL_STATUSES = frozenset({400, 409})


@dataclass(frozen=True, slots=True)
class PushResult:
    applied: bool
    generation: int
    config_hash: str
    policy_rebuilt: bool = False
    """The router rebuilt its policy for this config: its learned estimates started over."""


class RouterClient:
    """One pooled HTTP session for all pools; short timeouts (the status timer must not stall)."""

    def __init__(self, timeout_s: float = 3.0) -> None:
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def push_config(self, base_url: str, token: str, config: RouterConfig) -> PushResult:
        """PUT the config; a refusal (400 invalid, 409 stale) raises with the router's reason."""
        try:
            async with self._http().put(
                f"{base_url}/admin/config",
                data=config.model_dump_json(),
                headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
            ) as resp:
                body = await resp.json(content_type=None)
                if resp.status != 200:
                    error = ConfigRefused if resp.status in REFUSAL_STATUSES else RouterUnavailable
                    raise error(f"PUT /admin/config: {resp.status} {_error_message(body)}")
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise RouterUnavailable(f"PUT /admin/config: {type(exc).__name__}: {exc}") from None
        return PushResult(bool(body["applied"]), int(body["generation"]), str(body["config_hash"]),
                          bool(body.get("policy_rebuilt", False)))

    async def status(self, base_url: str) -> RouterStatus:
        try:
            async with self._http().get(f"{base_url}/status") as resp:
                if resp.status != 200:
                    raise RouterUnavailable(f"GET /status: {resp.status}")
                return RouterStatus.model_validate_json(await resp.read())
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise RouterUnavailable(f"GET /status: {type(exc).__name__}: {exc}") from None
        except ValidationError as exc:
            raise RouterUnavailable(f"GET /status: unexpected payload: {exc.error_count()} errors") from None


def _error_message(body: object) -> str:
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
    return str(body)[:300]
