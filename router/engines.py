"""The engine registry: which engines exist, which are healthy, and their latest metrics.

The registry is the one owner of per-engine state. It hands the policy an
immutable ``Mapping[str, EngineSnapshot]`` (rebuilt only when something
changed) and tells its owner, through callbacks, when an engine leaves
rotation (failed health checks and connect timeouts while proxying, counted
together; a refused or broken connection while proxying, at once; or gone
from the config/DNS) and when one comes back, so the owner can release the
policy's accounting (``runner.remove_engine``) and re-check held work.

Router shards (``sharding.py``) filter the engines through an ownership
function. An engine a returning peer takes back while it is still in the pool
can be *handed back* with a drain instead of dropped: it stays here, probed
and scraped, for the sessions this router placed on it (the policy runner
treats it as draining: continuations only) until ``settle_hand_backs`` finds
none of them active any more.

An engine whose cumulative counters go back between two good scrapes has
restarted (vLLM's counters live as long as its process; one URL must address
one engine process). Its KV cache is empty and it serves the weights it
loaded at start, not the ones a trainer pushed since: the owner is told
(``on_restarted``), and may *hold* it (``hold``): healthy, probed and
scraped, and a target of engine-wide calls, but offered to the policy as not
healthy until ``release_hold``. So may an engine new to the pool (a new
address: a replaced pod, a scale-up; ``on_joined``) once a trainer has
versioned the others' weights.

Engine ids are base URLs without a trailing slash (``http://10.0.0.5:8000``).
Engines start out of rotation until their first health check passes.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from .config import ServiceRef
from .policy.types import EngineSnapshot
from .vllm_metrics import VllmMetrics

log = logging.getLogger(__name__)

Clock = Callable[[], float]
EngineCallback = Callable[[str], None]
OwnershipFilter = Callable[[list[str]], list[str]]
"""The known engine ids (in order) -> those this router owns."""
HandBackEnd = Literal["drained", "idle"]
"""How the drain of a handed-back engine ended: no session of this router left on it, or none
with a request in the last ``hand_back_idle_s`` (they moved to their home shard, or pause long)."""


@dataclass(slots=True)
class EngineState:
    """Mutable, registry-private state of one engine."""

    engine_id: str
    healthy: bool = False
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    metrics: VllmMetrics | None = None
    scraped_at: float = 0.0
    last_error: str | None = None
    down_since: float | None = field(default=None)
    scrape_failed_at: float | None = None
    """When the latest scrape of a failing streak failed; None while scrapes succeed."""
    restarts: int = 0
    """Restarts seen (cumulative counters went back between two good scrapes)."""
    held: str | None = None
    """Why the engine is held out of placement although healthy (``EngineRegistry.hold``)."""


class EngineRegistry:
    """Engines by id, their health, and their last scraped metrics."""

    def __init__(
        self,
        clock: Clock,
        *,
        on_down: EngineCallback,
        on_up: EngineCallback,
        on_removed: EngineCallback,
        on_restarted: EngineCallback | None = None,
        on_joined: EngineCallback | None = None,
    ) -> None:
        self._clock = clock
        self._on_down = on_down
        self._on_up = on_up
        self._on_removed = on_removed
        self._on_restarted = on_restarted
        self._on_joined = on_joined
        self._engines: dict[str, EngineState] = {}
        self._known: list[str] = []
        self._owns: OwnershipFilter | None = None
        self.hand_back_idle_s = 0.0
        """``shards.handback_idle_s``: an engine this router stops owning (but the pool still has)
        is kept while a session placed on it had a request within this long; 0 drops it at once."""
        self._hand_back_since: dict[str, float] = {}
        """Engines held only to finish this router's sessions on them, with when their drain began."""
        self.handing_back: frozenset[str] = frozenset()
        """The keys of ``_hand_back_since`` (not owned; not admin targets), as the set the admission
        path joins to the draining engines on every request."""
        self._snapshot: Mapping[str, EngineSnapshot] | None = None
        self.changed = asyncio.Event()
        """Set whenever the set of engines changes (the probe supervisor waits on it)."""

    # ---- membership -----------------------------------------------------

    def set_ownership(self, owns: OwnershipFilter | None) -> tuple[list[str], list[str]]:
        """Hold only the engines ``owns`` picks from the known list (router shards, ``sharding.py``);
        None: every known engine. Re-applied on every ``set_engines``; returns (added, removed)."""
        self._owns = owns
        return self.refilter()

    def refilter(self) -> tuple[list[str], list[str]]:
        """Apply the ownership filter again (a peer shard went down or came back)."""
        return self.set_engines(self._known)

    def known_ids(self) -> list[str]:
        """Every engine of the config or DNS, owned by this router or not."""
        return list(self._known)

    def set_engines(self, engine_ids: Iterable[str]) -> tuple[list[str], list[str]]:
        """Make the registry hold exactly ``engine_ids`` (those this router owns of them, when an
        ownership filter is set, plus those it hands back with a drain); returns (added, no longer
        owned: dropped, or handed back)."""
        before = set(self._known)
        self._known = list(dict.fromkeys(engine_ids))
        wanted = self._owns(self._known) if self._owns is not None else list(self._known)
        wanted_set, known = set(wanted), set(self._known)
        # An engine handed back and owned again is simply owned again (its state and books kept).
        reclaimed = [e for e in wanted if e in self.handing_back]
        added = [e for e in wanted if e not in self._engines]
        gone = [e for e in self._engines if e not in wanted_set]
        # Handed back with a drain: still in the pool, and this router may keep it for its sessions.
        kept = {e for e in gone if e in known and (e in self.handing_back or self.hand_back_idle_s > 0)}
        removed = [e for e in gone if e not in kept]
        starting = [e for e in gone if e in kept and e not in self.handing_back]
        for e in added:
            self._engines[e] = EngineState(e)
            log.info("engine added: %s", e)
            # New to the pool, not only to this shard (a peer's engines taken over have served all along).
            if e not in before and self._on_joined is not None:
                self._on_joined(e)
        for e in reclaimed:
            del self._hand_back_since[e]
            log.info("engine owned again before its hand-back ended: %s", e)
        for e in starting:
            self._hand_back_since[e] = self._clock()
            log.info("engine handed back, draining this router's sessions on it: %s", e)
        for e in removed:
            self._hand_back_since.pop(e, None)
        self.handing_back = frozenset(self._hand_back_since)  # before the callbacks below see it
        for e in removed:
            del self._engines[e]
            log.info("engine removed: %s", e)
            self._on_removed(e)
        if added or removed or reclaimed or starting:
            self._invalidate()
            self.changed.set()
        return added, removed + starting

    def settle_hand_backs(self, last_active: Mapping[str, float]) -> list[tuple[str, HandBackEnd]]:
        """End the drains that are over. ``last_active``: per engine, when a session of this
        router placed on it last had a request (now, for one in flight); an engine absent from it
        has none left. A handed-back engine is dropped (its books released through
        ``on_removed``) when it has no session left (``drained``) or none active within
        ``hand_back_idle_s`` of now, the hand-back's start counting as activity (``idle``: those
        sessions' next turns, if any, go to this router's own engines). Returns the engines
        dropped, with how their drain ended."""
        if not self.handing_back:
            return []
        now = self._clock()
        ended: list[tuple[str, HandBackEnd]] = []
        for e in sorted(self.handing_back):
            last = last_active.get(e)
            if last is None:
                ended.append((e, "drained"))
            elif now - max(last, self._hand_back_since[e]) >= self.hand_back_idle_s:
                ended.append((e, "idle"))
        if not ended:
            return []
        for e, how in ended:
            del self._hand_back_since[e]
            del self._engines[e]
            log.info("engine hand-back ended (%s), removed: %s", how, e)
        self.handing_back = frozenset(self._hand_back_since)
        self._invalidate()
        self.changed.set()
        for e, _ in ended:
            self._on_removed(e)
        return ended

    def ids(self) -> list[str]:
        """Every engine held: owned, and handed back but still draining (probed, scraped, placed on)."""
        return list(self._engines)

    def owned_ids(self) -> list[str]:
        """The engines this router owns: the targets of engine-wide calls and what it reports."""
        if not self.handing_back:
            return list(self._engines)
        return [e for e in self._engines if e not in self.handing_back]

    def get(self, engine_id: str) -> EngineState | None:
        return self._engines.get(engine_id)

    # ---- health ---------------------------------------------------------

    def record_health(
        self, engine_id: str, ok: bool, *, down_after: int, up_after: int, error: str | None = None
    ) -> None:
        """One health check result; flips the engine after enough consecutive results."""
        st = self._engines.get(engine_id)
        if st is None:
            return
        if ok:
            st.consecutive_failures = 0
            st.consecutive_successes += 1
            if not st.healthy and st.consecutive_successes >= up_after:
                self._set_healthy(st, True, None)
        else:
            self.count_failure(engine_id, error, down_after=down_after)

    def count_failure(self, engine_id: str, error: str | None, *, down_after: int) -> None:
        """A failure that may be passing (a failed health check; a connect timeout while proxying):
        the engine leaves rotation after ``down_after`` of them in a row, health checks and
        proxy attempts counted together, and a passed check starts the count again."""
        st = self._engines.get(engine_id)
        if st is None:
            return
        st.consecutive_successes = 0
        st.consecutive_failures += 1
        st.last_error = error
        if st.healthy and st.consecutive_failures >= down_after:
            self._set_healthy(st, False, error)

    def mark_failed(self, engine_id: str, error: str) -> None:
        """A connection refused, reset or broken while proxying: the engine is gone, out of
        rotation at once (a failure that needs no other in a row)."""
        self.count_failure(engine_id, error, down_after=1)

    def _set_healthy(self, st: EngineState, healthy: bool, error: str | None) -> None:
        st.healthy = healthy
        st.down_since = None if healthy else self._clock()
        self._invalidate()
        if healthy:
            log.info("engine healthy: %s", st.engine_id)
            self._on_up(st.engine_id)
        else:
            log.warning("engine out of rotation: %s (%s)", st.engine_id, error)
            self._on_down(st.engine_id)

    def healthy_count(self) -> int:
        """Healthy engines this router owns (one being handed back is its new owner's to count).

        Held engines count: they answer, and the router must stay reachable (ready) for the
        admin call that releases them."""
        return sum(1 for e, st in self._engines.items() if st.healthy and e not in self.handing_back)

    def placeable_count(self) -> int:
        """Healthy engines this router owns that are not held: where new work can go."""
        return sum(1 for e, st in self._engines.items()
                   if st.healthy and st.held is None and e not in self.handing_back)

    def hold(self, engine_id: str, reason: str) -> None:
        """Keep a healthy engine out of placement (the policy sees it as not healthy) until
        ``release_hold``; it stays probed, scraped and a target of engine-wide calls."""
        st = self._engines.get(engine_id)
        if st is None or st.held == reason:
            return
        st.held = reason
        log.warning("engine held out of placement: %s (%s)", engine_id, reason)
        self._invalidate()

    def release_hold(self, engine_id: str) -> bool:
        """Place on a held engine again; True when it was held."""
        st = self._engines.get(engine_id)
        if st is None or st.held is None:
            return False
        st.held = None
        log.info("engine placed on again: %s", engine_id)
        self._invalidate()
        return True

    # ---- metrics --------------------------------------------------------

    def record_metrics(self, engine_id: str, metrics: VllmMetrics, now: float) -> bool:
        """A usable scrape; returns True when it ends a streak of failed scrapes."""
        st = self._engines.get(engine_id)
        if st is None:
            return False
        recovered = st.scrape_failed_at is not None
        restarted = st.metrics is not None and _went_back(st.metrics, metrics)
        st.metrics = metrics
        st.scraped_at = now
        st.scrape_failed_at = None
        self._invalidate()
        if restarted:
            st.restarts += 1
            log.warning("engine restarted (its cumulative counters went back): %s", engine_id)
            if self._on_restarted is not None:
                self._on_restarted(engine_id)
        return recovered

    def record_scrape_failure(self, engine_id: str, error: str, now: float) -> bool:
        """A scrape that gave nothing usable; returns True for the first one of a streak.

        ``/status`` keeps showing the last good metrics (with their age); the
        policy's snapshot falls back to safe estimates (``_snapshot``).
        """
        st = self._engines.get(engine_id)
        if st is None:
            return False
        first = st.scrape_failed_at is None
        st.scrape_failed_at = now
        st.last_error = error
        self._invalidate()
        return first

    # ---- the policy's view ----------------------------------------------

    def snapshots(self) -> Mapping[str, EngineSnapshot]:
        """Immutable snapshots of every engine (unhealthy ones marked so)."""
        if self._snapshot is None:
            self._snapshot = MappingProxyType(
                {e: _snapshot(st) for e, st in self._engines.items()}
            )
        return self._snapshot

    def _invalidate(self) -> None:
        self._snapshot = None


