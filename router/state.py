"""The router's state: what one router app owns, and the transitions that change it.

``RouterState`` holds the applied config, the ``PolicyRunner``, the engine
registry, the metrics, the ``Dispatcher`` and the upstream sessions; it is
stored on the app under ``STATE`` (a typed ``web.AppKey``). Handlers read it
and change it only through its methods, so every state change is one
synchronous step between two awaits of the one event loop.

All time passed to the policy is ``clock()`` (``time.monotonic`` by default).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
from aiohttp import web

from .config import ConfigError, RouterConfig, parse_config
from .dispatcher import Dispatcher
from .engines import EngineRegistry, joined_hold_reason, restart_hold_reason
from .errors import ConfigRejected, RouterError, ShuttingDown
from .metrics import RouterMetrics
from .policy.registry import build_policy
from .policy.runner import PolicyRunner
from .reload import ReloadResult, changed_fields, check_reload
from .sharding import PeerLiveness, owned_engines
from .status import RouterStatus, SampleRateMeter, ShardStatus, build_status
from .upstream import UpstreamPool

log = logging.getLogger(__name__)

Clock = Callable[[], float]


class RouterState:
    """Everything one router app owns, and the transitions that change it.

    Other modules read fields; they change the state only through methods:
    ``apply_config`` / ``reload`` / ``refuse_config`` (hot reload), ``pause`` /
    ``resume`` (weight updates), ``prefix_caches_reset``, ``begin_drain``, and
    the engine registry's callbacks. Each transition ends with ``touch()`` so
    ``wait_until`` observers see it.
    """

    def __init__(
        self,
        config: RouterConfig,
        *,
        admin_token: str | None,
        config_path: Path | None = None,
        clock: Clock = time.monotonic,
        shard_index: int | None = None,
    ) -> None:
        problem = shard_problem(config, shard_index)
        if problem:
            raise ConfigError(problem)
        self.config = config
        self.config_hash = config.config_hash()
        self.admin_token = admin_token
        self.config_path = config_path
        self.clock = clock
        self.last_reload_error: str | None = None
        self.runner = PolicyRunner(build_policy(config.policy, config.workloads), config.workloads)
        self.registry = EngineRegistry(
            clock, on_down=self._engine_down, on_up=self._engine_up, on_removed=self._engine_removed,
            on_restarted=self._engine_restarted, on_joined=self._engine_joined,
        )
        self._pending_release: dict[str, asyncio.TimerHandle] = {}
        self.metrics = RouterMetrics(self.status)
        self.sample_meter = SampleRateMeter(clock())
        self.dispatcher = Dispatcher(
            runner=self.runner,
            registry=self.registry,
            metrics=self.metrics,
            sample_meter=self.sample_meter,
            config=lambda: self.config,
            clock=clock,
            touch=self.touch,
        )
        self.engines_changed = asyncio.Event()
        """Set by a reload that changed ``engines``: the resolver re-reads the config at once."""
        self.upstream: aiohttp.ClientSession | None = None
        """The control plane's calls to engines (admin fan-out, pass-through); not generation."""
        self.upstream_pool: UpstreamPool | None = None
        """The data plane's pooled connections to the engines (``upstream.py``)."""
        self.probe_session: aiohttp.ClientSession | None = None
        self.pause_mode: str | None = None
        """``wait``, ``abort`` or ``keep`` while paused (``/admin/pause?mode=``)."""
        self.engines_paused: set[str] = set()
        """Engines this router paused through vLLM's own ``/pause`` (resumed by ``resume``)."""
        self.engines_frozen: set[str] = set()
        """Of those, the engines a keep pause froze with requests in flight: their silence is expected
        until the resume (``UpstreamPool.freeze``)."""
        self.weight_versions: dict[str, str | None] = {}
        """Weight version per engine as last recorded (``/admin/resume``, ``/admin/engines/call``)."""
        self._changed = asyncio.Event()
        self._observers = 0
        """Callers inside ``wait_until``."""
        self.shard_index = shard_index if config.shards is not None else None
        """This router's shard index (``config.shards``); None when it is the only router."""
        self.peers: PeerLiveness | None = None
        if config.shards is not None and shard_index is not None:
            self.peers = PeerLiveness(len(config.shards.peers), shard_index)
            self.registry.hand_back_idle_s = config.shards.handback_idle_s
            self.registry.set_ownership(self._owned)
        urls = config.engines.static_urls()
        if urls is not None:
            self.registry.set_engines(urls)

    def touch(self) -> None:
        """Wake everything in ``wait_until``: some observable state changed.

        Called twice per request (placed, finished): without a waiter it costs a compare."""
        if self._observers:
            changed, self._changed = self._changed, asyncio.Event()
            changed.set()

    async def wait_until(self, predicate: Callable[[], bool], timeout_s: float) -> None:
        """Wait, bounded, until ``predicate()`` holds; re-checked after every ``touch()``.

        For callers that must observe a state change (tests, the admin API)
        without polling; raises ``TimeoutError`` past ``timeout_s``.
        """
        self._observers += 1
        try:
            async with asyncio.timeout(timeout_s):
                while not predicate():
                    await self._changed.wait()
        finally:
            self._observers -= 1

    # ---- transitions: configuration ----------------------------------------

    def apply_config(self, new: RouterConfig, source: str) -> ReloadResult:
        """Apply ``new`` atomically (no await inside), or raise without changing anything.

        What a reload keeps and what it rebuilds is described in ``reload.py``.
        """
        old = self.config
        new_hash = new.config_hash()
        # Counted in the same synchronous step as the apply: the live work the new config takes over.
        n_in_flight, n_held = len(self.dispatcher.in_flight), self.runner.held_count()
        if new_hash == self.config_hash:
            return ReloadResult(False, old.generation, self.config_hash, (),
                                requests_in_flight=n_in_flight, held_requests=n_held)
        if (new.shards is None) != (old.shards is None):
            # A router's shard index is fixed at start-up (``--shard-index``): turning sharding on
            # or off is a restart of the router pods, which the operator's rendering does.
            raise ConfigRejected("'shards' cannot be added or removed by a reload; restart the router")
        problem = shard_problem(new, self.shard_index)
        if problem:
            raise ConfigRejected(problem)
        runner = self.runner
        live = set(runner.active_sessions()) | {e.req.workload_class for e in runner.held()}
        check_reload(old, new, live)
        changes = changed_fields(old, new)
        now = self.clock()
        rebuilt = False
        if old.policy != new.policy or old.workloads != new.workloads:
            # Knob changes are applied in place (what the policy learned survives); a change
            # of policy hands the live state (held, sessions, in flight) to a new policy object.
            in_flight = [(f.meta, f.engine_id) for f in self.dispatcher.in_flight.values()]
            rebuilt = runner.apply_settings(new.policy, new.workloads, now, in_flight)
            if rebuilt:
                runner.on_metrics(self.registry.snapshots(), now)
        self.config = new
        self.config_hash = new_hash
        self.last_reload_error = None
        if self.upstream_pool is not None:  # per-request timeouts follow the config; pool sizes are start-up only
            self.upstream_pool.connect_timeout_s = new.upstream_connect_timeout_s
            self.upstream_pool.read_timeout_s = new.upstream_timeout_s
        if old.shards != new.shards and new.shards is not None and self.peers is not None:
            self.peers.resize(len(new.shards.peers))
            self.registry.hand_back_idle_s = new.shards.handback_idle_s
            self.registry.refilter()
            self.dispatcher.settle_hand_backs()
        if old.engines != new.engines:
            urls = new.engines.static_urls()
            if urls is not None:
                self.registry.set_engines(urls)
            self.engines_changed.set()
        self.metrics.reloads.labels(source, "applied").inc()
        log.info(
            "config generation %d applied from %s (hash %s; changed: %s)",
            new.generation, source, new_hash, ", ".join(changes) or "nothing",
        )
        self.dispatcher.kick()
        self.touch()
        return ReloadResult(True, new.generation, new_hash, changes, rebuilt,
                            requests_in_flight=n_in_flight, held_requests=n_held)

    def refuse_config(self, source: str, reason: str) -> None:
        """Record a refused reload (shown in /status as ``last_reload_error``); the old config stays."""
        self.last_reload_error = reason
        self.metrics.reloads.labels(source, "refused").inc()
        log.warning("config from %s refused, old one kept: %s", source, reason)
        self.touch()

    def reload(self, data: bytes, source: str) -> ReloadResult:
        """Parse and apply a config document; every refusal is recorded and re-raised as a domain error."""
        try:
            new = parse_config(data)
        except ConfigError as exc:
            self.refuse_config(source, str(exc))
            raise ConfigRejected(f"invalid config: {exc}") from None
        try:
            return self.apply_config(new, source)
        except RouterError as exc:
            self.refuse_config(source, exc.message)
            raise

    # ---- transitions: weight updates and shutdown -------------------------

    def pause(self, mode: str = "wait") -> None:
        """Hold all new work; ``mode`` says what happens to the requests in flight (the admin
        API aborts them for ``abort``; they continue for ``wait``)."""
        self.runner.paused = True
        self.pause_mode = mode
        self._admission_changed()

    def freeze_engines(self, engines: set[str]) -> None:
        """A keep pause froze these engines' requests: paused through vLLM, and silent by design."""
        self.engines_paused |= engines
        self.engines_frozen |= engines
        if self.upstream_pool is not None:
            self.upstream_pool.freeze(engines)

    def resume(self) -> None:
        """Admit again; held work is re-checked at once. The engines' own pauses are forgotten
        (the admin API has resumed them)."""
        self.runner.paused = False
        self.pause_mode = None
        self.engines_paused.clear()
        self.engines_frozen.clear()
        if self.upstream_pool is not None:
            self.upstream_pool.thaw()
        self._admission_changed()

    def record_weight_version(self, engines: list[str], version: str, *, answered: bool) -> None:
        """The engines now serve weights ``version`` (shown in /status, counted on change).

        ``answered``: each of ``engines`` answered 2xx to the weight-update call itself
        (``/admin/engines/call``), which releases an engine held since a restart or a join. Without that
        proof (``/admin/resume``), a held engine is left as it is: it serves its start-up weights, and
        whether the update reached it is not known.
        """
        released = False
        for engine in engines:
            st = self.registry.get(engine)
            if st is not None and st.held is not None:
                if not answered:
                    continue
                released = self.registry.release_hold(engine) or released
            if self.weight_versions.get(engine) != version:
                self.weight_versions[engine] = version
                self.metrics.weight_version_changes.labels(engine).inc()
        if released:
            self.dispatcher.kick()
        self.touch()

    def prefix_caches_reset(self) -> None:
        """The engines' prefix caches were reset: the policy forgets what it thought they held."""
        self.runner.reset_prefix_caches(self.clock())
        self.touch()

    def begin_drain(self) -> None:
        """Shutdown: refuse new work, fail held requests; in-flight ones may finish."""
        self.dispatcher.begin_drain()
        self.touch()

    def _admission_changed(self) -> None:
        self.dispatcher.kick()
        self.touch()

    # ---- engine registry callbacks ------------------------------------------

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

    def _engine_restarted(self, engine_id: str) -> None:
        """The engine's process started again: it serves the weights it loaded at start. Where a
        trainer had recorded a version for it, that version is gone and the engine is held until a
        weight update reaches it; rollouts must not mix policies silently."""
        self.metrics.engine_restarts.labels(engine_id).inc()
        self.runner.engine_restarted(engine_id, self.clock())
        lost = self.weight_versions.get(engine_id)
        if lost is not None:
            self.weight_versions[engine_id] = None
            self.metrics.weight_version_changes.labels(engine_id).inc()
            self.registry.hold(engine_id, restart_hold_reason(lost))
        self.dispatcher.kick()
        self.touch()

    def _engine_joined(self, engine_id: str) -> None:
        """A new engine in the pool (a replaced pod at a new address, a scale-up) serves the
        weights it loaded at start: where a trainer has versioned the others', it is held as a
        restarted one is, until a weight update reaches it."""
        versions = sorted({v for e, v in self.weight_versions.items()
                           if v is not None and e != engine_id and self.registry.get(e) is not None})
        if versions:
            self.registry.hold(engine_id, joined_hold_reason(versions))

    def _engine_up(self, engine_id: str) -> None:
        handle = self._pending_release.pop(engine_id, None)
        if handle is not None:
            handle.cancel()
        self.dispatcher.kick()
        self.touch()

    # ---- router shards ---------------------------------------------------------

    def _owned(self, engines: list[str]) -> list[str]:
        assert self.peers is not None and self.shard_index is not None
        return owned_engines(engines, self.peers.shards, self.peers.live(), self.shard_index)

    def peer_checked(self, peer: int, ok: bool, error: str | None = None) -> None:
        """One ``/health`` check of a peer shard; a change of the live set re-homes engines at once."""
        shards = self.config.shards
        if self.peers is None or shards is None:
            return
        if self.peers.record(peer, ok, down_after=shards.peer_down_after_failures,
                             up_after=shards.peer_up_after_successes, error=error):
            added, removed = self.registry.refilter()
            log.warning("shard %d %s: engines taken over %s, handed back %s", peer,
                        "is back" if ok else f"is down ({error})", added or "none", removed or "none")
            self.dispatcher.settle_hand_backs()  # engines with none of this shard's sessions go at once
            self.dispatcher.kick()
            self.touch()

    def shard_status(self) -> ShardStatus | None:
        if self.peers is None or self.shard_index is None:
            return None
        return ShardStatus(
            index=self.shard_index, count=self.peers.shards, live=sorted(self.peers.live()),
            owned_engines=self.registry.owned_ids(), handing_back=sorted(self.registry.handing_back),
            known_engines=len(self.registry.known_ids()),
        )

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

    def engine_pool(self) -> UpstreamPool:
        if self.upstream_pool is None:
            raise ShuttingDown("router is not running")
        return self.upstream_pool

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
            weight_versions=self.weight_versions,
            pause_mode=self.pause_mode,
            frozen_engines=self.engines_frozen,
            shard=self.shard_status(),
        )


def shard_problem(config: RouterConfig, index: int | None) -> str | None:
    """Why ``index`` cannot be this router's shard under ``config``, or None."""
    if config.shards is None:
        return None
    if index is None:
        return "shards is set but this router has no shard index (misat router --shard-index)"
    if not 0 <= index < len(config.shards.peers):
        return f"shard index {index} is not one of the {len(config.shards.peers)} shards.peers"
    return None


STATE = web.AppKey("misat_state", RouterState)
