"""The HTTP layer of the benchmark: the real ``vllm-router`` binary vs this project's router, over HTTP.

Why: the cluster layer re-implements the baseline; this layer runs the
baseline itself (PyPI ``vllm-router``, a Rust binary) and this project's
router service in front of the same simulated engines, driven by the same
trainer emulator and the same seeded workload, to check that the cluster
layer's figures hold for the real thing. Every run gets fresh engines.

How:

- Engines: ``misat_sim.server`` apps in this process, modelled time at
  ``time_scale`` modelled seconds per wall second. Python must keep up: each
  engine's loop measures its keep-up (modelled time advanced / wall time x
  time scale while busy, ``misat_sim.engine_loop``), taken here over the
  measured window. Under ``KEEP_UP_WARN`` a run is warned about; under
  ``KEEP_UP_COMPARABLE`` its figures are marked "not a comparison" in the
  table and the JSON (the engines behaved as slower GPUs than modelled, so
  the rate measures this machine's CPU as much as the router).
- Routers run as subprocesses (the binary, and ``misat router`` with a config
  file) on free ports; a bounded poll waits for their health endpoint; they
  are stopped by pid whatever the outcome.
- Time-based router settings are given in wall seconds scaled down by
  ``time_scale``, so both routers see what they would at real speed (the
  binary's eviction interval; this router's scrape interval and epoch).
- The trainer's tool gaps are divided by ``time_scale`` alike; rates are
  converted back to modelled minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import aiohttp
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field
from rich.console import Console

from misat_bench.report import SummaryRow
from misat_bench.suite import BenchSettings, WorkloadName, pick_oracle
from misat_cli.processes import ProcessStartError, free_port, start_process, stop_processes, wait_http_ok
from misat_router.policy.settings import CacheAwareSettings, PolicyName, PolicySettings
from misat_sim.cluster import mix_for
from misat_sim.config import SimEngineConfig
from misat_sim.engine import SimEngine
from misat_sim.engine_loop import KEEP_UP_WARN as ENGINE_KEEP_UP_WARN
from misat_sim.engine_loop import EngineLoop, keep_up_warning
from misat_sim.report import TrainerReport, tv_distance_points
from misat_sim.server import LISTEN_BACKLOG as SIM_LISTEN_BACKLOG
from misat_sim.server import STATE, create_app
from misat_sim.trainer import Trainer, TrainerConfig
from misat_sim.workload import WorkloadSpec

VLLM_ROUTER_BINARY: str = "vllm-router"
"""The PyPI ``vllm-router`` console script (a Rust binary), looked up next to this Python first."""

HEALTH_TIMEOUT_S: float = 30.0
"""A router must answer its health endpoint within this (``misat_cli.processes.wait_http_ok`` polls)."""

STOP_GRACE_S: float = 5.0
"""After SIGTERM a router gets this long before SIGKILL."""

KEEP_UP_WARN: float = ENGINE_KEEP_UP_WARN
"""A run with an engine under this keep-up is warned about (``misat_sim.engine_loop.KEEP_UP_WARN``)."""

KEEP_UP_COMPARABLE: float = 0.9
"""A run with an engine under this keep-up gives no comparison: its rows are marked so."""

UNLIMITED_QUEUE: int = 1_000_000
"""The binary's --queue-size for a request limit: a FIFO that never refuses, as the paper's swept
static concurrency (our ConcurrencyLimited). The queue timeout is REQUEST_TIMEOUT_S: measured
with vllm-router 0.1.17, --queue-timeout-secs 1000000 times every queued request out at once
(408 within a second of start), so a huge value cannot stand for "never"."""

BINARY_EVICTION_INTERVAL_S: float = CacheAwareSettings().eviction_interval_s
"""The binary's tree-eviction period at real speed; scaled by the time scale."""

CLUSTER_SCRAPE_S: float = 0.5
"""Modelled seconds between metric scrapes and admission epochs (the cluster layer's default)."""

REQUEST_TIMEOUT_S: float = 3600.0
"""Trainer and binary request timeout, wall seconds: nothing legitimate takes this long here."""


