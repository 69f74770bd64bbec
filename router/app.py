"""The router service: state, admission glue, background loops and the app factory.

``create_app(config, admin_token=...)`` wires everything once:

- ``RouterState`` (typed ``web.AppKey``) holds the applied config, the
  ``PolicyRunner``, the engine registry and the metrics;
- ``Dispatcher`` is the only caller of the runner: ``admit`` submits a request
  and, on HOLD, awaits a future that an epoch's ``runner.release()`` resolves
  (no per-request polling), with the hold deadline as its bound; ``finish``
  reports the completion and re-checks held work at once;
- ``cleanup_ctx`` owns the pooled upstream ``ClientSession``, a small probe
  session, and the background tasks (engine resolution, health checks,
  scrapes, the epoch loop, the config-file watcher);
- ``on_shutdown`` drains: held requests get 503, in-flight ones may finish
  within ``drain_timeout_s``.

Domain errors (``errors.py``) become HTTP responses only in ``error_middleware``.
All time passed to the policy is ``clock()`` (``time.monotonic`` by default).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web

from .config import RouterConfig
from .connector import RecentFirstConnector
from .engines import EngineRegistry, resolve_service
from .errors import (
    AdminDisabled,
    BodyTooLarge,
    ConfigRejected,
    HoldDeadlineExceeded,
    InvalidRequest,
    NotFound,
    RouterError,
    ShuttingDown,
    StaleConfig,
    Unauthorized,
    UpstreamUnavailable,
    error_body,
    openai_error_body,
)
from .metrics import CONTENT_TYPE, Outcome, RouterMetrics
from .policy.registry import build_policy
from .policy.runner import PolicyRunner
from .policy.types import Completion, Decision, RequestMeta
from .scrape import EngineProbes, wait_event
from .status import RouterStatus, SampleRateMeter, build_status

log = logging.getLogger(__name__)

Clock = Callable[[], float]

PROBE_CONNECTIONS_PER_ENGINE = 2
"""Probe-session connections per engine: one health check and one scrape at a time."""


@dataclass(slots=True)
class InFlight:
    """A placed request the router is waiting on."""

    meta: RequestMeta
    engine_id: str
    placed_at: float


class Dispatcher:
    """Admission glue between HTTP handlers and the ``PolicyRunner`` (one event loop, no locks)."""

    def __init__(self, state: RouterState) -> None:
        self._s = state
        self._waiters: dict[str, asyncio.Future[Decision]] = {}
        self.in_flight: dict[str, InFlight] = {}
        self._kick = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self.draining = False

    # ---- admission ------------------------------------------------------

    async def admit(self, meta: RequestMeta, deadline_s: float) -> tuple[str, float]:
        """Place ``meta`` now or after a hold; returns (engine id, seconds held).

        Raises ``HoldDeadlineExceeded`` when still held after ``deadline_s``
        and ``ShuttingDown`` while draining. A cancelled caller (client gone)
        leaves nothing behind: its ledger entry or its placement is released.
        """
        s = self._s
        if self.draining:
            raise ShuttingDown("router is shutting down")
        now = s.clock()
        decision = s.runner.submit(meta, s.registry.snapshots(), now)
        s.metrics.decision(meta.workload_class, decision)
        if decision.placed:
            assert decision.engine_id is not None
            self._track(meta, decision.engine_id, now)
            return decision.engine_id, 0.0
        s.metrics.held.labels(meta.workload_class, decision.reason.value).inc()
        fut: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
        self._waiters[meta.request_id] = fut
        s.touch()
        try:
            async with asyncio.timeout(deadline_s):
                decision = await fut
        except TimeoutError:
            if not _has_result(fut):
                self._give_up(meta, now, Outcome.HOLD_DEADLINE)
                raise HoldDeadlineExceeded(
                    f"request held for {deadline_s:g} s without capacity "
                    f"(class {meta.workload_class!r}); retry later",
                    retry_after_s=s.config.hold_retry_after_s,
                ) from None
            decision = fut.result()  # placed in the same instant the deadline passed
        except ShuttingDown:
            self._give_up(meta, now, Outcome.SHUTDOWN)
            raise
        except asyncio.CancelledError:
            if _has_result(fut):
                engine = fut.result().engine_id
                assert engine is not None
                self.finish(meta, engine, _aborted(meta), Outcome.CLIENT_DISCONNECT)
            else:
                self._give_up(meta, now, Outcome.CLIENT_DISCONNECT)
            raise
        held_s = s.clock() - now
        s.metrics.hold_wait.labels(meta.workload_class, "placed").observe(held_s)
        assert decision.engine_id is not None
        return decision.engine_id, held_s

    def _give_up(self, meta: RequestMeta, held_since: float, outcome: str) -> None:
        s = self._s
        self._waiters.pop(meta.request_id, None)
        now = s.clock()
        s.runner.cancel(meta.request_id, now)
        s.metrics.hold_wait.labels(meta.workload_class, outcome).observe(now - held_since)
        s.metrics.requests.labels(meta.workload_class, outcome).inc()
        # The class's queue head may have moved: let the next one try.
        self.kick()
        s.touch()

    def _track(self, meta: RequestMeta, engine_id: str, now: float) -> None:
        self.in_flight[meta.request_id] = InFlight(meta, engine_id, now)
        self._idle.clear()
        self._s.touch()  # in flight changed: observable through wait_until, as a finish is

    def finish(self, meta: RequestMeta, engine_id: str, completion: Completion, outcome: str) -> None:
        """A placed request ended; accounting is released and held work re-checked."""
        s = self._s
        if self.in_flight.pop(meta.request_id, None) is None:
            return  # already finished (defensive: never finish twice)
        if not self.in_flight:
            self._idle.set()
        now = s.clock()
        s.runner.finish(meta, engine_id, completion, now)
        s.metrics.requests.labels(meta.workload_class, outcome).inc()
        tokens = s.metrics.tokens
        tokens.labels(meta.workload_class, "prompt").inc(completion.prompt_tokens)
        tokens.labels(meta.workload_class, "completion").inc(completion.completion_tokens)
        if completion.cached_tokens:
            tokens.labels(meta.workload_class, "cached").inc(completion.cached_tokens)
        s.sample_meter.observe(s.runner.mixture.total, now, s.config.sample_rate_window_s)
        self.kick()
        s.touch()

    def end_session(self, session_id: str) -> bool:
        s = self._s
        now = s.clock()
        ended = s.runner.end_session(session_id, now)
        s.sample_meter.observe(s.runner.mixture.total, now, s.config.sample_rate_window_s)
        self.kick()
        return ended

    # ---- releasing held work --------------------------------------------

    def kick(self) -> None:
        """Ask the epoch loop to re-check held work now (coalesced)."""
        self._kick.set()

    def release(self) -> int:
        s = self._s
        now = s.clock()
        return self._resolve(s.runner.release(s.registry.snapshots(), now), now)

    def epoch(self) -> int:
        s = self._s
        now = s.clock()
        released = s.runner.epoch(s.registry.snapshots(), now)
        s.sample_meter.observe(s.runner.mixture.total, now, s.config.sample_rate_window_s)
        return self._resolve(released, now)

    def _resolve(self, released: list[tuple[RequestMeta, Decision]], now: float) -> int:
        s = self._s
        for req, decision in released:
            assert decision.engine_id is not None
            s.metrics.decision(req.workload_class, decision)
            self._track(req, decision.engine_id, now)
            fut = self._waiters.pop(req.request_id, None)
            if fut is None or fut.done():
                # Nobody will send it (cannot happen while cancel() is synchronous).
                self.finish(req, decision.engine_id, _aborted(req), Outcome.CLIENT_DISCONNECT)
                continue
            fut.set_result(decision)
        return len(released)

    async def run(self) -> None:
        """Epochs every ``policy.admission.epoch_s``; releases in between when kicked."""
        s = self._s
        next_epoch = s.clock() + s.config.policy.admission.epoch_s
        while True:
            await wait_event(self._kick, max(0.0, next_epoch - s.clock()))
            self._kick.clear()
            try:
                if s.clock() >= next_epoch:
                    self.epoch()
                    next_epoch = s.clock() + s.config.policy.admission.epoch_s
                else:
                    self.release()
            except Exception:  # a policy bug must not stop admission for good
                log.exception("epoch failed")

    # ---- shutdown -------------------------------------------------------

    def fail_held(self) -> None:
        for rid, fut in list(self._waiters.items()):
            if not fut.done():
                fut.set_exception(ShuttingDown("router is shutting down"))
            self._waiters.pop(rid, None)

    async def wait_idle(self, timeout_s: float) -> bool:
        return await wait_event(self._idle, timeout_s)

    def held_waiters(self) -> int:
        return len(self._waiters)


def _has_result(fut: asyncio.Future[Decision]) -> bool:
    return fut.done() and not fut.cancelled() and fut.exception() is None


def _aborted(meta: RequestMeta) -> Completion:
    return Completion(prompt_tokens=meta.prompt_tokens, completion_tokens=0, ok=False)


class RouterState:
    """Everything one router app owns."""

    def __init__(
        self,
        config: RouterConfig,
        *,
        admin_token: str | None,
        config_path: Path | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        self.config = config
        self.config_hash = config.config_hash()
        self.admin_token = admin_token
        self.config_path = config_path
        self.clock = clock
        self.last_reload_error: str | None = None
        self.runner = PolicyRunner(build_policy(config.policy, config.workloads), config.workloads)
        self.registry = EngineRegistry(
            clock, on_down=self._engine_down, on_up=self._engine_up, on_removed=self._engine_removed
        )
        self._pending_release: dict[str, asyncio.TimerHandle] = {}
        self.metrics = RouterMetrics(self.status)
        self.sample_meter = SampleRateMeter(clock())
        self.dispatcher = Dispatcher(self)
        self.engines_changed = asyncio.Event()
        """Set by a reload that changed ``engines``: the resolver re-reads the config at once."""
        self.upstream: aiohttp.ClientSession | None = None
        self.probe_session: aiohttp.ClientSession | None = None
        self._changed = asyncio.Event()
        urls = config.engines.static_urls()
        if urls is not None:
            self.registry.set_engines(urls)

    def touch(self) -> None:
        """Wake everything in ``wait_until``: some observable state changed."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def wait_until(self, predicate: Callable[[], bool], timeout_s: float) -> None:
        """Wait, bounded, until ``predicate()`` holds; re-checked after every ``touch()``.

        For callers that must observe a state change (tests, the admin API)
        without polling; raises ``TimeoutError`` past ``timeout_s``.
        """
        async with asyncio.timeout(timeout_s):
            while not predicate():
                await self._changed.wait()

    def _engine_down(self, engine_id: str) -> None:
        """Out of rotation: nothing new goes there at once; the books are released after a grace."""
        grace = self.config.release_down_engine_after_s
        if grace <= 0:
            self._engine_removed(engine_id)
            return
        if engine_id not in self._pending_release:
            loop = asyncio.get_running_loop()
            self._pending_release[engine_id] = loop.call_later(grace, self._release_if_still_down, engine_id)
        self.dispatcher.kick()
        self.touch()

    def _release_if_still_down(self, engine_id: str) -> None:
        self._pending_release.pop(engine_id, None)
        state = self.registry.get(engine_id)
        if state is None or not state.healthy:
            self._engine_removed(engine_id)

    def _engine_removed(self, engine_id: str) -> None:
        handle = self._pending_release.pop(engine_id, None)
        if handle is not None:
            handle.cancel()
        self.runner.remove_engine(engine_id, self.clock())
        self.dispatcher.kick()
        self.touch()

    def _engine_up(self, engine_id: str) -> None:
        handle = self._pending_release.pop(engine_id, None)
        if handle is not None:
            handle.cancel()
        self.dispatcher.kick()
        self.touch()

    def on_scraped(self) -> None:
        self.runner.on_metrics(self.registry.snapshots(), self.clock())
        self.dispatcher.kick()
        self.touch()

    @property
    def ready(self) -> bool:
        return self.registry.healthy_count() > 0 and not self.dispatcher.draining

    def session(self) -> aiohttp.ClientSession:
        if self.upstream is None:
            raise ShuttingDown("router is not running")
        return self.upstream

    def status(self) -> RouterStatus:
        now = self.clock()
        per_engine: dict[str, int] = {}
        for f in self.dispatcher.in_flight.values():
            per_engine[f.engine_id] = per_engine.get(f.engine_id, 0) + 1
        return build_status(
            config=self.config,
            config_hash=self.config_hash,
            runner=self.runner,
            registry=self.registry,
            in_flight_per_engine=per_engine,
            requests_in_flight=len(self.dispatcher.in_flight),
            sample_rate_per_min=self.sample_meter.per_minute(now, self.config.sample_rate_window_s),
            draining=self.dispatcher.draining,
            last_reload_error=self.last_reload_error,
            now=now,
        )


