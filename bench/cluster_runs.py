"""The cluster layer of the benchmark: run ``RunSpec``s on ``misat_sim.cluster``, cached, in parallel.

Why a wrapper instead of a change to ``sim/cluster.py``: what the benchmark
measures is not what a plain cluster run reports, and it is the benchmark's
claim, so it lives beside the benchmark (``BenchCluster``):

- the target *in force when each unit was released* (mix-shift changes it
  mid-run; ``ClusterResult`` compares with the initial target only), for the
  headline mixture-constrained rate and the TV distance;
- the steady-state window (``misat_bench.steady_state``): the warm-up measured
  from the run's own residencies, the convergence check, the stop;
- per window: completions per class (the time series), tokens, the ideal cached
  tokens, KV use and preemptions, so any window's figures can be summed;
- the CPU time of a run, to report what the suite costs.

Results are cached on disk by a digest of the whole ``ClusterConfig``
(``RunSpec.key``), so an interrupted suite resumes, and a run shared by two
baselines (tuned-once at a ceiling the sweep already ran) runs once.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from misat_bench.steady_state import (
    IdealPrefixCache,
    SteadyStateSettings,
    converged,
    median_residency,
    sampling_noise_tv,
    warmup_over,
)
from misat_bench.suite import BenchSettings, RunSpec, cluster_config
from misat_sim.cluster import Cluster, ClusterConfig, ClusterResult
from misat_sim.engine import FinishedRequest
from misat_sim.report import mixture_constrained_rate, tv_distance_points
from misat_sim.workload import RolloutClass, SessionPlan, Workload, WorkloadSpec

_FINGERPRINTED: tuple[str, ...] = ("router/policy", "sim")
"""Source folders whose text decides a cluster run's figures (policy code and simulator)."""

_FINGERPRINTED_FILES: tuple[str, ...] = ("bench/cluster_runs.py", "bench/steady_state.py")
"""And the benchmark's own measuring code (what a run counts, over which window)."""


_REPO_ROOT: Path = Path(__file__).resolve().parent.parent


def code_fingerprint(root: Path = _REPO_ROOT) -> str:
    """Digest of the policy, simulator and measuring sources as imported by this process.

    Why: other work edits the policy while suites run, and the cache is keyed by
    configuration only; each record carries the fingerprint of the code that
    produced it, so mixed-version results are visible rather than silent.
    """
    h = hashlib.sha256()
    for folder in _FINGERPRINTED:
        for path in sorted((root / folder).glob("*.py")):
            if not path.name.startswith("bench"):
                h.update(path.name.encode())
                h.update(path.read_bytes())
    for name in _FINGERPRINTED_FILES:
        path = root / name
        if path.exists():
            h.update(name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:12]


CODE_FINGERPRINT: str = code_fingerprint()
"""Taken once at import: forked workers share the parent's (the code they run)."""


class RunMetrics(BaseModel):
    """What one run measured, over its measured window (``window_start_s`` to the end)."""

    model_config = ConfigDict(extra="forbid")
    mixture_rate_per_min: float = Field(
        description="headline: mixture-constrained sample rate, min over classes of completed / target share, "
        "per minute (the target in force when each unit was released)")
    sample_rate_per_min: float = Field(description="completed units per minute")
    requests_per_min: float
    prefill_tokens_per_s: float = Field(description="prompt tokens computed (not served from the cache) per s")
    decode_tokens_per_s: float
    prefix_hit_rate: float = Field(description="cached / prompt tokens over the window, 0..1")
    ideal_prefix_hit_rate: float = Field(description="what an infinite, perfectly placed cache would serve, 0..1")
    tv_points: float = Field(description="TV distance, points, completed vs target at release")
    tv_noise_points: float = Field(description="expected TV of as many units drawn at random from the target")
    preemptions: int
    mean_kv_usage: float
    mean_iteration_s: float | None = None
    units_completed: dict[str, int]
    held_peak: int = 0
    measured_s: float
    window_start_s: float = Field(0.0, description="end of the warm-up (0: iterations, measured whole)")
    phase_s: float | None = Field(None, description="when the workload's last phase change took effect")
    residency_median_s: dict[str, float] = Field(default_factory=dict, description="per class, at the end")
    converged: bool | None = Field(None, description="convergence check over the last windows (None: iterations)")
    warmup_ok: bool | None = Field(None, description="False: the warm-up rule was never met before the cap")
    window_s: float = 60.0
    class_series: list[tuple[float, dict[str, int]]] = Field(
        default_factory=list, description="(window start s, completions per class), the whole run")


