"""Reading engines: the periodic health-check and ``/metrics`` scrape loops.

A scraped page is parsed by the vLLM metrics contract
(``vllm_metrics.parse_vllm_page``) and recorded in the engine registry.

``EngineProbes`` runs two loops: health checks of every engine each
``health_interval_s`` and a metrics scrape of every healthy engine each
``scrape_interval_s``. Each tick probes all engines concurrently, with a
per-probe timeout, and after a scrape tick tells its owner once (so the
policy's ``on_metrics`` sees one consistent mapping per tick). A scrape tick
waits for its scrapes at most one interval: a slow engine's scrape (up to
``scrape_timeout_s``) goes on in the background and is not started again
while it runs, so one slow ``/metrics`` does not make every engine's
readings older. Intervals are read from the current config on every tick,
so a reload takes effect at once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import aiohttp

from .config import RouterConfig
from .engines import EngineRegistry
from .vllm_metrics import parse_vllm_page

log = logging.getLogger(__name__)

class EngineProbes:
    """Health checks and metrics scrapes of every registered engine."""

    def __init__(
        self,
        registry: EngineRegistry,
        session: aiohttp.ClientSession,
        config: Callable[[], RouterConfig],
        clock: Callable[[], float],
        on_scraped: Callable[[], None],
    ) -> None:
        self._registry = registry
        self._session = session
        self._config = config
        self._clock = clock
        self._on_scraped = on_scraped
        self._scraping: dict[str, asyncio.Task[None]] = {}
        """Scrapes in flight by engine (one at most each)."""

    async def check_health(self, engine_id: str) -> None:
        cfg = self._config()
        ok, error = False, None
        try:
            timeout = aiohttp.ClientTimeout(total=cfg.health_timeout_s)
            async with self._session.get(f"{engine_id}/health", timeout=timeout) as resp:
                ok = resp.status == 200
                if not ok:
                    error = f"/health answered {resp.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            error = f"/health failed: {type(exc).__name__}: {exc}"
        self._registry.record_health(
            engine_id,
            ok,
            down_after=cfg.unhealthy_after_failures,
            up_after=cfg.healthy_after_successes,
            error=error,
        )

    async def scrape(self, engine_id: str) -> None:
        cfg = self._config()
        error: str | None = None
        try:
            timeout = aiohttp.ClientTimeout(total=cfg.scrape_timeout_s)
            async with self._session.get(f"{engine_id}/metrics", timeout=timeout) as resp:
                if resp.status != 200:
                    error = f"/metrics answered {resp.status}"
                else:
                    metrics, seen = parse_vllm_page(await resp.text())
                    if not seen:
                        error = "/metrics holds no vLLM metric"
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError, ArithmeticError) as exc:
            # ValueError covers UnicodeDecodeError and unparsable pages.
            error = f"/metrics failed: {type(exc).__name__}: {exc}"[:300]
        now = self._clock()
        if error is not None:
            # Health checks decide rotation; placement falls back to the router's own
            # counts for this engine (EngineRegistry.record_scrape_failure).
            if self._registry.record_scrape_failure(engine_id, error, now):
                log.warning(
                    "metrics of %s unusable (%s); placing on the router's own counts until "
                    "a scrape succeeds", engine_id, error,
                )
            else:
                log.debug("scrape of %s failed again: %s", engine_id, error)
            return
        if self._registry.record_metrics(engine_id, metrics, now):
            log.info("metrics of %s usable again", engine_id)

    async def health_tick(self) -> None:
        await asyncio.gather(*(self.check_health(e) for e in self._registry.ids()))

    async def scrape_tick(self) -> None:
        healthy = [e for e in self._registry.ids() if (st := self._registry.get(e)) and st.healthy]
        for e in healthy:
            if e not in self._scraping:
                task = asyncio.create_task(self.scrape(e), name=f"scrape {e}")
                self._scraping[e] = task
                task.add_done_callback(functools.partial(self._scrape_done, e))
        pending = [t for e in healthy if (t := self._scraping.get(e)) is not None]
        if pending:
            await asyncio.wait(pending, timeout=self._config().scrape_interval_s)
        self._on_scraped()

    def _scrape_done(self, engine_id: str, task: asyncio.Task[None]) -> None:
        if self._scraping.get(engine_id) is task:
            del self._scraping[engine_id]
        if not task.cancelled() and (exc := task.exception()) is not None:  # a bug: scrape catches I/O errors
            log.error("scrape of %s failed", engine_id, exc_info=exc)

    async def run_health(self, stop: asyncio.Event) -> None:
        await every(stop, lambda: self._config().health_interval_s, self.health_tick, self._clock)

    async def run_scrape(self, stop: asyncio.Event) -> None:
        try:
            await every(stop, lambda: self._config().scrape_interval_s, self.scrape_tick, self._clock)
        finally:
            await cancel_all(list(self._scraping.values()))


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait for ``event`` at most ``timeout_s``; True when it was set.

    ``asyncio.timeout`` rather than ``asyncio.wait_for``: on Python 3.11
    ``wait_for`` can swallow a cancellation that races with the event being
    set, which leaves a background loop running after shutdown cancelled it.
    """
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return False
    return True


async def cancel_all(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel ``tasks`` and wait until every one has ended (whatever it raised)."""
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def every(
    stop: asyncio.Event, interval: Callable[[], float], tick: Callable[[], Awaitable[None]],
    clock: Callable[[], float],
) -> None:
    """Run ``tick`` now and then every ``interval()`` seconds until ``stop`` is set.

    The interval runs from one tick's start to the next: a tick's own time (many engines,
    a slow one up to its timeout) does not stretch it. A tick that takes longer than the
    interval is followed by the next at once, never by two.
    """
    while not stop.is_set():
        started = clock()
        try:
            await tick()
        except Exception:  # a probe bug must not stop probing
            log.exception("probe tick failed")
        await wait_event(stop, max(0.0, started + interval() - clock()))