STATE = web.AppKey("misat_state", RouterState)

# ---- the edge: domain errors -> HTTP --------------------------------------

_HTTP_STATUS: dict[type[RouterError], int] = {
    BodyTooLarge: 413,
    ConfigRejected: 400,
    InvalidRequest: 400,
    NotFound: 404,
    Unauthorized: 401,
    AdminDisabled: 403,
    StaleConfig: 409,
    UpstreamUnavailable: 502,
    HoldDeadlineExceeded: 503,
    ShuttingDown: 503,
}
INTERNAL_ERROR_STATUS = 500


def http_status(exc: RouterError) -> int:
    for cls in type(exc).__mro__:
        if cls in _HTTP_STATUS:
            return _HTTP_STATUS[cls]  # type: ignore[index]
    return INTERNAL_ERROR_STATUS


def error_response(exc: RouterError) -> web.Response:
    headers = {}
    if isinstance(exc, HoldDeadlineExceeded):
        headers["Retry-After"] = str(exc.retry_after_s)
    if isinstance(exc, Unauthorized):
        headers["WWW-Authenticate"] = "Bearer"
    return web.json_response(error_body(exc), status=http_status(exc), headers=headers)


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], object]
) -> web.StreamResponse:
    try:
        return await handler(request)  # type: ignore[misc,no-any-return]
    except RouterError as exc:
        if isinstance(exc, InvalidRequest):
            request.app[STATE].metrics.invalid.inc()
        return error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        # aiohttp's own refusals (unknown path, wrong method) in the same OpenAI shape.
        body = openai_error_body(
            exc.reason, _HTTP_ERROR_TYPES.get(exc.status, "invalid_request_error"),
            code=exc.reason.lower().replace(" ", "_"),
        )
        headers = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
        return web.json_response(body, status=exc.status, headers=headers)
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        body = openai_error_body("internal router error", "server_error", code="internal_error")
        return web.json_response(body, status=INTERNAL_ERROR_STATUS)