class HttpSettings(BaseModel):
    """The HTTP layer's knobs (``--http-*`` flags)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    engines: int = Field(2, ge=1, description="engine replicas (fewer than the cluster layer: CPU)")
    time_scale: float = Field(
        1.0, gt=0,
        description="modelled seconds per wall second; on the 2-core machine the engines' former per-step loop "
        "kept 82-84% of modelled speed at 1, far less at 2 and 10 (docs/benchmark.md); each run reports keep-up",
    )
    duration_s: float = Field(180.0, gt=0, description="modelled seconds per run, warm-up included")
    warmup_s: float = Field(45.0, ge=0, description="modelled seconds excluded from rates")
    tune_ceilings: tuple[int, ...] = Field((48, 96, 128, 160, 256), description="cluster sweep for the tuned ceiling")
    tuned_ceiling: int | None = Field(None, description="skip the sweep and use this ceiling")
    high_ceiling: int = Field(256, ge=1, description="the high-load ceiling MISA-T runs at (2 engines)")
    request_limit: int | None = Field(None, description="also run the binary with this --max-concurrent-requests")
    stream: bool = False
    skip_cluster_check: bool = Field(False, description="do not rerun each config on the cluster layer")


def add_http_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``--http-*`` flags to the bench parser."""
    d = HttpSettings()
    p.add_argument("--http-engines", type=int, default=d.engines, help=f"engine replicas (default {d.engines})")
    p.add_argument("--http-time-scale", type=float, default=d.time_scale,
                   help=f"modelled seconds per wall second (default {d.time_scale:g})")
    p.add_argument("--http-duration", type=float, default=d.duration_s,
                   help=f"modelled seconds per HTTP run (default {d.duration_s:g})")
    p.add_argument("--http-warmup", type=float, default=d.warmup_s,
                   help=f"modelled seconds excluded from rates (default {d.warmup_s:g})")
    p.add_argument("--http-tuned", type=int, default=None, help="tuned ceiling (skips the cluster sweep)")
    p.add_argument("--http-high", type=int, default=d.high_ceiling,
                   help=f"the high ceiling MISA-T runs at (default {d.high_ceiling})")
    p.add_argument("--http-request-limit", type=int, default=None,
                   help="also run the binary with this --max-concurrent-requests")
    p.add_argument("--http-stream", action="store_true", help="the trainer streams its requests")
    p.add_argument("--http-skip-cluster-check", action="store_true",
                   help="do not rerun each HTTP config on the cluster layer (saves CPU)")
    p.add_argument("--http-only", default=None,
                   help="comma-separated run names to do (default all): " + ",".join(HTTP_RUNS))


def http_settings_from_args(args: argparse.Namespace) -> HttpSettings:
    """``HttpSettings`` from parsed flags."""
    return HttpSettings(engines=args.http_engines, time_scale=args.http_time_scale, duration_s=args.http_duration,
                        warmup_s=args.http_warmup, tuned_ceiling=args.http_tuned, high_ceiling=args.http_high,
                        request_limit=args.http_request_limit, stream=args.http_stream,
                        skip_cluster_check=args.http_skip_cluster_check)


def find_vllm_router() -> str | None:
    """Path of the ``vllm-router`` binary, or None when it is not installed."""
    here = Path(sys.executable).parent / VLLM_ROUTER_BINARY
    if here.exists():
        return str(here)
    return shutil.which(VLLM_ROUTER_BINARY)


# --- engines ---------------------------------------------------------------------------


class WindowKeepUp:
    """Keep-up of each engine over a window: ``mark`` at its start, ``ratios`` at its end."""

    def __init__(self, loops: list[EngineLoop]) -> None:
        self.loops = loops
        self._start = [(0.0, 0.0)] * len(loops)

    @staticmethod
    def _totals(loop: EngineLoop) -> tuple[float, float]:
        k = loop.keep_up()
        return k.advanced_s, k.busy_s

    def mark(self) -> None:
        self._start = [self._totals(loop) for loop in self.loops]

    def advanced_s(self) -> list[float]:
        """Modelled step time per engine since ``mark``."""
        return [self._totals(loop)[0] - a for loop, (a, _) in zip(self.loops, self._start, strict=True)]

    def ratios(self) -> list[float]:
        """Per engine: step time / (busy wall time x time scale) since ``mark``; 1 when never busy."""
        out = []
        for loop, (a0, b0) in zip(self.loops, self._start, strict=True):
            a, b = self._totals(loop)
            out.append(min(1.0, (a - a0) / (b - b0)) if b > b0 else 1.0)
        return out