class RunRecord(BaseModel):
    """A run and its figures, as stored in the result JSON and the cache."""

    model_config = ConfigDict(extra="forbid")
    key: str
    spec: RunSpec
    metrics: RunMetrics
    cpu_s: float
    wall_s: float
    code: str = Field("", description="CODE_FINGERPRINT of the process that ran it")


def _last_phase(spec: WorkloadSpec) -> float | None:
    """Phase position of the workload's last change (mixture or end of drift), None if stationary."""
    marks = [c.at for c in spec.mixture_changes]
    marks += [max(p.at for p in pts) for pts in spec.output_drift.values() if pts]
    return max(marks) if marks else None


class _RecordingWorkload:
    """Wraps ``Workload``: records the target at each release and when the last phase took effect."""

    def __init__(self, inner: Workload, clock: Callable[[], float]) -> None:
        self.inner = inner
        self.spec = inner.spec
        self._clock = clock
        self.target_of: dict[str, dict[RolloutClass, float]] = {}
        self._last_phase = _last_phase(inner.spec)
        self.phase_s: float | None = 0.0 if self._last_phase is None else None
        if self._last_phase is not None and self.spec.phase_axis == "seconds":
            self.phase_s = self._last_phase

    @property
    def units_released(self) -> int:
        return self.inner.units_released

    def draw(self, at: float | None = None) -> list[SessionPlan]:
        if at is None and self.spec.phase_axis == "seconds":
            at = self._clock()
        position = float(self.inner.units_released) if at is None else at
        if self.phase_s is None and self._last_phase is not None and position >= self._last_phase:
            self.phase_s = self._clock()
        target = self.spec.mixture_at(position)
        plans = self.inner.draw(at)
        for p in plans:
            self.target_of[p.session_id] = target
        return plans


@dataclass
class _Window:
    """What happened in one window of ``window_s`` (absolute time ``index * window_s``)."""

    units: Counter[str] = field(default_factory=Counter)
    target: dict[str, float] = field(default_factory=dict)
    requests: int = 0
    prompt: int = 0
    cached: int = 0
    ideal: int = 0
    decode: int = 0
    kv_sum: float = 0.0
    kv_n: int = 0
    preemptions_before: float | None = None
    """Cumulative preemptions at the window's first scrape."""


