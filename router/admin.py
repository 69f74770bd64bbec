"""Admin endpoints: config reload, pause/resume around a weight update.

- ``PUT /admin/config``: a new RouterConfig (JSON or YAML body), applied
  atomically (``RouterState.reload``; the rules in ``reload.py``); 400 with the reason when invalid, 409 when stale.
- ``GET /admin/config``: the applied config.
- ``POST /admin/pause?mode=wait|abort|keep``: new work is held (``RouterState.pause``).
  ``wait`` (default): requests in flight continue. ``abort``: they end now with
  vLLM's abort answer (partial output, ``finish_reason: "abort"``), through
  the engines' own ``/pause?mode=abort`` where they have it, else by the
  router. ``keep``: they freeze where they are, through vLLM's
  ``/pause?mode=keep`` on every engine serving one, and go on after the
  resume; all or nothing (an engine that cannot freeze undoes the pause, 502).
  ``?reset_prefix_cache=true`` also resets every engine's prefix cache
  (default: ``pause_resets_prefix_cache``; refused with ``keep``).
- ``POST /admin/resume?weight_version=V``: resets prefix caches first if asked
  (after a weight update, old KV must not be reused), records ``V`` for every
  engine but those held since a restart (``engines.py``), resumes engines an
  abort paused, then re-checks held work at once.
- ``POST /admin/engines/{sleep,wake_up,reset_prefix_cache}``: vLLM's control
  call on every engine (query passed through), results per engine.
- ``POST /admin/engines/call``: any control call (a framework's weight update)
  passed to every engine; never a generation path (``/v1/...``). A
  ``POST /reset_prefix_cache`` answered 2xx resets the policy's prefix index too,
  as the ``reset_prefix_cache`` op does. With
  ``weight_version`` the version is recorded for each engine answering 2xx,
  which also ends the hold of an engine held since a restart.

Auth: ``Authorization: Bearer <token>``, compared with ``hmac.compare_digest``;
401 without a valid token, 403 for every admin call when the router runs
without a token. The token is never logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from . import shard_admin
from .config import RouterConfig
from .errors import AdminDisabled, InvalidRequest, NotFound, Unauthorized, UpstreamUnavailable
from .passthrough import GENERATION_PREFIX, read_body
from .request_meta import decode_json_object
from .state import STATE, RouterState

log = logging.getLogger(__name__)

RESET_PREFIX_CACHE_PATH = "/reset_prefix_cache"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def require_admin(request: web.Request) -> RouterState:
    state = request.app[STATE]
    if state.admin_token is None:
        raise AdminDisabled("admin API disabled: the router runs without an admin token")
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    # surrogateescape: a header with invalid UTF-8 is a wrong token, not a server error.
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        given.strip().encode("utf-8", "surrogateescape"), state.admin_token.encode()
    ):
        raise Unauthorized("missing or invalid bearer token")
    return state


def _query_flag(request: web.Request, name: str, default: bool) -> bool:
    raw = request.query.get(name)
    if raw is None:
        return default
    if raw.lower() in _TRUE | _FALSE:
        return raw.lower() in _TRUE
    raise InvalidRequest(f"{name} must be true or false", param=name)


async def reset_prefix_caches(state: RouterState, *, reset_running: bool = False) -> dict[str, str]:
    """POST /reset_prefix_cache on every healthy engine; returns a result per engine.
    ``reset_running``: with vLLM's ``reset_running_requests=true``, which preempts the running
    requests first (the frozen ones of a keep pause: their KV is the old weights'), so that the
    reset is not refused for the blocks they hold."""
    cfg = state.config
    # A control call, bounded like a scrape: a stalled engine must not hang pause/resume
    # for upstream_timeout_s (an hour by default, sized for long generations).
    timeout = aiohttp.ClientTimeout(
        total=cfg.scrape_timeout_s, connect=cfg.upstream_connect_timeout_s
    )

    params = {"reset_running_requests": "true"} if reset_running else None

    async def one(engine: str) -> str:
        try:
            async with state.session().post(engine + RESET_PREFIX_CACHE_PATH, params=params, timeout=timeout) as r:
                if r.status != 200:
                    return f"status {r.status}"
                text = await r.text(errors="replace")
        except (aiohttp.ClientError, TimeoutError) as exc:
            return f"failed: {type(exc).__name__}"
        return "refused" if _reset_refused(text) else "ok"

    # Owned only: an engine being handed back is reset by its owner (every shard gets the call).
    # Health as the checks see it: an engine held since a restart is reset too.
    engines = [e for e in state.registry.owned_ids() if (st := state.registry.get(e)) is not None and st.healthy]
    results = await asyncio.gather(*(one(e) for e in engines))
    state.prefix_caches_reset()
    return dict(zip(engines, results, strict=True))


def _reset_refused(body: str) -> bool:
    """vLLM answers a reset 200 either way; recent releases say ``{"success": false}`` when it was
    refused (blocks in use). Older ones send no body: taken as done, as they give no other sign."""
    try:
        parsed = json.loads(body) if body else None
    except (ValueError, RecursionError):
        return False
    return isinstance(parsed, dict) and parsed.get("success") is False


async def handle_put_config(request: web.Request) -> web.Response:
    state = require_admin(request)
    data = await read_body(request, state.config.max_body_bytes)
    result = state.reload(data, "admin")
    return web.json_response(result.as_dict())


async def handle_get_config(request: web.Request) -> web.Response:
    state = require_admin(request)
    body = {"config_hash": state.config_hash, "config": state.config.model_dump(mode="json")}
    return web.json_response(body)


PAUSE_MODES = ("wait", "abort", "keep")
"""``/admin/pause?mode=``: ``wait`` lets in-flight requests finish; ``abort`` ends them now; ``keep``
freezes them until the resume."""
ENGINE_OPS = ("sleep", "wake_up", "reset_prefix_cache")
"""vLLM control endpoints ``/admin/engines/{op}`` fans out to every engine (query passed through)."""
ENGINE_PAUSE_PATH = "/pause"
ENGINE_RESUME_PATH = "/resume"
CALL_METHODS = ("GET", "POST", "PUT", "DELETE")


def _control_timeout(cfg: RouterConfig) -> aiohttp.ClientTimeout:
    # Engine control calls (a weight update, a wake-up) may take as long as a generation.
    return aiohttp.ClientTimeout(
        total=None, connect=cfg.upstream_connect_timeout_s, sock_read=cfg.upstream_timeout_s
    )


def _quick_timeout(cfg: RouterConfig) -> aiohttp.ClientTimeout:
    # A control call bounded like a scrape: a stalled engine must not hang pause/resume.
    return aiohttp.ClientTimeout(total=cfg.scrape_timeout_s, connect=cfg.upstream_connect_timeout_s)


async def call_engines(
    state: RouterState,
    engines: list[str],
    method: str,
    path: str,
    *,
    query: Mapping[str, str] | None = None,
    body: object = None,
    timeout: aiohttp.ClientTimeout,
) -> dict[str, dict[str, object]]:
    """One call to every engine at once; per engine ``{"status", "body"}`` (JSON, else text)
    or ``{"error"}`` when it could not be reached or did not answer in time."""

    async def one(engine: str) -> dict[str, object]:
        try:
            async with state.session().request(
                method, engine + path, params=dict(query or {}), json=body, timeout=timeout
            ) as r:
                text = await r.text(errors="replace")
        except (aiohttp.ClientError, TimeoutError) as exc:
            return {"error": f"{type(exc).__name__}: {exc}".rstrip(": ")}
        try:
            parsed: object = json.loads(text) if text else text
        except (ValueError, RecursionError):
            parsed = text
        return {"status": r.status, "body": parsed}

    results = await asyncio.gather(*(one(e) for e in engines))
    return dict(zip(engines, results, strict=True))


def _ok(result: Mapping[str, object]) -> bool:
    status = result.get("status")
    return isinstance(status, int) and 200 <= status < 300


def _pause_body(state: RouterState, mode: str | None, aborted: int,
                reset: dict[str, str] | None) -> dict[str, object]:
    return {
        "paused": state.runner.paused,
        "mode": mode,
        "requests_in_flight": len(state.dispatcher.in_flight),
        "held_requests": state.runner.held_count(),
        "aborted_requests": aborted,
        "frozen_engines": sorted(state.engines_frozen),
        "prefix_cache_reset": reset,
    }


async def _abort_in_flight(state: RouterState) -> int:
    """``mode=abort``: every request in flight through the router ends now with vLLM's abort
    answer. The engines abort their own (vLLM's ``POST /pause?mode=abort``: each request answers
    with its partial output and ``finish_reason: "abort"``); what an engine cannot abort (no such
    endpoint, or still unanswered after ``scrape_timeout_s``) the router aborts itself, with
    empty output. Returns how many requests were aborted."""
    cfg = state.config
    dispatcher = state.dispatcher
    live = {rid: f.meta for rid, f in dispatcher.in_flight.items()}
    if not live:
        return 0
    engines = sorted({f.engine_id for f in dispatcher.in_flight.values()})
    results = await call_engines(state, engines, "POST", ENGINE_PAUSE_PATH,
                                 query={"mode": "abort", "clear_cache": "false"},
                                 timeout=_quick_timeout(cfg))
    paused = {e for e, r in results.items() if _ok(r)}
    state.engines_paused |= paused
    by_router = dispatcher.abort_in_flight(set(engines) - paused)
    with contextlib.suppress(TimeoutError):
        await state.wait_until(lambda: not any(r in dispatcher.in_flight for r in live), cfg.scrape_timeout_s)
    by_router += dispatcher.abort_in_flight()
    with contextlib.suppress(TimeoutError):
        await state.wait_until(lambda: not any(r in dispatcher.in_flight for r in live), cfg.scrape_timeout_s)
    router_ids = {m.request_id for m in by_router}
    for rid, meta in live.items():
        if rid not in router_ids:
            state.metrics.aborted.labels(meta.workload_class, "engine").inc()
    log.info("aborted %d in-flight requests (%d by the engines)", len(live), len(live) - len(router_ids))
    return len(live)


async def _freeze_in_flight(state: RouterState, previous: tuple[bool, str | None]) -> None:
    """``mode=keep``: every engine serving a request through the router freezes it in place
    (vLLM's ``POST /pause?mode=keep``), to go on after ``/resume``. All or nothing: when an
    engine does not freeze (no such endpoint or mode, unreachable, no answer within
    ``scrape_timeout_s``), the engines that did are resumed, the router's pause is undone
    (``previous``: paused and mode before this call) and the call fails naming each engine."""
    engines = sorted({f.engine_id for f in state.dispatcher.in_flight.values()} - state.engines_frozen)
    if not engines:
        return
    results = await call_engines(state, engines, "POST", ENGINE_PAUSE_PATH,
                                 query={"mode": "keep", "clear_cache": "false"},
                                 timeout=_quick_timeout(state.config))
    frozen = {e for e, r in results.items() if _ok(r)}
    failed = {e: r for e, r in results.items() if e not in frozen}
    if not failed:
        state.freeze_engines(frozen)
        return
    if frozen:
        undone = await call_engines(state, sorted(frozen), "POST", ENGINE_RESUME_PATH,
                                    timeout=_quick_timeout(state.config))
        stuck = sorted(e for e, r in undone.items() if not _ok(r))
        if stuck:
            log.warning("engines frozen by a failed keep pause did not resume: %s", stuck)
    # Back as it was. Running before: nothing of this router's was paused through /pause then (a
    # resume forgets them all), so a plain resume leaves no engine's pause behind.
    was_paused, mode = previous
    if was_paused and mode is not None:
        state.pause(mode)
    else:
        state.resume()
    reasons = "; ".join(f"{e}: {_describe(r)}" for e, r in sorted(failed.items()))
    raise UpstreamUnavailable(
        f"mode=keep needs every engine with requests in flight to freeze them (vLLM's POST /pause?mode=keep, "
        f"served with VLLM_SERVER_DEV_MODE=1); {len(failed)} of {len(engines)} did not: {reasons}. "
        "Nothing was paused; use mode=wait or mode=abort with these engines",
        code="engines_not_frozen",
    )


def _describe(result: Mapping[str, object]) -> str:
    if "error" in result:
        return str(result["error"])
    body = result.get("body")
    text = json.dumps(body) if not isinstance(body, str) else body
    return f"status {result.get('status')}" + (f" {text[:200]}" if text else "")


async def handle_pause(request: web.Request) -> web.Response:
    state = require_admin(request)
    mode = request.query.get("mode", "wait")
    if mode not in PAUSE_MODES:
        raise InvalidRequest(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}", param="mode")
    reset = _query_flag(request, "reset_prefix_cache", state.config.pause_resets_prefix_cache)
    if mode == "keep" and reset:
        # vLLM ignores clear_cache with keep: the frozen requests hold their blocks, and a reset
        # would be refused while they do.
        why = ("" if "reset_prefix_cache" in request.query
               else " (it is on by default in this router's config, pause_resets_prefix_cache)")
        raise InvalidRequest(
            "mode=keep cannot reset prefix caches: the frozen requests keep their KV blocks, and vLLM "
            f"refuses a reset while blocks are in use; pass reset_prefix_cache=false{why}",
            param="reset_prefix_cache",
        )
    # Pause before the reset (nothing new lands on a cache being cleared), abort before it too
    # (vLLM refuses to reset a cache whose blocks running requests hold).
    previous = (state.runner.paused, state.pause_mode)
    state.pause(mode)
    if mode == "keep":
        await _freeze_in_flight(state, previous)
    aborted = await _abort_in_flight(state) if mode == "abort" else 0
    reset_results = await reset_prefix_caches(state) if reset else None
    log.info("router paused (mode %s, prefix cache reset: %s)", mode, reset)
    return web.json_response(_pause_body(state, mode, aborted, reset_results))


async def handle_resume(request: web.Request) -> web.Response:
    state = require_admin(request)
    reset = _query_flag(request, "reset_prefix_cache", False)
    version = request.query.get("weight_version")
    if version is not None and not version.strip():
        raise InvalidRequest("weight_version must not be empty", param="weight_version")
    mode = state.pause_mode
    # Requests still running hold KV of the old weights (a keep pause's frozen ones, or a wait
    # pause's unfinished ones): they are reset too, and recompute it under the new weights once
    # they run (vLLM's reset_running_requests). Sent whatever this router remembers, so a resume
    # after a router restart resets what the old router froze.
    reset_results = await reset_prefix_caches(state, reset_running=True) if reset else None
    if version is not None:
        state.record_weight_version(state.registry.owned_ids(), version, answered=False)
    # Every engine schedules again (the frozen requests first) before held work goes. vLLM's
    # /resume is a no-op on an engine that is not paused, and this router may not remember one
    # it paused: a router restarted during a pause forgets the engines it paused through /pause.
    engines = sorted(set(state.registry.owned_ids()) | state.engines_paused)
    resumed = await call_engines(state, engines, "POST", ENGINE_RESUME_PATH, timeout=_quick_timeout(state.config))
    failed = {e: r for e, r in resumed.items() if not _ok(r)}
    stuck = {e: r for e, r in failed.items() if e in state.engines_paused}
    if stuck:
        log.warning("engines paused through /pause did not resume: %s", stuck)
    if len(failed) > len(stuck):
        # Engines without vLLM's dev-mode endpoints answer 404: nothing to resume there.
        log.debug("resume not served by: %s", {e: r for e, r in failed.items() if e not in stuck})
    state.resume()
    log.info("router resumed (prefix cache reset: %s, weight version: %s)", reset, version)
    body = _pause_body(state, mode, 0, reset_results)
    body["weight_version"] = version
    return web.json_response(body)


async def handle_engine_op(request: web.Request) -> web.Response:
    state = require_admin(request)
    op = request.match_info["op"]
    if op not in ENGINE_OPS:
        raise NotFound(f"unknown engine operation {op!r}; known: {list(ENGINE_OPS)} and 'call'",
                       param="op", code="unknown_engine_op")
    results = await call_engines(state, state.registry.owned_ids(), "POST", "/" + op,
                                 query=request.query, timeout=_control_timeout(state.config))
    if op == "reset_prefix_cache" and any(_ok(r) for r in results.values()):
        state.prefix_caches_reset()
    log.info("engine op %s: %s", op, {e: r.get("status", r.get("error")) for e, r in results.items()})
    return web.json_response({"op": op, "engines": results})


class EngineCall(BaseModel):
    """Body of ``POST /admin/engines/call``: one control call passed to every engine."""

    model_config = ConfigDict(extra="forbid")

    method: str = "POST"
    path: str
    body: Any = None
    query: dict[str, str | int | float | bool] = Field(default_factory=dict)
    weight_version: str | None = None
    """Recorded as the weight version of every engine answering 2xx (which ends a restart's hold)."""


def _parse_call(raw: bytes) -> EngineCall:
    obj = decode_json_object(raw)
    try:
        call = EngineCall.model_validate(obj)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        raise InvalidRequest(f"{loc}: {first.get('msg')}", param=loc or None) from None
    method = call.method.upper()
    if method not in CALL_METHODS:
        raise InvalidRequest(f"method must be one of {list(CALL_METHODS)}, got {call.method!r}", param="method")
    path = call.path
    if not path.startswith("/") or path.startswith("//"):
        raise InvalidRequest(f"path must start with a single '/', got {path!r}", param="path")
    if "?" in path or "#" in path:
        raise InvalidRequest("path must not carry a query or fragment; give it in 'query'", param="path")
    if path == GENERATION_PREFIX.rstrip("/") or path.startswith(GENERATION_PREFIX):
        raise InvalidRequest(f"path {path!r} is a generation path; send generation to the router's own "
                             "/v1 endpoints", param="path")
    if call.weight_version is not None and not call.weight_version.strip():
        raise InvalidRequest("weight_version must not be empty", param="weight_version")
    return call.model_copy(update={"method": method})


async def handle_engine_call(request: web.Request) -> web.Response:
    state = require_admin(request)
    call = _parse_call(await read_body(request, state.config.max_body_bytes))
    query = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in call.query.items()}
    # Owned only, so each engine gets a fanned-out call once (never twice during a hand-back).
    results = await call_engines(state, state.registry.owned_ids(), call.method, call.path, query=query,
                                 body=call.body, timeout=_control_timeout(state.config))
    if call.weight_version is not None:
        state.record_weight_version([e for e, r in results.items() if _ok(r)], call.weight_version,
                                    answered=True)
    if call.method == "POST" and call.path == RESET_PREFIX_CACHE_PATH and any(_ok(r) for r in results.values()):
        # As /admin/engines/reset_prefix_cache does; passed through, the call can carry a body
        # (newer vLLM's reset_running_requests) that the fan-out op does not send.
        state.prefix_caches_reset()
    log.info("engine call %s %s: %s", call.method, call.path,
             {e: r.get("status", r.get("error")) for e, r in results.items()})
    return web.json_response({"method": call.method, "path": call.path, "engines": results})


async def _body(request: web.Request) -> bytes:
    return await read_body(request, request.app[STATE].config.max_body_bytes)


def _on_every_shard(merge: shard_admin.Merge) -> Callable[[shard_admin.Handler], shard_admin.Handler]:
    return shard_admin.fans_out(merge, authorize=require_admin, read_body=_body)


def add_routes(app: web.Application) -> None:
    # State-changing calls run on every shard of a sharded pool (shard_admin.py); reads stay local.
    app.router.add_put("/admin/config", _on_every_shard(shard_admin.merge_config)(handle_put_config))
    app.router.add_get("/admin/config", handle_get_config)
    app.router.add_post("/admin/pause", _on_every_shard(shard_admin.merge_pause)(handle_pause))
    app.router.add_post("/admin/resume", _on_every_shard(shard_admin.merge_pause)(handle_resume))
    # Fixed path first: aiohttp matches resources in the order they were added.
    app.router.add_post("/admin/engines/call", _on_every_shard(shard_admin.merge_engines)(handle_engine_call))
    app.router.add_post("/admin/engines/{op}", _on_every_shard(shard_admin.merge_engines)(handle_engine_op))