@dataclass
class Fleet:
    """Running simulated engines."""

    urls: list[str]
    engines: list[SimEngine]
    loops: list[EngineLoop]
    runners: list[web.AppRunner]

    def preemptions(self) -> int:
        return sum(e.sync_counters().num_preemptions for e in self.engines)


@contextlib.asynccontextmanager
async def engine_fleet(cfg: SimEngineConfig, n: int) -> AsyncIterator[Fleet]:
    """``n`` fresh engines (seeds ``seed + i``, as the cluster layer) on free ports."""
    fleet = Fleet([], [], [], [])
    try:
        for i in range(n):
            app = create_app(cfg.model_copy(update={"seed": cfg.seed + i, "engine_index": i}))
            fleet.loops.append(app[STATE].loop)
            fleet.engines.append(app[STATE].engine)
            runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
            await runner.setup()
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port, backlog=SIM_LISTEN_BACKLOG).start()
            fleet.runners.append(runner)
            fleet.urls.append(f"http://127.0.0.1:{port}")
        yield fleet
    finally:
        for runner in fleet.runners:
            await runner.cleanup()


# --- routers ---------------------------------------------------------------------------


def vllm_router_command(binary: str, urls: list[str], port: int, *, time_scale: float,
                        request_limit: int | None = None, cache: CacheAwareSettings | None = None) -> list[str]:
    """The binary's command line: cache_aware, the given thresholds, an optional request limit."""
    ca = cache or CacheAwareSettings()
    cmd = [binary, "--worker-urls", *urls, "--policy", "cache_aware", "--host", "127.0.0.1", "--port", str(port),
           "--prometheus-port", str(free_port()), "--log-level", "warning",
           "--cache-threshold", str(ca.cache_threshold),
           "--balance-abs-threshold", str(ca.balance_abs_threshold),
           "--balance-rel-threshold", str(ca.balance_rel_threshold),
           "--eviction-interval-secs", str(max(1, round(BINARY_EVICTION_INTERVAL_S / time_scale))),
           "--max-tree-size", str(ca.max_tree_size),
           "--request-timeout-secs", str(int(REQUEST_TIMEOUT_S))]
    if request_limit is not None:
        cmd += ["--max-concurrent-requests", str(request_limit), "--queue-size", str(UNLIMITED_QUEUE),
                "--queue-timeout-secs", str(int(REQUEST_TIMEOUT_S))]
    return cmd


def misat_router_config(urls: list[str], model: str, spec: WorkloadSpec, policy: PolicySettings,
                        time_scale: float) -> dict[str, Any]:
    """This router's config: scrape interval and admission epoch scaled like the engines' time."""
    period = CLUSTER_SCRAPE_S / time_scale
    policy = policy.model_copy(update={"admission": policy.admission.model_copy(update={"epoch_s": period})})
    return {
        "model": model,
        "engines": {"urls": urls},
        "workloads": mix_for(spec, policy.footprint.bootstrap_tokens).model_dump(mode="json"),
        "policy": policy.model_dump(mode="json"),
        "scrape_interval_s": period,
        "health_interval_s": max(period, 0.5),
    }


class RouterStartError(RuntimeError):
    """A router subprocess exited or stayed unhealthy at start (the message names its log)."""


@dataclass(frozen=True)
class RouterProcess:
    """A running router subprocess: its base URL and pid (for CPU readings)."""

    url: str
    pid: int


@contextlib.asynccontextmanager
async def router_process(cmd: list[str], port: int, health_path: str, log_path: Path) -> AsyncIterator[RouterProcess]:
    """Start a router subprocess, wait (bounded) for its health endpoint, stop its process group on exit.

    A router that exits or stays unhealthy raises ``RouterStartError`` naming its log."""
    proc = start_process(cmd, log_path=log_path)
    base = f"http://127.0.0.1:{port}"
    try:
        try:
            await wait_http_ok(base + health_path, proc, HEALTH_TIMEOUT_S, what=f"router (log: {log_path})")
        except ProcessStartError as exc:
            raise RouterStartError(str(exc)) from None
        yield RouterProcess(base, proc.pid)
    finally:
        stop_processes([proc], STOP_GRACE_S)