class BenchCluster(Cluster):
    """``Cluster`` plus what the benchmark measures beside it.

    - the target in force when each unit was released (mix-shift changes it mid-run);
    - per window: completions per class, tokens, the ideal cached tokens, KV use, preemptions;
    - residency (release to completion) per class, for the warm-up rule;
    - with ``adaptive``: the steady-state window of ``misat_bench.steady_state`` (the run stops
      at the first converged window boundary after the warm-up and ``measure_s``, or at the cap).
    """

    def __init__(self, cfg: ClusterConfig, steady: SteadyStateSettings | None = None, adaptive: bool = False) -> None:
        super().__init__(cfg)
        self.recorder = _RecordingWorkload(self.workload, lambda: self.now)
        self.workload = self.recorder  # type: ignore[assignment]
        self.steady = steady or SteadyStateSettings()
        self.adaptive = adaptive and not cfg.iterations
        self.windows: dict[int, _Window] = {}
        self.residency: dict[str, list[float]] = {}
        self.classes = [c.value for c, share in cfg.workload.mixture_at(0.0).items() if share > 0]
        self.ideal = IdealPrefixCache(self.cfg.engine.resolve().block_size)
        self._next_check = 1
        self.warmup_index: int | None = None
        self.end_index: int | None = None
        self.warmup_ok: bool | None = None

    def _window(self, t: float) -> _Window:
        return self.windows.setdefault(int(t // self.steady.window_s), _Window())

    def _on_finished(self, engine_id: str, fin: FinishedRequest) -> None:
        entry = self._requests.get(fin.request_id)
        if entry is not None:
            unit = entry[1]
            ideal = self.ideal.cached(unit.plan, unit.turn, fin.num_prompt_tokens)
            w = self._window(self.now)
            w.requests += 1
            w.prompt += fin.num_prompt_tokens
            w.cached += fin.num_cached_tokens
            w.decode += fin.num_output_tokens
            w.ideal += ideal
        super()._on_finished(engine_id, fin)

    def _unit_done(self, unit: object) -> None:
        plan = unit.plan  # type: ignore[attr-defined]
        target = self.recorder.target_of.pop(plan.session_id, self.cfg.workload.mixture_at(0.0))
        klass = plan.klass.value
        self.residency.setdefault(klass, []).append(self.now - unit.released_at)  # type: ignore[attr-defined]
        w = self._window(self.now)
        w.units[klass] += 1
        for c, share in target.items():
            w.target[c.value] = w.target.get(c.value, 0.0) + share
        super()._unit_done(unit)  # type: ignore[arg-type]

    def _scrape(self) -> None:
        super()._scrape()
        w = self._window(self.now)
        snaps = list(self.snapshots.values())
        if snaps:
            w.kv_sum += sum(s.kv_usage for s in snaps) / len(snaps)
            w.kv_n += 1
        if w.preemptions_before is None:
            w.preemptions_before = sum(s.preemptions_total for s in snaps)

    def medians(self) -> dict[str, float | None]:
        """Median residency per class so far (completed, and in-flight ages as lower bounds)."""
        ages: dict[str, list[float]] = {}
        for u in self._units.values():
            ages.setdefault(u.plan.klass.value, []).append(self.now - u.released_at)
        return {c: median_residency(self.residency.get(c, []), ages.get(c, []), self.steady.min_class_samples)
                for c in self.classes}

    def class_windows(self, first: int, end: int) -> list[dict[str, int]]:
        """Completions per class of windows ``first .. end - 1``."""
        return [dict(self.windows[i].units) if i in self.windows else {} for i in range(first, end)]

    def _done(self) -> bool:
        if super()._done():
            return True
        ss = self.steady
        if not self.adaptive or self.now < self._next_check * ss.window_s:
            return False
        k = self._next_check  # windows 0 .. k-1 are complete
        self._next_check += 1
        boundary = k * ss.window_s
        if self.warmup_index is None:
            if warmup_over(boundary, self.recorder.phase_s, self.medians(), ss):
                self.warmup_index, self.warmup_ok = k, True
            elif boundary + ss.measure_s >= ss.max_duration_s:
                self.warmup_index, self.warmup_ok = k, False  # no room left: measure what remains, flagged
            return False
        if (k - self.warmup_index) * ss.window_s >= ss.measure_s and converged(
                self.class_windows(self.warmup_index, k), self.classes, ss):
            self.end_index = k
            return True
        return False

    def measure(self, r: ClusterResult) -> RunMetrics:
        """The run's figures over its measured window."""
        ws = self.steady.window_s
        if self.cfg.iterations:
            first = 0
        elif self.adaptive:
            first = self.warmup_index if self.warmup_index is not None else int(self.now // ws)
        else:
            first = math.ceil(self.cfg.warmup_s / ws)
        if self.end_index is not None:
            end, measured = self.end_index, (self.end_index - first) * ws
        else:
            end, measured = int(self.now // ws) + 1, self.now - first * ws
        measured = max(measured, 1e-9)
        win = [self.windows[i] for i in range(first, end) if i in self.windows]
        units: Counter[str] = Counter()
        target: dict[str, float] = {}
        for w in win:
            units.update(w.units)
            for c, v in w.target.items():
                target[c] = target.get(c, 0.0) + v
        total = sum(units.values())
        prompt, cached = sum(w.prompt for w in win), sum(w.cached for w in win)
        kv_n = sum(w.kv_n for w in win)
        start_preempt = next((self.windows[i].preemptions_before for i in range(first, end)
                              if i in self.windows and self.windows[i].preemptions_before is not None), None)
        minutes = measured / 60.0
        done = int(self.now // ws)
        conv: bool | None = None
        if not self.cfg.iterations:
            conv = self.end_index is not None or converged(self.class_windows(first, done), self.classes, self.steady)
        medians = {c: m for c, m in self.medians().items() if m is not None}
        complete = int(self.now // ws)  # the series ends at the last whole window (a run stops just past one)
        return RunMetrics(
            mixture_rate_per_min=(mixture_constrained_rate(target, units, minutes) or 0.0) if total else 0.0,
            sample_rate_per_min=total / minutes,
            requests_per_min=sum(w.requests for w in win) / minutes,
            prefill_tokens_per_s=(prompt - cached) / measured,
            decode_tokens_per_s=sum(w.decode for w in win) / measured,
            prefix_hit_rate=cached / prompt if prompt else 0.0,
            ideal_prefix_hit_rate=sum(w.ideal for w in win) / prompt if prompt else 0.0,
            tv_points=tv_distance_points(target, units) if total else 0.0,
            tv_noise_points=sampling_noise_tv(target, total),
            preemptions=round(r.preemptions - (start_preempt or 0.0)),
            mean_kv_usage=sum(w.kv_sum for w in win) / kv_n if kv_n else 0.0,
            mean_iteration_s=r.mean_iteration_s,
            units_completed={c.value: units.get(c.value, 0) for c in RolloutClass},
            held_peak=r.held_peak, measured_s=measured, window_start_s=first * ws,
            phase_s=self.recorder.phase_s, residency_median_s=medians, converged=conv,
            warmup_ok=self.warmup_ok if self.adaptive else None, window_s=ws,
            class_series=[(i * ws, dict(self.windows[i].units) if i in self.windows else {})
                          for i in range(complete)],
        )


def run_spec(run: RunSpec, s: BenchSettings) -> RunRecord:
    """Run one spec on fresh engines and return its record."""
    cfg = cluster_config(run, s)
    cpu0, wall0 = time.process_time(), time.monotonic()
    cluster = BenchCluster(cfg, s.steady_state, adaptive=run.steady_state)
    r = cluster.run()
    metrics = cluster.measure(r)
    return RunRecord(key=run.key(s), spec=run, metrics=metrics, cpu_s=time.process_time() - cpu0,
                     wall_s=time.monotonic() - wall0, code=CODE_FINGERPRINT)


def _run_worker(payload: tuple[str, str]) -> str:
    """Process-pool entry: JSON in, JSON out (pydantic models cross the process boundary as text)."""
    run = RunSpec.model_validate_json(payload[0])
    s = BenchSettings.model_validate_json(payload[1])
    return run_spec(run, s).model_dump_json()


class RunCache:
    """One JSON file per run key under ``root``; absent root: no caching."""

    def __init__(self, root: Path | None) -> None:
        self.root = root
        if root is not None:
            root.mkdir(parents=True, exist_ok=True)

    def get(self, key: str) -> RunRecord | None:
        if self.root is None:
            return None
        path = self.root / f"{key}.json"
        if not path.exists():
            return None
        try:
            return RunRecord.model_validate_json(path.read_text())
        except ValueError:
            return None  # a torn write from an interrupted run: run it again

    def put(self, rec: RunRecord) -> None:
        if self.root is None:
            return
        tmp = self.root / f"{rec.key}.json.tmp"
        tmp.write_text(rec.model_dump_json())
        os.replace(tmp, self.root / f"{rec.key}.json")


def run_all(
    runs: Iterable[RunSpec],
    s: BenchSettings,
    *,
    jobs: int = 1,
    cache: RunCache | None = None,
    on_done: Callable[[RunRecord, bool], None] | None = None,
    cached_only: bool = False,
) -> list[RunRecord]:
    """Run every spec (deduplicated by key), ``jobs`` at a time; returns records in input order.

    A record relabelled for a second spec with the same key (e.g. tuned-once at
    a swept ceiling) keeps the figures and takes the new spec. ``cached_only``
    runs nothing: specs without a cached record are left out of the answer
    (a report from a suite cut short).
    """
    cache = cache or RunCache(None)
    specs = list(runs)
    by_key: dict[str, RunRecord] = {}
    todo: dict[str, RunSpec] = {}
    for run in specs:
        key = run.key(s)
        if key in by_key or key in todo:
            continue
        hit = cache.get(key)
        if hit is not None:
            by_key[key] = hit
            if on_done:
                on_done(hit, True)
        else:
            todo[key] = run
    if cached_only:
        todo = {}
    if todo:
        if jobs <= 1:
            for key, run in todo.items():
                rec = run_spec(run, s)
                cache.put(rec)
                by_key[key] = rec
                if on_done:
                    on_done(rec, False)
        else:
            s_json = s.model_dump_json()
            with ProcessPoolExecutor(max_workers=jobs) as pool:
                futures: dict[Future[str], str] = {
                    pool.submit(_run_worker, (run.model_dump_json(), s_json)): key for key, run in todo.items()
                }
                pending = set(futures)
                while pending:
                    done, pending = wait(pending, return_when=FIRST_COMPLETED)
                    for fut in done:
                        rec = RunRecord.model_validate_json(fut.result())
                        cache.put(rec)
                        by_key[futures[fut]] = rec
                        if on_done:
                            on_done(rec, False)
    return [by_key[k].model_copy(update={"spec": run}) for run in specs if (k := run.key(s)) in by_key]


def dump_records(records: list[RunRecord], path: Path) -> None:
    """Write records as a JSON list (partial results while the suite runs)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([r.model_dump(mode="json") for r in records], indent=1))
