"""Router shards: an admin call that changes state is applied by every live shard.

A trainer talks to a sharded pool through one address (the proxy), which hands
an admin call to any one shard. Pausing, resuming, resetting prefix caches,
engine control calls and config pushes must reach every router, since each
shard admits against, and calls, only the engines it owns. So the shard that
receives such a call applies it and, at the same time, sends it to every peer
it believes live (``X-Misat-Fanout`` marks the copies, which are not sent on),
with the caller's own bearer token, and answers with the merged result:

- ``pause`` / ``resume``: counts summed over shards (in flight, held, aborted),
  per-engine results joined, ``paused`` true only when every shard is;
- ``engines/{op}`` / ``engines/call``: the per-engine results of all shards
  joined (each engine is owned by one shard);
- ``PUT /admin/config``: this shard's result, each shard's beside it;

plus ``shards``: per shard index, ``ok``, ``down`` (its engines are taken over
by the live shards, which applied the call to them), or why it failed. A peer
that could not apply the call (unreachable, or an error answer) makes the
answer a 502 ``shard_fanout_failed`` naming it, with the same ``shards``
detail: the call was applied by the others, and the caller should repeat it
(every one of these calls can be repeated).

Reads (``GET /admin/config``) are answered by the shard that got them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from .state import STATE, RouterState

FANOUT_HEADER = "X-Misat-Fanout"
"""On the copies of an admin call a shard sends its peers: the sending shard's index (never sent on)."""

Merge = Callable[[list[dict[str, Any]]], dict[str, Any]]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# ---- merging (pure) ------------------------------------------------------------


def _sum(results: list[dict[str, Any]], key: str) -> int:
    return sum(r.get(key) or 0 for r in results)


def _join(results: list[dict[str, Any]], key: str) -> dict[str, Any] | None:
    parts = [r[key] for r in results if isinstance(r.get(key), dict)]
    if not parts:
        return None
    out: dict[str, Any] = {}
    for p in parts:
        out.update(p)
    return out


def merge_pause(results: list[dict[str, Any]]) -> dict[str, Any]:
    """``pause`` / ``resume`` answers of several shards as one (the first is this shard's)."""
    out = dict(results[0])
    out["paused"] = all(bool(r.get("paused")) for r in results)
    for key in ("requests_in_flight", "held_requests", "aborted_requests"):
        out[key] = _sum(results, key)
    out["frozen_engines"] = sorted({e for r in results for e in r.get("frozen_engines") or ()})
    out["prefix_cache_reset"] = _join(results, "prefix_cache_reset")
    return out


def merge_engines(results: list[dict[str, Any]]) -> dict[str, Any]:
    """``engines/{op}`` / ``engines/call`` answers as one: every shard's engines."""
    out = dict(results[0])
    out["engines"] = _join(results, "engines") or {}
    return out


def merge_config(results: list[dict[str, Any]]) -> dict[str, Any]:
    """``PUT /admin/config``: this shard's result (each shard's is under ``shards``)."""
    return dict(results[0])


# ---- fanning out -----------------------------------------------------------------


async def _peer_call(state: RouterState, url: str, request: web.Request, body: bytes) -> tuple[int | None, Any]:
    cfg = state.config
    headers = {FANOUT_HEADER: str(state.shard_index)}
    for name in ("Authorization", "Content-Type"):
        if name in request.headers:
            headers[name] = request.headers[name]
    timeout = aiohttp.ClientTimeout(total=None, connect=cfg.upstream_connect_timeout_s,
                                    sock_read=cfg.upstream_timeout_s)
    try:
        async with state.session().request(request.method, url + request.path_qs, data=body, headers=headers,
                                           timeout=timeout) as resp:
            text = await resp.text(errors="replace")
    except (aiohttp.ClientError, TimeoutError) as exc:
        return None, f"{type(exc).__name__}: {exc}".rstrip(": ")
    try:
        return resp.status, json.loads(text)
    except (ValueError, RecursionError):
        return resp.status, text


def _failure(status: int | None, answer: Any) -> str | None:
    """Why a peer's answer is not a success, or None."""
    if status is None:
        return f"unreachable: {answer}"
    if 200 <= status < 300 and isinstance(answer, dict):
        return None
    message = answer.get("error", {}).get("message") if isinstance(answer, dict) else None
    return f"answered {status}: {message or str(answer)[:200]}"


def fans_out(
    merge: Merge, *, authorize: Callable[[web.Request], object], read_body: Callable[[web.Request], Awaitable[bytes]],
) -> Callable[[Handler], Handler]:
    """Wrap an admin handler so that, on a shard, it runs on every live shard (module docstring).
    ``authorize`` refuses the call before anything is sent on; ``read_body`` reads the body the
    copies carry (the handler reads it again: it must be cached on the request)."""

    def wrap(handler: Handler) -> Handler:
        async def fanned(request: web.Request) -> web.StreamResponse:
            state = request.app[STATE]
            peers = state.peers
            shards = state.config.shards
            if peers is None or shards is None or FANOUT_HEADER in request.headers:
                return await handler(request)
            authorize(request)
            body = await read_body(request)
            urls = shards.peer_urls()
            targets = peers.live_peers()
            # At once on every shard (a pause should start everywhere together); a call this shard
            # refuses (invalid) is refused as such, whatever the peers said (they refuse it too).
            local, *remote = await asyncio.gather(
                handler(request), *(_peer_call(state, urls[i], request, body) for i in targets),
                return_exceptions=True)
            if isinstance(local, BaseException):
                raise local
            assert isinstance(local, web.Response) and local.body is not None
            mine = json.loads(local.body)  # type: ignore[arg-type]
            detail: dict[int, str] = {peers.index: "ok"}
            answers = [mine]
            failed: list[str] = []
            for i, outcome in zip(targets, remote, strict=True):
                if isinstance(outcome, BaseException):
                    raise outcome  # not a transport failure (those are answers): a bug
                status, answer = outcome
                why = _failure(status, answer)
                detail[i] = why or "ok"
                if why is None:
                    answers.append(answer)
                else:
                    failed.append(f"shard {i} {why}")
            merged = merge(answers)
            merged["shards"] = peers.detail(detail)
            if failed:
                merged["error"] = {
                    "message": "applied by the other shards, not by: " + "; ".join(failed)
                    + " (repeat the call)",
                    "type": "upstream_error", "param": None, "code": "shard_fanout_failed",
                }
                return web.json_response(merged, status=502)
            return web.json_response(merged, status=local.status)

        return fanned

    return wrap
