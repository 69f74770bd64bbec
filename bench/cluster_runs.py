"""The cluster layer of the benchmark: run ``RunSpec``s on ``misat_sim.cluster``, cached, in parallel.

Why a wrapper instead of a change to ``sim/cluster.py``: two figures the
benchmark needs are not in ``ClusterResult`` as it stands, and both are small
additions best kept beside the benchmark until the cluster owner adopts them:

- the mixture distance must compare completed units with the target *in force
  when each was released* (mix-shift changes it mid-run); ``ClusterResult``
  compares with the initial target only. ``BenchCluster`` records the target at
  every release and computes the TV distance over the measured window.
- the CPU time of a run, to report what the suite costs.

Results are cached on disk by a digest of the whole ``ClusterConfig``
(``RunSpec.key``), so an interrupted suite resumes, and a run shared by two
baselines (tuned-once at a ceiling the sweep already ran) runs once.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from misat_bench.suite import BenchSettings, RunSpec, cluster_config
from misat_sim.cluster import Cluster, ClusterConfig
from misat_sim.report import tv_distance_points
from misat_sim.workload import RolloutClass, SessionPlan, Workload

_FINGERPRINTED: tuple[str, ...] = ("router/policy", "sim")
"""Source folders whose text decides a cluster run's figures (policy code and simulator)."""


_REPO_ROOT: Path = Path(__file__).resolve().parent.parent


def code_fingerprint(root: Path = _REPO_ROOT) -> str:
    """Digest of the policy and simulator sources as imported by this process.

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
    return h.hexdigest()[:12]


CODE_FINGERPRINT: str = code_fingerprint()
"""Taken once at import: forked workers share the parent's (the code they run)."""


class RunMetrics(BaseModel):
    """What one run measured (rates over the measured window)."""

    model_config = ConfigDict(extra="forbid")
    sample_rate_per_min: float = Field(description="completed units per minute (headline)")
    requests_per_min: float
    prefix_hit_rate: float = Field(description="cached / prompt tokens over the window, 0..1")
    tv_points: float = Field(description="TV distance, points, consumed vs target at release")
    preemptions: int
    mean_kv_usage: float
    mean_iteration_s: float | None = None
    units_completed: dict[str, int]
    held_peak: int = 0
    measured_s: float
    series: list[tuple[float, int]] = Field(default_factory=list, description="(t, units) per minute")


class RunRecord(BaseModel):
    """A run and its figures, as stored in the result JSON and the cache."""

    model_config = ConfigDict(extra="forbid")
    key: str
    spec: RunSpec
    metrics: RunMetrics
    cpu_s: float
    wall_s: float
    code: str = Field("", description="CODE_FINGERPRINT of the process that ran it")


class _RecordingWorkload:
    """Wraps ``Workload``: records the target at each release; honours the seconds axis."""

    def __init__(self, inner: Workload, clock: Callable[[], float]) -> None:
        self.inner = inner
        self.spec = inner.spec
        self._clock = clock
        self.target_of: dict[str, dict[RolloutClass, float]] = {}

    @property
    def units_released(self) -> int:
        return self.inner.units_released

    def draw(self, at: float | None = None) -> list[SessionPlan]:
        if at is None and self.spec.phase_axis == "seconds":
            at = self._clock()
        position = float(self.inner.units_released) if at is None else at
        target = self.spec.mixture_at(position)
        plans = self.inner.draw(at)
        for p in plans:
            self.target_of[p.session_id] = target
        return plans


class BenchCluster(Cluster):
    """``Cluster`` plus the per-release target mixture (TV against the target in force)."""

    def __init__(self, cfg: ClusterConfig) -> None:
        super().__init__(cfg)
        self.recorder = _RecordingWorkload(self.workload, lambda: self.now)
        self.workload = self.recorder  # type: ignore[assignment]
        self.done_targets: list[tuple[float, str, dict[RolloutClass, float]]] = []

    def _unit_done(self, unit: object) -> None:
        plan = unit.plan  # type: ignore[attr-defined]
        target = self.recorder.target_of.pop(plan.session_id, self.cfg.workload.mixture_at(0.0))
        self.done_targets.append((self.now, plan.klass.value, target))
        super()._unit_done(unit)  # type: ignore[arg-type]

    def tv_in_window(self) -> float:
        """TV (points) of completed units in the measured window vs their release targets."""
        start = 0.0 if self.cfg.iterations else self.cfg.warmup_s
        target: dict[str, float] = {}
        consumed: dict[str, float] = {}
        for t, klass, tgt in self.done_targets:
            if t < start:
                continue
            consumed[klass] = consumed.get(klass, 0.0) + 1.0
            for c, share in tgt.items():
                target[c.value] = target.get(c.value, 0.0) + share
        return tv_distance_points(target, consumed) if consumed else 0.0


def run_spec(run: RunSpec, s: BenchSettings) -> RunRecord:
    """Run one spec on fresh engines and return its record."""
    cfg = cluster_config(run, s)
    cpu0, wall0 = time.process_time(), time.monotonic()
    cluster = BenchCluster(cfg)
    r = cluster.run()
    metrics = RunMetrics(
        sample_rate_per_min=r.sample_rate_per_min, requests_per_min=r.requests_per_min,
        prefix_hit_rate=r.prefix_hit_rate, tv_points=cluster.tv_in_window(), preemptions=r.preemptions,
        mean_kv_usage=r.mean_kv_usage, mean_iteration_s=r.mean_iteration_s,
        units_completed=r.units_completed, held_peak=r.held_peak, measured_s=r.measured_s,
        series=[(float(t), int(n)) for t, n in r.series],
    )
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
