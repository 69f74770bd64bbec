"""Reading engines: vLLM ``/metrics`` parsing (pure) and the periodic probe loops.

``parse_vllm_metrics`` turns one Prometheus text page into ``VllmMetrics``
using vLLM's metric names (``docs/real-vllm.md``). A server with several
internal engines (label ``engine``) is summed: counts and counters add up,
KV usage is the capacity-weighted mean, KV capacity is the sum of
``num_gpu_blocks * block_size`` from each ``vllm:cache_config_info``.

``EngineProbes`` runs two loops: health checks of every engine each
``health_interval_s`` and a metrics scrape of every healthy engine each
``scrape_interval_s``. Each tick probes all engines concurrently, with a
per-probe timeout, and after a scrape tick tells its owner once (so the
policy's ``on_metrics`` sees one consistent mapping per tick). Intervals are
read from the current config on every tick, so a reload takes effect at once.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from .config import RouterConfig
    from .engines import EngineRegistry

log = logging.getLogger(__name__)

KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
"""KV usage gauge (0..1); the second is the name before vLLM 0.10."""
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
PREFIX_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
PREFIX_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
PREEMPTIONS = "vllm:num_preemptions_total"
CACHE_CONFIG = "vllm:cache_config_info"


@dataclass(frozen=True, slots=True)
class VllmMetrics:
    """What the router reads from one engine's ``/metrics``."""

    kv_capacity_tokens: int = 0
    kv_usage: float = 0.0
    num_running: int = 0
    num_waiting: int = 0
    prefix_queries_total: float = 0.0
    prefix_hits_total: float = 0.0
    preemptions_total: float = 0.0


def _int_label(labels: dict[str, str], key: str) -> int:
    try:
        value = float(labels.get(key, "0"))
    except ValueError:  # vLLM writes "None" for unset values
        return 0
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"label {key}={labels.get(key)!r} is not a count")
    return int(value)


def parse_vllm_metrics(text: str) -> VllmMetrics:
    """Parse a Prometheus text page; unknown metrics are ignored, missing ones read as 0.

    Raises ``ValueError`` when the page is not Prometheus text or a vLLM value
    is not a finite, non-negative number.
    """
    return parse_vllm_page(text)[0]


def parse_vllm_page(text: str) -> tuple[VllmMetrics, bool]:
    """``parse_vllm_metrics`` plus whether the page held any vLLM metric at all.

    A page without one (empty, another exporter's) tells the router nothing,
    so a scrape treats it as failed rather than as an idle, empty engine.
    """
    seen = False
    usage: dict[str, float] = {}
    capacity: dict[str, int] = {}
    running = waiting = 0.0
    queries = hits = preemptions = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.startswith("vllm:"):
                continue
            seen = True
            if not math.isfinite(s.value) or s.value < 0:
                raise ValueError(f"{s.name} has the value {s.value}")
            engine = s.labels.get("engine", "")
            if s.name in KV_USAGE:
                usage[engine] = s.value
            elif s.name == RUNNING:
                running += s.value
            elif s.name == WAITING:
                waiting += s.value
            elif s.name in PREFIX_QUERIES:
                queries += s.value
            elif s.name in PREFIX_HITS:
                hits += s.value
            elif s.name == PREEMPTIONS:
                preemptions += s.value
            elif s.name in (CACHE_CONFIG, CACHE_CONFIG + "_info"):
                blocks = _int_label(s.labels, "num_gpu_blocks")
                capacity[engine] = blocks * _int_label(s.labels, "block_size")
    total_cap = sum(capacity.values())
    if total_cap > 0 and set(usage) <= set(capacity):
        kv_usage = sum(u * capacity.get(e, 0) for e, u in usage.items()) / total_cap
    else:
        kv_usage = sum(usage.values()) / len(usage) if usage else 0.0
    metrics = VllmMetrics(
        kv_capacity_tokens=total_cap,
        kv_usage=kv_usage,
        num_running=round(running),
        num_waiting=round(waiting),
        prefix_queries_total=queries,
        prefix_hits_total=hits,
        preemptions_total=preemptions,
    )
    return metrics, seen


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
        await asyncio.gather(*(self.scrape(e) for e in healthy))
        self._on_scraped()

    async def run_health(self, stop: asyncio.Event) -> None:
        await _every(stop, lambda: self._config().health_interval_s, self.health_tick)

    async def run_scrape(self, stop: asyncio.Event) -> None:
        await _every(stop, lambda: self._config().scrape_interval_s, self.scrape_tick)


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


async def _every(
    stop: asyncio.Event, interval: Callable[[], float], tick: Callable[[], Awaitable[None]]
) -> None:
    """Run ``tick`` now and then every ``interval()`` seconds until ``stop`` is set."""
    while not stop.is_set():
        try:
            await tick()
        except Exception:  # a probe bug must not stop probing
            log.exception("probe tick failed")
        await wait_event(stop, interval())