# --- one run ---------------------------------------------------------------------------


class HttpRun(BaseModel):
    """One HTTP run: which router, policy, ceiling; and what it measured (modelled time)."""

    model_config = ConfigDict(extra="forbid")
    name: str
    router: Literal["vllm-router", "misat"]
    policy: str
    ceiling: int
    request_limit: int | None = None
    sample_rate_per_min: float
    prefix_hit_rate: float | None
    tv_points: float | None
    preemptions: int
    units_completed: int
    errors: int
    retries: int
    missing_token_ids: int
    engine_clock_rate_per_min: float | None = Field(
        None, description="units per minute of the engines' own busy time (mean over engines of summed step "
        "durations in the window): the rate lag-corrected, valid while the engines are kept busy")
    keep_up: list[float] = Field(description="per engine, over the measured window: modelled time advanced / "
                                 "(wall time busy x time scale)")
    comparison: bool = Field(True, description=f"False when an engine's keep-up was under {KEEP_UP_COMPARABLE}: "
                             "not a comparison (the engines ran slower than modelled)")
    wall_s: float
    cpu_s: float = Field(0.0, description="CPU seconds of this process (engines + trainer) during the run")
    error_examples: dict[str, str] = Field(default_factory=dict)


def _window(end: TrainerReport, start: TrainerReport | None, time_scale: float) -> dict[str, Any]:
    """Rates over the measured window (after warm-up), in modelled time."""
    s_units = start.units_completed if start else 0
    s_elapsed = start.elapsed_s if start else 0.0
    s_prompt = start.prompt_tokens if start else 0
    s_cached = start.cached_tokens if start else 0
    wall = max(1e-9, end.elapsed_s - s_elapsed)
    prompt = end.prompt_tokens - s_prompt
    consumed = {k.value: float(v.units - (start.per_class[k].units if start else 0)) for k, v in end.per_class.items()}
    target = {k.value: v for k, v in end.target_mixture_pct.items()}
    return {
        "sample_rate_per_min": 60.0 * (end.units_completed - s_units) / (wall * time_scale),
        "prefix_hit_rate": (end.cached_tokens - s_cached) / prompt if prompt else None,
        "tv_points": tv_distance_points(target, consumed) if target and sum(consumed.values()) else None,
    }


async def run_one(name: str, router: Literal["vllm-router", "misat"], policy: PolicySettings, ceiling: int,
                  h: HttpSettings, s: BenchSettings, spec: WorkloadSpec, log_dir: Path,
                  request_limit: int | None = None) -> HttpRun:
    """One run on fresh engines behind a fresh router."""
    engine_cfg = s.engine_config().model_copy(update={"time_scale": h.time_scale})
    model = engine_cfg.model_name()
    t0, cpu0 = time.monotonic(), time.process_time()
    async with engine_fleet(engine_cfg, h.engines) as fleet:
        port = free_port()
        with tempfile.TemporaryDirectory() as tmp:
            if router == "vllm-router":
                binary = find_vllm_router()
                if binary is None:
                    raise RuntimeError("vllm-router is not installed (pip install -e '.[bench]')")
                cmd = vllm_router_command(binary, fleet.urls, port, time_scale=h.time_scale,
                                          request_limit=request_limit, cache=policy.cache_aware)
            else:
                cfg_path = Path(tmp) / "router.json"
                cfg_path.write_text(json.dumps(misat_router_config(fleet.urls, model, spec, policy, h.time_scale)))
                cmd = [sys.executable, "-m", "misat_router.server", "--config", str(cfg_path),
                       "--host", "127.0.0.1", "--port", str(port)]
            async with router_process(cmd, port, "/health", log_dir / f"{name}.log") as proc:
                base = proc.url
                trainer = Trainer(TrainerConfig(
                    base_url=base, model=model, max_in_flight=ceiling, mode="continuous",
                    duration_s=h.duration_s / h.time_scale, time_scale=h.time_scale, stream=h.stream,
                    request_timeout_s=REQUEST_TIMEOUT_S,
                ), spec)
                task = asyncio.create_task(trainer.run())
                window = WindowKeepUp(fleet.loops)
                await asyncio.sleep(h.warmup_s / h.time_scale)
                warm = trainer.snapshot() if h.warmup_s > 0 else None
                window.mark()
                report = await task
                step_window = window.advanced_s()
                keep_up = [round(k, 4) for k in window.ratios()]
        win = _window(report, warm, h.time_scale)
        busy = sum(step_window) / len(step_window)
        units = report.units_completed - (warm.units_completed if warm else 0)
        return HttpRun(
            name=name, router=router, policy=policy.name.value, ceiling=ceiling, request_limit=request_limit,
            units_completed=report.units_completed, errors=report.errors, retries=report.retries,
            missing_token_ids=report.missing_token_ids, preemptions=fleet.preemptions(),
            keep_up=keep_up, comparison=min(keep_up) >= KEEP_UP_COMPARABLE,
            engine_clock_rate_per_min=60.0 * units / busy if busy > 0 else None, wall_s=time.monotonic() - t0,
            cpu_s=time.process_time() - cpu0, error_examples=report.error_examples, **win,
        )