_HTTP_ERROR_TYPES = {404: "not_found_error", 405: "invalid_request_error"}
"""OpenAI ``error.type`` of aiohttp's own HTTP errors (others: ``invalid_request_error``)."""


# ---- small endpoints -------------------------------------------------------


async def handle_health(request: web.Request) -> web.Response:
    return web.json_response({"status": "alive"})


async def handle_ready(request: web.Request) -> web.Response:
    s = request.app[STATE]
    body = {
        "ready": s.ready,
        "generation": s.config.generation,
        "healthy_engines": s.registry.healthy_count(),
        "draining": s.dispatcher.draining,
    }
    return web.json_response(body, status=200 if s.ready else 503)


async def handle_status(request: web.Request) -> web.Response:
    return web.json_response(text=request.app[STATE].status().model_dump_json())


async def handle_metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


# ---- lifecycle ------------------------------------------------------------


async def _sessions_ctx(app: web.Application) -> AsyncIterator[None]:
    s = app[STATE]
    s.upstream = aiohttp.ClientSession(
        connector=RecentFirstConnector(
            limit=s.config.upstream_max_connections or 0, keepalive_timeout=s.config.upstream_keepalive_s
        ),
        auto_decompress=False,
        timeout=aiohttp.ClientTimeout(total=None),
    )
    s.probe_session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit_per_host=PROBE_CONNECTIONS_PER_ENGINE, limit=0),
    )
    yield
    await s.upstream.close()
    await s.probe_session.close()
    s.upstream = None


