"""Runs a ``SimEngine`` in scaled real time for the HTTP server.

Modelled time is wall time times ``time_scale`` (``now``). The loop advances
the engine to its next event instead of sleeping once per step:

- **Never ahead of a possible arrival.** The engine only runs steps that
  start before ``now`` (``SimEngine.advance(t, now)``): a request submitted
  at ``now`` could not have joined them. The last of those steps may end
  after ``now``: it is the step in flight, as on a GPU.
- **Batches of steps, one wake each.** When a batch is computed, what it
  produced (finished requests; the new tokens of streaming requests) is
  delivered when its last step ends, never before; then the loop sleeps
  ``delivery_slice_s`` modelled seconds and computes every step that started
  meanwhile. A token reaches its client at most a slice plus a step after the
  modelled moment it was produced; TTFT and ITL measured by clients are that
  coarse (the in-process cluster's ``reaction_slice_s`` is the same 50 ms).
  A batch with nothing to deliver needs no wake of its own.
- **Arrivals at their modelled time.** ``submit`` first brings the engine to
  ``now`` (runs the steps that start before it), then adds the request with
  arrival time ``now`` and wakes the loop: the request joins the first step
  that starts at or after its arrival, as in vLLM (the step in flight, if
  any, is the only computed step that ends after it, and a vLLM request
  arriving mid-step waits for that step too). ``abort`` does the same.
- **Bounded lag.** If the loop falls more than ``max_lag_s`` modelled seconds
  behind ``now`` (Python could not keep pace), the modelled time beyond is
  skipped: the engine idles in the model. Skipped time is what keep-up counts.
- No polling: with no work the loop waits for a submit; otherwise it sleeps
  until its next due time or a submit, whichever is first.

**Keep-up** (``KeepUpMeter``): modelled time the engine advanced while busy
(had unfinished requests) / (wall time busy x ``time_scale``), over the run
and over the last ``KEEP_UP_WINDOW_S`` wall seconds. 1 means the engine ran
at its modelled speed; below 1 it behaved like a slower GPU than modelled.
The loop logs a warning while the recent figure is under ``KEEP_UP_WARN``.

Each request gets a ``RequestStream``: an ``asyncio.Queue`` that receives
``TokenDelta`` items (streaming requests only) and then the
``FinishedRequest``. Handlers read it, and call ``abort`` when the client
goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from misat_sim.engine import FinishedRequest, SimEngine
from misat_sim.metrics import EngineMetrics

log = logging.getLogger(__name__)

DELIVERY_SLICE_S: float = 0.05
"""Modelled seconds between batches of steps (and so the delivery granularity of tokens)."""
MAX_LAG_WALL_S: float = 0.02
"""Wall seconds the loop may fall behind before modelled time is skipped (with a floor of
``MAX_LAG_SLICES`` slices): absorbs a late timer or a burst of HTTP work at any time scale."""
MAX_LAG_SLICES: float = 4.0
KEEP_UP_WINDOW_S: float = 30.0
"""Wall seconds of the "recent" keep-up window."""
KEEP_UP_SAMPLE_S: float = 1.0
"""Wall seconds between keep-up samples (the recent window's resolution)."""
KEEP_UP_WARN: float = 0.95
"""Keep-up under this while busy is warned about (engine log, and every live run's report)."""
KEEP_UP_MIN_BUSY_S: float = 5.0
"""Wall seconds of busy time the recent window needs before its figure is warned about."""
KEEP_UP_WARN_EVERY_S: float = 30.0
"""Wall seconds between repeated warnings while keep-up stays low."""


@dataclass(slots=True)
class TokenDelta:
    """Token ids a request emitted since its last delta."""

    token_ids: list[int]


class RequestStream:
    """Events of one request: ``TokenDelta`` items (streaming only), then a ``FinishedRequest``."""

    def __init__(self, request_id: str, num_prompt_tokens: int, *, streaming: bool = True) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.streaming = streaming
        self.queue: asyncio.Queue[TokenDelta | FinishedRequest] = asyncio.Queue()
        self.sent = 0
        self.finished: FinishedRequest | None = None


# --- keep-up ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KeepUp:
    """A keep-up reading. Times are modelled seconds (wall seconds x time scale)."""

    run: float | None
    """Over the run; None before any busy time."""
    recent: float | None
    """Over the recent window; None without busy time in it."""
    busy: bool
    """Whether the engine has unfinished requests now."""
    busy_s: float
    """Wall time the engine was busy, x time scale."""
    advanced_s: float
    """Modelled time the engine advanced (step time) while busy."""
    skipped_s: float
    """Modelled time skipped because the loop was more than ``max_lag_s`` late."""
    recent_busy_s: float
    """Busy time inside the recent window."""
    window_s: float
    """Length of the recent window (wall seconds x time scale)."""
    delivery_lag_s: float
    """Mean modelled seconds by which deliveries came after their due time (timer and CPU lateness)."""
    low: bool
    """The recent figure is under ``KEEP_UP_WARN`` with enough busy time in the window to tell."""

    def as_dict(self) -> dict[str, float | bool | None]:
        """JSON-ready (the ``/misat/keep_up`` body)."""
        return asdict(self)


class KeepUpMeter:
    """Keep-up of one engine from explicit times (modelled seconds: wall x time scale).

    The loop calls ``start`` when the engine becomes busy, ``advanced`` with
    the step time it ran, ``skipped`` with modelled time it had to skip,
    ``observe`` while busy and ``stop`` when the engine went idle. The
    denominator is busy time by the wall clock; the numerator is the
    engine's own step time. A reading can exceed 1 only by the step in
    flight (computed before it ends); readings are capped at 1.
    """

    def __init__(self, window_s: float, sample_s: float, min_busy_s: float = 0.0) -> None:
        self.window_s = window_s
        self.sample_s = sample_s
        self.min_busy_s = min_busy_s
        self.advanced_s = 0.0
        self.busy_s = 0.0
        self.skipped_s = 0.0
        self._mark: float | None = None
        self._samples: deque[tuple[float, float, float]] = deque([(0.0, 0.0, 0.0)])

    @property
    def busy(self) -> bool:
        """Between ``start`` and ``stop``."""
        return self._mark is not None

    def start(self, t: float) -> None:
        """The engine became busy at ``t``."""
        if self._mark is None:
            self._mark = t

    def advanced(self, dt: float) -> None:
        """The engine ran ``dt`` modelled seconds of steps."""
        self.advanced_s += dt

    def skipped(self, dt: float) -> None:
        """``dt`` modelled seconds were skipped (the loop was too late to run them)."""
        self.skipped_s += dt

    def observe(self, t: float) -> bool:
        """Count busy time up to ``t``; True when a new sample was taken."""
        m = self._mark
        if m is not None and t > m:
            self.busy_s += t - m
            self._mark = t
        return self._sample(t)

    def stop(self, idle_at: float, t: float) -> None:
        """The engine went idle at ``idle_at`` (seen at ``t`` >= ``idle_at``); busy time ends there."""
        m = self._mark
        if m is None:
            return
        end = min(t, max(idle_at, m))
        self.busy_s += end - m
        self._mark = None
        self._sample(t)

    def _sample(self, t: float) -> bool:
        samples = self._samples
        if t - samples[-1][0] < self.sample_s:
            return False
        samples.append((t, self.advanced_s, self.busy_s))
        horizon = t - self.window_s
        while len(samples) > 2 and samples[1][0] <= horizon:
            samples.popleft()
        return True

    def reading(self, t: float, *, behind_s: float = 0.0, delivery_lag_s: float = 0.0) -> KeepUp:
        """The figures at ``t`` (counts busy time up to ``t`` first).

        ``behind_s``: modelled time up to ``t`` the engine has not run yet but will, without
        skipping (the loop runs steps in batches, a slice apart): not lost, so counted as run.
        """
        self.observe(t)
        horizon = t - self.window_s
        base = self._samples[0]
        for s in self._samples:
            if s[0] > horizon:
                break
            base = s
        advanced = self.advanced_s + behind_s
        recent_busy = self.busy_s - base[2]
        recent = min(1.0, (advanced - base[1]) / recent_busy) if recent_busy > 0 else None
        return KeepUp(
            run=min(1.0, advanced / self.busy_s) if self.busy_s > 0 else None,
            recent=recent,
            busy=self.busy,
            busy_s=self.busy_s,
            advanced_s=self.advanced_s,
            skipped_s=self.skipped_s,
            recent_busy_s=recent_busy,
            window_s=self.window_s,
            delivery_lag_s=delivery_lag_s,
            low=recent is not None and recent < KEEP_UP_WARN and recent_busy >= self.min_busy_s,
        )


def keep_up_warning(figures: dict[str, float | None], *, threshold: float = KEEP_UP_WARN) -> str | None:
    """One line naming the engines whose keep-up is under ``threshold``, or None when none is."""
    low = {name: k for name, k in figures.items() if k is not None and k < threshold}
    if not low:
        return None
    listed = ", ".join(f"{name} {k:.3f}" for name, k in low.items())
    return (f"keep-up under {threshold:g} while busy ({listed}): the simulated engines ran slower than "
            "modelled (Python could not keep pace with the wall clock); throughput figures are CPU-bound, "
            "lower --time-scale or load")


# --- the loop ------------------------------------------------------------------------------


class EngineLoop:
    """Owns the engine, its metrics, and the task that advances it (see the module docstring)."""

    def __init__(
        self,
        engine: SimEngine,
        metrics: EngineMetrics,
        time_scale: float,
        *,
        delivery_slice_s: float = DELIVERY_SLICE_S,
        max_lag_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if delivery_slice_s <= 0:
            raise ValueError("delivery_slice_s must be positive")
        self.engine = engine
        self.metrics = metrics
        self.time_scale = time_scale
        self.delivery_slice_s = delivery_slice_s
        self.max_lag_s = (
            max_lag_s if max_lag_s is not None
            else max(MAX_LAG_SLICES * delivery_slice_s, MAX_LAG_WALL_S * time_scale)
        )
        self.clock = clock
        self.streams: dict[str, RequestStream] = {}
        self.meter = KeepUpMeter(KEEP_UP_WINDOW_S * time_scale, KEEP_UP_SAMPLE_S * time_scale,
                                 KEEP_UP_MIN_BUSY_S * time_scale)
        self._streaming: dict[str, RequestStream] = {}
        self._t0 = clock()
        self._t = 0.0
        """Modelled time from which the engine's next step starts (when it has work)."""
        self._due: float | None = None
        """End of the computed steps whose results are not delivered yet."""
        self._finished: list[FinishedRequest] = []
        self._next_compute = 0.0
        self._lag_total = 0.0
        self._deliveries = 0
        self._warned_at: float | None = None
        self._task: asyncio.Task[None] | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._frozen = False
        """vLLM's keep pause: no step starts until ``thaw``; the requests stay where they are."""
        metrics.set_keep_up_source(self._keep_up_series)

    def now(self) -> float:
        """Modelled time now: wall time since the loop was built, times the time scale."""
        return (self.clock() - self._t0) * self.time_scale

    async def start(self) -> None:
        """Start the task that advances the engine."""
        self._task = asyncio.create_task(self._run(), name="sim-engine-loop")

    async def stop(self) -> None:
        """Stop the task."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    @property
    def server_load(self) -> int:
        """Requests in flight (vLLM's ``/load``)."""
        return len(self.streams)

    def keep_up(self) -> KeepUp:
        """Keep-up figures now."""
        now = self.now()
        lag = self._lag_total / self._deliveries if self._deliveries else 0.0
        behind = 0.0
        engine = self.engine
        if engine.has_unfinished_requests():
            t = self._t if self._t > engine.clock else engine.clock
            behind = min(max(0.0, now - t), self.max_lag_s)
        return self.meter.reading(now, behind_s=behind, delivery_lag_s=lag)

    def _keep_up_series(self) -> dict[str, float | None]:
        k = self.keep_up()
        return {"run": k.run, "recent": k.recent}

    # --- requests ------------------------------------------------------------------

    def submit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        *,
        ignore_eos: bool,
        sample_seed: int | None,
        greedy: bool,
        stream: bool = True,
    ) -> RequestStream:
        """Add a request at modelled time ``now`` and return its stream.

        ``stream=False``: the stream gets only the ``FinishedRequest`` (no per-token deltas).
        """
        now = self.now()
        self._bring_to(now, compute=True)
        engine = self.engine
        if not engine.has_unfinished_requests():
            # Idle: the next step starts at the arrival, not at the end of the last one.
            self._t = max(self._t, engine.clock, now)
            self.meter.start(now)
        engine.add_request(
            request_id,
            prompt_token_ids,
            max_tokens,
            ignore_eos=ignore_eos,
            arrival_time=now,
            sample_seed=sample_seed,
            greedy=greedy,
        )
        rs = RequestStream(request_id, len(prompt_token_ids), streaming=stream)
        self.streams[request_id] = rs
        if stream:
            self._streaming[request_id] = rs
        self._wake()
        return rs

    def abort(self, request_id: str) -> None:
        """Drop a request (client gone): frees its blocks now."""
        if self.streams.pop(request_id, None) is None:
            return
        self._streaming.pop(request_id, None)
        now = self.now()
        self._bring_to(now, compute=True)
        self.engine.abort_request(request_id, now)
        self._idle_check(now)
        self._wake()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's ``/reset_prefix_cache`` at modelled time ``now``, between steps: the steps that
        started before now are run first (as for an abort)."""
        self._bring_to(self.now(), compute=True)
        ok = self.engine.reset_prefix_cache(reset_running_requests)
        self._wake()
        return ok

    # --- keep pause -----------------------------------------------------------------------

    @property
    def frozen(self) -> bool:
        return self._frozen

    def freeze(self) -> None:
        """vLLM's ``/pause?mode=keep``: the steps already started run to their end and are
        delivered; no step starts after that until ``thaw``, so running and waiting requests keep
        their KV and their place. Frozen time is idle time, not busy (keep-up is not charged)."""
        if self._frozen:
            return
        now = self.now()
        self._bring_to(now, compute=True)
        self._frozen = True
        self.meter.stop(max(self._t, self.engine.clock), now)
        self._wake()

    def thaw(self) -> None:
        """``/resume`` after a keep pause: the next step starts now."""
        if not self._frozen:
            return
        self._frozen = False
        now = self.now()
        engine = self.engine
        if engine.has_unfinished_requests():
            self._t = max(self._t, engine.clock, now)
            self._next_compute = min(self._next_compute, self._t)
            self.meter.start(now)
        self._wake()

    # --- advancing -----------------------------------------------------------------------

    def run_due(self) -> float | None:
        """Do what is due at ``now`` (deliver, run a batch of steps); the modelled time of the
        next wake, or None when there is nothing to do until a submit."""
        now = self.now()
        self._bring_to(now, compute=False)
        if self.meter.observe(now):
            self._check_keep_up(now)
        if self._due is not None:
            return self._due
        if self.engine.has_unfinished_requests() and not self._frozen:
            return max(self._next_compute, self._t)
        return None

    def _bring_to(self, now: float, *, compute: bool) -> None:
        """Deliver what is due by ``now``; run the steps that start before ``now`` when a batch
        is due (or ``compute``: a submit or abort needs the engine at ``now``)."""
        due = self._due
        if due is not None:
            if due > now:
                return  # the step in flight ends after now; nothing else starts before it
            self._deliver(now)
        engine = self.engine
        if not engine.has_unfinished_requests():
            self._idle_check(now)
            return
        if self._frozen or (not compute and now < self._next_compute):
            return
        t = self._t if self._t > engine.clock else engine.clock
        if t >= now:
            return  # the next step starts at or after now: an arrival at now may still join it
        behind = now - self.max_lag_s
        if t < behind:
            self.meter.skipped(behind - t)
            t = behind
        busy0 = engine.counters.busy_time
        result = engine.advance(t, now)
        self.meter.advanced(engine.counters.busy_time - busy0)
        end = engine.clock
        self._t = end
        if result.finished:
            self._finished.extend(result.finished)
        if self._finished or self._streaming:
            self._due = end
            if end <= now:
                self._deliver(now)
        else:
            self._next_compute = end + self.delivery_slice_s
        self._idle_check(now)

    def _idle_check(self, now: float) -> None:
        if self._due is None and not self.engine.has_unfinished_requests():
            self.meter.stop(self.engine.clock, now)

    def _deliver(self, now: float) -> None:
        due = self._due
        assert due is not None
        self._due = None
        self._next_compute = due + self.delivery_slice_s
        self._lag_total += now - due
        self._deliveries += 1
        engine = self.engine
        for rid, stream in self._streaming.items():
            req = engine.get_request(rid)
            if req is None:
                continue  # finished: its tail goes with the FinishedRequest below
            n = req.num_output_tokens
            if n > stream.sent:
                ids = req.materialize_outputs()
                stream.queue.put_nowait(TokenDelta(ids[stream.sent : n]))
                stream.sent = n
        finished, self._finished = self._finished, []
        streams = self.streams
        for f in finished:
            self.metrics.observe_finished(f)
            rs = streams.pop(f.request_id, None)
            if rs is None:
                continue  # aborted meanwhile
            if rs.streaming:
                del self._streaming[f.request_id]
                if len(f.output_token_ids) > rs.sent:
                    rs.queue.put_nowait(TokenDelta(f.output_token_ids[rs.sent :]))
                    rs.sent = len(f.output_token_ids)
            rs.finished = f
            rs.queue.put_nowait(f)

    def _check_keep_up(self, now: float) -> None:
        k = self.keep_up()
        if k.low and k.busy:
            every = KEEP_UP_WARN_EVERY_S * self.time_scale
            if self._warned_at is None or now - self._warned_at >= every:
                self._warned_at = now
                log.warning(
                    "engine %s keep-up %.3f over the last %.0f s busy (run %.3f, %.1f modelled s skipped): "
                    "the engine runs slower than modelled; lower the time scale or the load",
                    self.metrics.engine_index, k.recent, k.recent_busy_s / self.time_scale,
                    k.run if k.run is not None else float("nan"), k.skipped_s,
                )
        elif self._warned_at is not None and k.recent is not None and k.recent >= KEEP_UP_WARN:
            self._warned_at = None
            log.warning("engine %s keep-up back to %.3f", self.metrics.engine_index, k.recent)

    # --- the task --------------------------------------------------------------------------

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            wake_at = self.run_due()
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiter = waiter
            handle = None
            if wake_at is not None:
                delay = (wake_at - self.now()) / self.time_scale
                handle = loop.call_later(delay if delay > 0 else 0.0, _release, waiter)
            try:
                await waiter
            finally:
                self._waiter = None
                if handle is not None:
                    handle.cancel()


def _release(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