HTTP_RUNS: tuple[str, ...] = (
    "vllm-router@tuned", "misat-cache-aware@tuned", "vllm-router@high", "misat-cache-aware@high",
    "misat-t@high", "vllm-router-limit@high",
)
"""The HTTP layer's runs, in order (``--http-only`` picks some)."""


QUICK_HTTP_RUNS: tuple[str, ...] = ("vllm-router@tuned", "misat-cache-aware@tuned")
"""``--quick`` runs only the binary and this router's cache-aware at the tuned ceiling."""

QUICK_HTTP_DURATION_S: float = 90.0
QUICK_HTTP_WARMUP_S: float = 20.0
"""``--quick`` HTTP runs: modelled seconds (at time scale 1, wall seconds too)."""


class HttpResult(BaseModel):
    """The HTTP layer's section of the result file."""

    model_config = ConfigDict(extra="forbid")
    settings: HttpSettings
    tuned_ceiling: int
    tune_sweep: dict[int, float] = Field(default_factory=dict, description="cluster layer, same fleet: ceiling -> rate")
    cluster_at: dict[str, float] = Field(default_factory=dict, description="cluster-layer rate of the same configs")
    runs: list[HttpRun] = Field(default_factory=list)
    rows: list[SummaryRow] = Field(default_factory=list)
    failed: dict[str, str] = Field(default_factory=dict, description="run name -> why it gave no figures")
    skipped: str | None = None


def _cluster_rate(policy: PolicySettings, ceiling: int, h: HttpSettings, s: BenchSettings) -> float:
    """The cluster layer's figure for the same fleet, workload, duration and policy."""
    from misat_bench.cluster_runs import run_spec
    from misat_bench.suite import Baseline, RunSpec

    cs = _cluster_settings(h, s)
    run = RunSpec(workload=WorkloadName.STEADY, baseline=Baseline.SWEEP, policy=policy, ceiling=ceiling,
                  label=f"{policy.name.value} @{ceiling}")
    return run_spec(run, cs).metrics.sample_rate_per_min


def _cluster_settings(h: HttpSettings, s: BenchSettings) -> BenchSettings:
    return s.model_copy(update={"engines": h.engines, "duration_s": h.duration_s, "warmup_s": h.warmup_s})