async def resolve_engines_loop(s: RouterState) -> None:
    """Keep the registry in step with the config: static URLs, or DNS of a headless Service."""
    while True:
        s.engines_changed.clear()
        engines = s.config.engines
        if engines.service is not None:
            try:
                s.registry.set_engines(await resolve_service(engines.service))
            except OSError as exc:  # keep the last good set
                log.warning("cannot resolve %s: %s", engines.service.name, exc)
        else:
            s.registry.set_engines(engines.static_urls() or ())
        await wait_event(s.engines_changed, engines.resolve_interval_s)


async def _background_ctx(app: web.Application) -> AsyncIterator[None]:
    from .reload import watch_config_file

    s = app[STATE]
    assert s.probe_session is not None
    stop = asyncio.Event()
    probes = EngineProbes(s.registry, s.probe_session, lambda: s.config, s.clock, s.on_scraped)
    coros = [
        resolve_engines_loop(s),
        probes.run_health(stop),
        probes.run_scrape(stop),
        s.dispatcher.run(),
    ]
    if s.config_path is not None:
        coros.append(watch_config_file(s, s.config_path))
    tasks = [asyncio.create_task(c) for c in coros]
    yield
    stop.set()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _drain(app: web.Application) -> None:
    s = app[STATE]
    d = s.dispatcher
    d.draining = True
    d.fail_held()
    if d.in_flight:
        log.info("draining %d in-flight requests", len(d.in_flight))
        if not await d.wait_idle(s.config.drain_timeout_s):
            log.warning("drain timeout: %d requests still in flight", len(d.in_flight))


def create_app(
    config: RouterConfig,
    *,
    admin_token: str | None,
    config_path: str | Path | None = None,
    clock: Clock = time.monotonic,
) -> web.Application:
    """Build the router app; ``config_path`` (optional) is a file watched for reloads."""
    from . import admin, proxy

    app = web.Application(middlewares=[error_middleware])
    app[STATE] = RouterState(
        config,
        admin_token=admin_token,
        config_path=Path(config_path) if config_path is not None else None,
        clock=clock,
    )
    app.router.add_get("/health", handle_health)
    app.router.add_get("/ready", handle_ready)
    app.router.add_get("/status", handle_status)
    app.router.add_get("/metrics", handle_metrics)
    proxy.add_routes(app)
    admin.add_routes(app)
    app.cleanup_ctx.append(_sessions_ctx)
    app.cleanup_ctx.append(_background_ctx)
    app.on_shutdown.append(_drain)
    return app
