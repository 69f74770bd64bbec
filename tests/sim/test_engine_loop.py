"""The HTTP server's engine loop: batches of steps, delivery times, arrivals, keep-up.

Driven on an injected clock through ``EngineLoop.run_due`` (the work its task
does at each wake), so every check is deterministic: no sleeps, no wall time.
The reference is the engine stepped directly, one ``SimEngine.step`` at a
time, with each request added at the first step that starts at or after its
arrival (vLLM's rule).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

import pytest

from misat_sim.engine import FinishedRequest, SimEngine
from misat_sim.engine_loop import (
    KEEP_UP_MIN_BUSY_S,
    KEEP_UP_WARN,
    EngineLoop,
    KeepUpMeter,
    TokenDelta,
    keep_up_warning,
)
from misat_sim.metrics import EngineMetrics

from .conftest import tiny_engine


class FakeClock:
    """Wall clock in seconds, moved by the test."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@dataclass
class Arrival:
    at: float
    rid: str
    prompt: list[int]
    max_tokens: int
    ignore_eos: bool
    stream: bool


def workload(seed: int, n: int = 40, spread_s: float = 3.0) -> list[Arrival]:
    """Requests with shared prefixes (hits), some long (preemptions on a small KV), at random times."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 500) for _ in range(rng.randrange(4, 40))] for _ in range(4)]
    out = []
    for i in range(n):
        prompt = [*rng.choice(prefixes), *(rng.randrange(3, 500) for _ in range(rng.randrange(1, 30)))]
        out.append(Arrival(at=rng.uniform(0, spread_s), rid=f"r{i}", prompt=prompt,
                           max_tokens=rng.randrange(1, 120), ignore_eos=rng.random() < 0.7,
                           stream=rng.random() < 0.5))
    # Two at the very same instant, and one while the engine is certainly busy.
    out.append(Arrival(at=out[0].at, rid="same-time", prompt=[7, 8, 9], max_tokens=5, ignore_eos=True, stream=True))
    return sorted(out, key=lambda a: a.at)


def small_engine() -> SimEngine:
    return tiny_engine(num_gpu_blocks=60, max_model_len=200, max_num_seqs=8, max_num_batched_tokens=32)


# --- the reference: the engine stepped directly -------------------------------------------


@dataclass
class Reference:
    finished: list[FinishedRequest] = field(default_factory=list)
    produced: dict[str, list[float]] = field(default_factory=dict)
    """Per request, the modelled time each output token was produced (its step's end)."""
    max_step_s: float = 0.0


def step_directly(arrivals: list[Arrival], at: dict[str, float] | None = None) -> Reference:
    """``at``: the arrival times the loop gave (its clock's floats), else each ``Arrival.at``."""
    engine = small_engine()
    ref = Reference()
    todo = [a if at is None else Arrival(at[a.rid], a.rid, a.prompt, a.max_tokens, a.ignore_eos, a.stream)
            for a in arrivals]
    t = 0.0
    while todo or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests():
            t = max(t, todo[0].at)
        while todo and todo[0].at <= t:
            a = todo.pop(0)
            engine.add_request(a.rid, a.prompt, a.max_tokens, ignore_eos=a.ignore_eos, arrival_time=a.at)
        r = engine.step(t)
        for rid, k in r.new_tokens.items():
            ref.produced.setdefault(rid, []).extend([r.end] * k)
        ref.finished.extend(r.finished)
        ref.max_step_s = max(ref.max_step_s, r.duration)
        t = r.end
    return ref


# --- the loop on a fake clock ----------------------------------------------------------------


@dataclass
class Seen:
    finished: list[FinishedRequest] = field(default_factory=list)
    """In the order the loop delivered them."""
    arrived: dict[str, float] = field(default_factory=dict)
    delivered: dict[str, list[float]] = field(default_factory=dict)
    """Per streaming request, the modelled time each output token reached the stream."""
    tokens: dict[str, list[int]] = field(default_factory=dict)


class Driver:
    """Runs an ``EngineLoop`` as its task would: ``run_due`` at each wake time, optionally late."""

    def __init__(self, loop: EngineLoop, clock: FakeClock, *, late_s: float = 0.0, seed: int = 0) -> None:
        self.loop, self.clock = loop, clock
        self.late_s = late_s
        self.rng = random.Random(seed)
        self.seen = Seen()
        self.streams: dict[str, object] = {}
        observe = loop.metrics.observe_finished

        def observed(f: FinishedRequest) -> None:  # called in delivery order, across streams
            self.seen.finished.append(f)
            observe(f)

        loop.metrics.observe_finished = observed  # type: ignore[method-assign]

    def set_modelled(self, t: float) -> None:
        self.clock.t = max(self.clock.t, self.loop._t0 + t / self.loop.time_scale)

    def drain(self) -> None:
        now = self.loop.now()
        for rid, stream in list(self.streams.items()):
            q = stream.queue  # type: ignore[attr-defined]
            while not q.empty():
                item = q.get_nowait()
                if isinstance(item, TokenDelta):
                    self.seen.tokens.setdefault(rid, []).extend(item.token_ids)
                    self.seen.delivered.setdefault(rid, []).extend([now] * len(item.token_ids))
                else:
                    assert isinstance(item, FinishedRequest) and q.empty()
                    del self.streams[rid]

    def run_until(self, t_end: float) -> None:
        """Wake at every due time up to ``t_end`` (modelled), each ``late_s``-ish late."""
        while True:
            wake = self.loop.run_due()
            self.drain()
            if wake is None or wake > t_end:
                break
            now = self.loop.now()
            late = self.rng.uniform(0, self.late_s) if self.late_s else 0.0
            self.set_modelled(max(wake + late, now + 1e-9))
        self.set_modelled(t_end)
        self.loop.run_due()
        self.drain()

    def run(self, arrivals: list[Arrival]) -> Seen:
        for a in arrivals:
            self.run_until(a.at)
            self.seen.arrived[a.rid] = self.loop.now()
            self.streams[a.rid] = self.loop.submit(a.rid, a.prompt, a.max_tokens, ignore_eos=a.ignore_eos,
                                                   sample_seed=None, greedy=False, stream=a.stream)
            self.drain()
        t = arrivals[-1].at
        while self.streams or self.loop.engine.has_unfinished_requests():
            t += 1.0
            self.run_until(t)
        return self.seen


def make_loop(clock: FakeClock, time_scale: float = 1.0, **kw: object) -> EngineLoop:
    engine = small_engine()
    return EngineLoop(engine, EngineMetrics(engine, "tiny"), time_scale, clock=clock, **kw)  # type: ignore[arg-type]


def _key(f: FinishedRequest) -> tuple:
    """What a client and the metrics see; times to 1e-9 s (runs of decode steps are summed in closed
    form, which rounds differently from adding step by step)."""
    times = (f.arrival_time, f.first_scheduled_time, f.first_token_time, f.finish_time)
    return (f.request_id, f.finish_reason, f.output_token_ids, *(None if t is None else round(t, 9) for t in times),
            f.num_cached_tokens, f.num_preemptions)


@pytest.mark.parametrize(("seed", "late_s", "time_scale"), [(0, 0.0, 1.0), (1, 0.03, 1.0), (2, 0.01, 10.0)],
                         ids=["on-time", "late-timers", "scale-10"])
def test_loop_delivers_what_stepping_the_engine_directly_produces(seed: int, late_s: float,
                                                                  time_scale: float) -> None:
    arrivals = workload(seed)
    clock = FakeClock()
    loop = make_loop(clock, time_scale)
    assert loop.max_lag_s > late_s  # late timers, but never so late that time is skipped
    seen = Driver(loop, clock, late_s=late_s, seed=seed).run(arrivals)
    ref = step_directly(arrivals, seen.arrived)

    assert sum(f.num_preemptions for f in ref.finished) > 0 and any(f.num_cached_tokens for f in ref.finished)
    # Same requests, same tokens, same modelled timestamps, same finish order.
    assert [_key(f) for f in seen.finished] == [_key(f) for f in ref.finished]
    assert loop.meter.skipped_s == 0.0
    # A batch is computed a slice (plus a late timer) after the last delivery, delivered when its
    # last step ends (plus a late timer).
    slack = loop.delivery_slice_s + ref.max_step_s + 2 * late_s + 1e-9
    by_id = {f.request_id: f for f in ref.finished}
    for a in arrivals:
        if not a.stream:
            assert a.rid not in seen.tokens  # non-streaming requests get their answer only
            continue
        assert seen.tokens.get(a.rid, []) == by_id[a.rid].output_token_ids
        # Every token reaches the client after it was produced, and at most a slice and a step later.
        for produced, delivered in zip(ref.produced[a.rid], seen.delivered[a.rid], strict=True):
            assert produced - 1e-9 <= delivered <= produced + slack
    assert not loop.streams and loop.server_load == 0


def test_a_submit_joins_the_next_step_not_the_next_slice() -> None:
    clock = FakeClock()
    loop = make_loop(clock, delivery_slice_s=1.0)  # a long slice: a submit must not wait for it
    d = Driver(loop, clock)
    d.streams["long"] = loop.submit("long", list(range(3, 40)), 150, ignore_eos=True, sample_seed=None,
                                    greedy=False, stream=False)
    d.run_until(0.3)
    mid = loop.now()
    d.streams["late"] = loop.submit("late", [5, 6, 7], 2, ignore_eos=True, sample_seed=None, greedy=False,
                                    stream=False)
    req = loop.engine.get_request("late")
    assert req is not None and req.arrival_time == mid
    while d.streams:
        d.run_until(loop.now() + 1.0)
    late = next(f for f in d.seen.finished if f.request_id == "late")
    # Scheduled at the first step boundary after its arrival: within one step, not one slice.
    assert late.first_scheduled_time is not None
    assert mid <= late.first_scheduled_time < mid + 0.1


def test_an_idle_loop_has_nothing_to_wake_for() -> None:
    clock = FakeClock()
    loop = make_loop(clock)
    assert loop.run_due() is None
    loop.submit("a", [5, 6], 3, ignore_eos=True, sample_seed=None, greedy=False)
    assert loop.run_due() is not None
    loop.abort("a")
    clock.t += 1.0
    assert loop.run_due() is None and not loop.engine.has_unfinished_requests()
    assert loop.engine.counters.request_success["abort"] == 1


def test_a_keep_pause_freezes_requests_in_place_and_they_go_on_after_the_thaw() -> None:
    clock = FakeClock()
    loop = make_loop(clock)
    d = Driver(loop, clock)
    d.streams["long"] = loop.submit("long", list(range(3, 40)), 150, ignore_eos=True, sample_seed=None,
                                    greedy=False, stream=True)
    d.run_until(0.3)
    loop.freeze()
    frozen_at = loop.now()
    # The step started before the freeze runs to its end and is delivered; then no wake is due,
    # however much time passes, and nothing moves.
    d.run_until(frozen_at + 0.1)
    req = loop.engine.get_request("long")
    assert req is not None and 0 < req.num_output_tokens < 150
    assert loop.engine.clock < frozen_at + 0.1
    produced, blocks = req.num_output_tokens, loop.engine.scheduler.pool.num_free_blocks
    assert loop.run_due() is None
    clock.t += 30.0
    assert loop.run_due() is None
    d.drain()
    assert req.num_output_tokens == produced and loop.engine.scheduler.pool.num_free_blocks == blocks
    assert len(d.seen.tokens["long"]) == produced
    k = loop.keep_up()
    assert not k.busy  # frozen time is not charged as time the engine fell behind
    loop.thaw()
    thawed_at = loop.now()
    while d.streams:
        d.run_until(loop.now() + 1.0)
    done = next(f for f in d.seen.finished if f.request_id == "long")
    # Every token, in order, the ones after the freeze produced after the thaw; KV kept (no
    # recompute: the request was never preempted).
    assert d.seen.tokens["long"] == done.output_token_ids and len(done.output_token_ids) == 150
    assert done.num_preemptions == 0 and done.finish_reason == "length"
    assert all(t >= thawed_at for t in d.seen.delivered["long"][produced:])
    assert done.finish_time is not None and done.finish_time > thawed_at > frozen_at + 29.0
    assert loop.meter.skipped_s == 0.0


def test_an_abort_while_frozen_frees_the_request() -> None:
    clock = FakeClock()
    loop = make_loop(clock)
    d = Driver(loop, clock)
    d.streams["a"] = loop.submit("a", [5, 6, 7], 100, ignore_eos=True, sample_seed=None, greedy=False)
    d.run_until(0.2)
    loop.freeze()
    free = loop.engine.scheduler.pool.num_free_blocks
    loop.abort("a")
    assert not loop.engine.has_unfinished_requests() and loop.engine.scheduler.pool.num_free_blocks > free
    loop.thaw()
    d.run_until(loop.now() + 1.0)  # the step in flight at the freeze is delivered; then nothing
    assert loop.run_due() is None and not loop.streams


# --- keep-up ---------------------------------------------------------------------------------


def test_meter_counts_step_time_over_busy_wall_time() -> None:
    m = KeepUpMeter(window_s=30.0, sample_s=1.0)
    assert m.reading(0.0).run is None
    m.start(10.0)
    m.advanced(8.0)
    k = m.reading(20.0)
    assert k.run == pytest.approx(0.8) and k.busy and k.busy_s == pytest.approx(10.0)
    m.advanced(2.0)
    m.stop(idle_at=21.0, t=25.0)  # idle at 21, seen at 25: the 4 s after are idle, not lag
    k = m.reading(25.0)
    assert k.busy_s == pytest.approx(11.0) and k.run == pytest.approx(10.0 / 11.0) and not k.busy
    m.reading(100.0)  # idle time counts for nothing
    assert m.busy_s == pytest.approx(11.0)


def test_meter_recent_window_follows_the_last_seconds() -> None:
    m = KeepUpMeter(window_s=30.0, sample_s=1.0)
    m.start(0.0)
    for t in range(1, 101):  # 100 s at full speed
        m.advanced(1.0)
        m.observe(float(t))
    for t in range(101, 141):  # then 40 s at half speed
        m.advanced(0.5)
        m.observe(float(t))
    k = m.reading(140.0)
    assert k.recent == pytest.approx(0.5)
    assert k.run == pytest.approx(120.0 / 140.0)
    assert k.recent_busy_s == pytest.approx(30.0)


def load(loop: EngineLoop, n: int) -> None:
    """``n`` non-streaming requests of about 170 tokens (8 run at once: 1.8 modelled s per 8)."""
    for i in range(n):
        loop.submit(f"r{i}", list(range(3, 20 + i % 8)), 190 - 20 - i % 8, ignore_eos=True, sample_seed=None,
                    greedy=False, stream=False)


def test_loop_keep_up_on_a_controlled_clock() -> None:
    # On time: every modelled second is run.
    clock = FakeClock()
    loop = make_loop(clock)
    d = Driver(loop, clock)
    load(loop, 8)
    d.run_until(1.0)
    k = loop.keep_up()
    assert k.busy and k.skipped_s == 0.0 and k.run == pytest.approx(1.0, abs=1e-6)

    # Late by a whole second at every wake, 0.2 s allowed: 0.8 s of each second is skipped.
    clock = FakeClock()
    loop = make_loop(clock, max_lag_s=0.2)
    load(loop, 8)
    for t in range(1, 6):
        clock.t = loop._t0 + t
        loop.run_due()
    k = loop.keep_up()
    assert k.busy and k.busy_s == pytest.approx(5.0)
    assert k.skipped_s == pytest.approx(0.8 * 4 + 0.8, abs=0.05)
    assert k.run == pytest.approx(k.advanced_s / k.busy_s)
    assert 0.15 < k.run < 0.3
    assert loop.engine.counters.busy_time == pytest.approx(k.advanced_s)


def test_low_keep_up_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    loop = make_loop(clock, max_lag_s=0.2)
    load(loop, 8)
    with caplog.at_level(logging.WARNING, logger="misat_sim.engine_loop"):
        for t in range(1, int(KEEP_UP_MIN_BUSY_S) + 3):
            clock.t = loop._t0 + t
            loop.run_due()
    warnings = [r for r in caplog.records if "keep-up" in r.getMessage()]
    assert len(warnings) == 1, caplog.text  # once, not at every sample
    assert loop.keep_up().low


def test_on_time_loop_is_not_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    loop = make_loop(clock)
    d = Driver(loop, clock)
    load(loop, 40)  # about 9 modelled s of work
    with caplog.at_level(logging.WARNING, logger="misat_sim.engine_loop"):
        d.run_until(KEEP_UP_MIN_BUSY_S + 2)
    k = loop.keep_up()
    assert not caplog.records
    assert k.busy and k.recent_busy_s > KEEP_UP_MIN_BUSY_S and not k.low


def test_keep_up_warning_names_the_engines_under_the_threshold() -> None:
    assert keep_up_warning({"engine-0": 1.0, "engine-1": KEEP_UP_WARN, "engine-2": None}) is None
    line = keep_up_warning({"engine-0": 0.99, "engine-1": 0.94})
    assert line is not None and "engine-1 0.940" in line and "engine-0" not in line