_HOLD_ENDS = ("placed on again once a weight update through /admin/engines/call with weight_version "
              "answers 2xx from it")
"""How any hold ends (``RouterState.record_weight_version``), said in every reason."""


def joined_hold_reason(versions: list[str]) -> str:
    """Why an engine that joined a pool with recorded weight versions is held."""
    return (f"joined after weight version {', '.join(repr(v) for v in versions)} was recorded for the pool: it "
            f"serves the weights it loaded at start; {_HOLD_ENDS}")


def restart_hold_reason(lost_version: str) -> str:
    """Why an engine whose restart lost a recorded weight version is held (``/status``, errors)."""
    return f"restarted: it serves the weights it loaded at start, not weight version {lost_version!r}; {_HOLD_ENDS}"


def _went_back(before: VllmMetrics, after: VllmMetrics) -> bool:
    """Whether a cumulative counter is lower than before: the engine's process started again."""
    return (after.prefix_queries_total < before.prefix_queries_total
            or after.prefix_hits_total < before.prefix_hits_total
            or after.preemptions_total < before.preemptions_total)


def _snapshot(st: EngineState) -> EngineSnapshot:
    m = st.metrics or VllmMetrics()
    healthy = st.healthy and st.held is None
    if st.scrape_failed_at is not None:
        # Metrics unusable (slow, empty, garbage): the load gauges are unknown, so they
        # read 0 and the policy counts the router's own sessions on this engine; KV
        # capacity (static) and the cumulative counters keep their last good values.
        # Stamped with the failed scrape's time, so the policy's per-engine event log
        # (kept "since the last scrape") stays bounded.
        return EngineSnapshot.from_metrics(
            st.engine_id, m.without_load(), healthy=healthy, scraped_at=st.scrape_failed_at
        )
    return EngineSnapshot.from_metrics(
        st.engine_id, m, healthy=healthy, scraped_at=st.scraped_at
    )


def engine_url(scheme: str, host: str, port: int) -> str:
    """A base URL for an address, bracketing IPv6 literals."""
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass
    return f"{scheme}://{host}:{port}"


async def resolve_service(ref: ServiceRef) -> list[str]:
    """Every address a headless Service name resolves to, as sorted engine URLs.

    Uses the event loop's ``getaddrinfo`` (a thread, never blocking the loop).
    A resolution failure raises ``OSError``; the caller keeps the last good set.
    """
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(ref.name, ref.port, type=socket.SOCK_STREAM)
    hosts = sorted({str(info[4][0]) for info in infos})
    return [engine_url(ref.scheme, h, ref.port) for h in hosts]