def run_http_layer(args: argparse.Namespace, s: BenchSettings, console: Console) -> HttpResult:
    """The side-by-side HTTP runs on steady; skipped with a reason when the binary is absent."""
    h = http_settings_from_args(args)
    spec = WorkloadSpec(seed=s.seed)
    if find_vllm_router() is None:
        reason = "vllm-router binary not installed (pip install -e '.[bench]')"
        console.print(f"[yellow]http layer skipped: {reason}[/yellow]")
        return HttpResult(settings=h, tuned_ceiling=0, skipped=reason)
    ca = PolicySettings(name=PolicyName.CACHE_AWARE)
    sweep: dict[int, float] = {}
    if h.tuned_ceiling is None:
        console.print(f"[bold]http: tuning the ceiling on the cluster layer ({h.engines} engines)[/bold]")
        for c in h.tune_ceilings:
            sweep[c] = _cluster_rate(ca, c, h, s)
            console.print(f"  cluster cache_aware @{c}: {sweep[c]:.1f}/min")
        tuned = pick_oracle(sweep)
    else:
        tuned = h.tuned_ceiling
    result = HttpResult(settings=h, tuned_ceiling=tuned, tune_sweep=sweep)
    mt = PolicySettings(name=PolicyName.MISA_T)
    plan: dict[str, tuple[Literal["vllm-router", "misat"], PolicySettings, int, int | None]] = {
        "vllm-router@tuned": ("vllm-router", ca, tuned, None),
        "misat-cache-aware@tuned": ("misat", ca, tuned, None),
        "vllm-router@high": ("vllm-router", ca, h.high_ceiling, None),
        "misat-cache-aware@high": ("misat", ca, h.high_ceiling, None),
        "misat-t@high": ("misat", mt, h.high_ceiling, None),
    }
    if h.request_limit is not None:
        plan["vllm-router-limit@high"] = ("vllm-router", ca, h.high_ceiling, h.request_limit)
    only = set(args.http_only.split(",")) if getattr(args, "http_only", None) else None
    if only is None and getattr(args, "quick", False):
        only = set(QUICK_HTTP_RUNS)  # the agreement check only: each run takes its duration in wall time
        h = h.model_copy(update={"duration_s": min(h.duration_s, QUICK_HTTP_DURATION_S),
                                 "warmup_s": min(h.warmup_s, QUICK_HTTP_WARMUP_S)})
        result.settings = h
    log_dir = Path(args.out) / "http-logs"
    for name, (router, policy, ceiling, limit) in plan.items():
        if only is not None and name not in only:
            continue
        console.print(f"[bold]http run {name}[/bold] ({h.duration_s:g} modelled s at time scale {h.time_scale:g})")
        try:
            run = asyncio.run(run_one(name, router, policy, ceiling, h, s, spec, log_dir, limit))
        except (RuntimeError, OSError, aiohttp.ClientError) as exc:  # one failed run must not lose the others
            result.failed[name] = f"{type(exc).__name__}: {exc}"
            console.print(f"  [red]failed: {exc}[/red]")
            continue
        result.runs.append(run)
        flag = "" if run.comparison else "  [red]not a comparison[/red]"
        console.print(f"  {run.sample_rate_per_min:.1f}/min hit {100 * (run.prefix_hit_rate or 0):.1f}% "
                      f"TV {run.tv_points if run.tv_points is not None else float('nan'):.2f} "
                      f"preempt {run.preemptions} errors {run.errors} keep-up {min(run.keep_up):.3f} "
                      f"engine-clock {run.engine_clock_rate_per_min or 0:.1f}/min "
                      f"wall {run.wall_s:.0f}s cpu {run.cpu_s:.0f}s{flag}", highlight=False)
        warning = keep_up_warning({f"engine-{i}": k for i, k in enumerate(run.keep_up)}, threshold=KEEP_UP_WARN)
        if warning:
            console.print(f"  [yellow]warning: {warning}[/yellow]", highlight=False)
        if limit is None:
            key = f"{policy.name.value}@{ceiling}"
            if key not in result.cluster_at and not h.skip_cluster_check:
                result.cluster_at[key] = _cluster_rate(policy, ceiling, h, s)
                console.print(f"  cluster layer, same config: {result.cluster_at[key]:.1f}/min")
    result.rows = http_rows(result.runs)
    return result


def http_rows(runs: list[HttpRun]) -> list[SummaryRow]:
    """The table rows of the HTTP runs: rates against the tuned binary, keep-up, and the marking of
    runs whose engines could not keep up (a ratio to such a reference compares nothing either)."""
    ref_run = next((r for r in runs if r.name == "vllm-router@tuned"), None)
    ref = ref_run.sample_rate_per_min if ref_run is not None else None
    return [SummaryRow(
        layer="http", workload="steady", baseline=r.name, router=r.router, ceiling=r.ceiling,
        label=f"{r.router} {r.policy} @{r.ceiling}" + (f" limit {r.request_limit}" if r.request_limit else ""),
        sample_rate_per_min=r.sample_rate_per_min,
        ratio_to_oracle=(r.sample_rate_per_min / ref) if ref else None,
        prefix_hit_rate=r.prefix_hit_rate, tv_points=r.tv_points, preemptions=r.preemptions,
        keep_up=min(r.keep_up), comparison=r.comparison and (ref_run is None or ref_run.comparison),
    ) for r in runs]
