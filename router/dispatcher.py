"""Admission glue between the HTTP handlers and the ``PolicyRunner``.

``Dispatcher`` is the only caller of the runner's request hooks: ``admit``
submits a request and, on HOLD, awaits a future that an epoch's
``runner.release()`` resolves (no per-request polling), bounded by the hold
deadline; ``finish`` reports the completion and re-checks held work at once.
One event loop, no locks: every method runs between two awaits.

It is handed what it uses (runner, registry, metrics, clock, a view of the
current config and a ``touch`` that wakes observers), not the router state,
so the state owns it and nothing points back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from .config import RouterConfig
from .engines import EngineRegistry
from .errors import HoldDeadlineExceeded, NoHealthyEngine, ShuttingDown
from .metrics import Outcome, RouterMetrics
from .policy.runner import PolicyRunner
from .policy.types import Completion, Decision, RequestMeta
from .scrape import wait_event
from .status import SampleRateMeter

log = logging.getLogger(__name__)

Clock = Callable[[], float]


@dataclass(slots=True)
class InFlight:
    """A placed request the router is waiting on."""

    meta: RequestMeta
    engine_id: str
    placed_at: float
    abort: Callable[[], None] | None = None
    """Set by the proxy while it forwards: ends the request with an abort answer to its client."""


class Dispatcher:
    """Admission glue between HTTP handlers and the ``PolicyRunner`` (one event loop, no locks)."""

    def __init__(
        self,
        *,
        runner: PolicyRunner,
        registry: EngineRegistry,
        metrics: RouterMetrics,
        sample_meter: SampleRateMeter,
        config: Callable[[], RouterConfig],
        clock: Clock,
        touch: Callable[[], None],
    ) -> None:
        self._runner = runner
        self._registry = registry
        self._metrics = metrics
        self._sample_meter = sample_meter
        self._config = config
        self._clock = clock
        self._touch = touch
        self._waiters: dict[str, asyncio.Future[Decision]] = {}
        self.in_flight: dict[str, InFlight] = {}
        self._kick = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self.draining = False
        self._flush_due = False

    # ---- admission ------------------------------------------------------

    async def admit(self, meta: RequestMeta, deadline_s: float) -> tuple[str, float]:
        """Place ``meta`` now or after a hold; returns (engine id, seconds held).

        Raises ``HoldDeadlineExceeded`` when still held after ``deadline_s``
        and ``ShuttingDown`` while draining. A cancelled caller (client gone)
        leaves nothing behind: its ledger entry or its placement is released.
        """
        if self.draining:
            raise ShuttingDown("router is shutting down")
        now = self._clock()
        decision = self._runner.submit(meta, self._registry.snapshots(), now, self._draining())
        self._metrics.decision(meta.workload_class, decision)
        if decision.placed:
            assert decision.engine_id is not None
            self._track(meta, decision.engine_id, now)
            return decision.engine_id, 0.0
        self._metrics.held.labels(meta.workload_class, decision.reason.value).inc()
        fut: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
        self._waiters[meta.request_id] = fut
        self._touch()
        try:
            decision = await self._placed(fut, deadline_s)
        except NoHealthyEngine:
            self._give_up(meta, now, Outcome.NO_HEALTHY_ENGINE)
            raise
        except TimeoutError:
            if not _has_result(fut):
                self._give_up(meta, now, Outcome.HOLD_DEADLINE)
                raise HoldDeadlineExceeded(
                    f"request held for {deadline_s:g} s without capacity "
                    f"(class {meta.workload_class!r}); retry later",
                    retry_after_s=self._config().hold_retry_after_s,
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
        held_s = self._clock() - now
        self._metrics.hold_wait.labels(meta.workload_class, "placed").observe(held_s)
        assert decision.engine_id is not None
        return decision.engine_id, held_s

    async def _placed(self, fut: asyncio.Future[Decision], deadline_s: float) -> Decision:
        """The held request's placement, within ``deadline_s`` (TimeoutError otherwise).

        With no healthy engine nothing will free capacity, so the request waits for one only
        ``no_healthy_engine_wait_s`` and fails fast (``NoHealthyEngine``) if none came back.
        """
        if self._registry.placeable_count() > 0 or deadline_s <= self._config().no_healthy_engine_wait_s:
            async with asyncio.timeout(deadline_s):
                return await fut
        first = self._config().no_healthy_engine_wait_s
        try:
            async with asyncio.timeout(first):
                return await asyncio.shield(fut)  # shielded: the wait may go on below
        except TimeoutError:
            if _has_result(fut):
                return fut.result()
            if self._registry.placeable_count() == 0:
                raise NoHealthyEngine(self._no_engine_message(first),
                                      retry_after_s=self._config().hold_retry_after_s) from None
        async with asyncio.timeout(deadline_s - first):
            return await fut

    def _no_engine_message(self, waited_s: float) -> str:
        errors = [f"{eid}: {st.held if st.healthy and st.held else st.last_error or 'not yet probed'}"
                  for eid in self._registry.ids() if (st := self._registry.get(eid)) is not None]
        return (f"no healthy engine for {waited_s:g} s ({'; '.join(errors) or 'no engines configured'}); "
                "retry later")

    def _draining(self) -> frozenset[str]:
        """Engines that take no new session (runner.py): those the config marks draining, and
        those this shard hands back to a returning peer (``EngineRegistry.handing_back``)."""
        configured = self._config().engines.draining_ids()
        handing_back = self._registry.handing_back
        return configured | handing_back if handing_back else configured

    def settle_hand_backs(self) -> None:
        """Drop the handed-back engines whose drain is over (``EngineRegistry.settle_hand_backs``).

        Once per epoch (and when the live set of shards changes), not per finish: reading the
        sessions' last activity walks every live session."""
        if self._registry.handing_back:
            ended = self._registry.settle_hand_backs(self._runner.last_active_per_engine(self._clock()))
            for _, how in ended:
                self._metrics.hand_backs.labels(how).inc()
            if ended:
                self._touch()

    def _give_up(self, meta: RequestMeta, held_since: float, outcome: str) -> None:
        self._waiters.pop(meta.request_id, None)
        now = self._clock()
        self._runner.cancel(meta.request_id, now)
        self._metrics.hold_wait.labels(meta.workload_class, outcome).observe(now - held_since)
        self._metrics.finished(meta.workload_class, outcome)
        # The class's queue head may have moved: let the next one try.
        self.kick()
        self._touch()

    def _track(self, meta: RequestMeta, engine_id: str, now: float) -> None:
        self.in_flight[meta.request_id] = InFlight(meta, engine_id, now)
        self._idle.clear()
        self._touch()  # in flight changed: observable through wait_until, as a finish is
        if not self._flush_due:
            # After the callers in this loop step have sent their requests upstream: the policy's
            # put-off work (the prefix index's inserts) then overlaps the engines' (one call per
            # step however many requests it placed).
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self._flush_deferred)

    def _flush_deferred(self) -> None:
        self._flush_due = False
        self._runner.flush_deferred()

    def finish(self, meta: RequestMeta, engine_id: str, completion: Completion, outcome: str) -> None:
        """A placed request ended; accounting is released and held work re-checked."""
        if self.in_flight.pop(meta.request_id, None) is None:
            return  # already finished (defensive: never finish twice)
        if not self.in_flight:
            self._idle.set()
        now = self._clock()
        self._runner.finish(meta, engine_id, completion, now)
        self._metrics.finished(meta.workload_class, outcome)
        self._metrics.used(meta.workload_class, completion)
        self._observe_units(now)
        self.kick()
        self._touch()

    def on_abort(self, request_id: str, abort: Callable[[], None]) -> None:
        """How to abort a placed request (``abort_in_flight``); the proxy registers it."""
        entry = self.in_flight.get(request_id)
        if entry is not None:
            entry.abort = abort

    def abort_in_flight(self, engines: set[str] | None = None) -> list[RequestMeta]:
        """Abort the requests in flight (on ``engines`` only, when given); returns those aborted.
        Each answers its client and calls ``finish`` itself."""
        aborted = []
        for entry in list(self.in_flight.values()):
            if entry.abort is not None and (engines is None or entry.engine_id in engines):
                entry.abort()
                aborted.append(entry.meta)
        return aborted

    def end_session(self, session_id: str) -> bool:
        now = self._clock()
        ended = self._runner.end_session(session_id, now)
        self._observe_units(now)
        self.kick()
        return ended

    def _observe_units(self, now: float) -> None:
        self._sample_meter.observe(self._runner.mixture.total, now, self._config().sample_rate_window_s)

    # ---- releasing held work --------------------------------------------

    def kick(self) -> None:
        """Ask the epoch loop to re-check held work now (coalesced; nothing to do when nothing is held,
        and a finish kicks on every request)."""
        if self._waiters:
            self._kick.set()

    def release(self) -> int:
        now = self._clock()
        return self._resolve(self._runner.release(self._registry.snapshots(), now, self._draining()), now)

    def epoch(self) -> int:
        now = self._clock()
        released = self._runner.epoch(self._registry.snapshots(), now, self._draining())
        self.settle_hand_backs()  # after idle sessions ended; a drain's sessions may have gone quiet
        self._observe_units(now)
        return self._resolve(released, now)

    def _resolve(self, released: list[tuple[RequestMeta, Decision]], now: float) -> int:
        for req, decision in released:
            assert decision.engine_id is not None
            self._metrics.decision(req.workload_class, decision)
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
        next_epoch = self._clock() + self._config().policy.admission.epoch_s
        while True:
            await wait_event(self._kick, max(0.0, next_epoch - self._clock()))
            self._kick.clear()
            try:
                if self._clock() >= next_epoch:
                    self.epoch()
                    next_epoch = self._clock() + self._config().policy.admission.epoch_s
                else:
                    self.release()
            except Exception:  # a policy bug must not stop admission for good
                log.exception("epoch failed")

    # ---- shutdown -------------------------------------------------------

    def begin_drain(self) -> None:
        """Refuse new work from now on and answer every held request with ``ShuttingDown``."""
        self.draining = True
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
