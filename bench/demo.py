"""``misat demo`` (what ``make demo`` runs): this router against the vLLM Router, side by side.

Three rows on the same seeded workload and the same simulated fleet
(``examples/mixed-pool.yaml``: four engines, the paper's mixture), each on
fresh engines behind a fresh router process, driven by the trainer emulator:

1. this router with the manifest's policy (the project's default), untuned,
   the trainer at a high ceiling;
2. the vLLM Router's ``cache_aware`` at its tuned ceiling: the best of a sweep
   on the cluster simulation of the same fleet and workload (read from a
   cached sweep when one matches, else run; the demo says which);
3. the same baseline at the high ceiling: what a wrong limit costs.

``--kv-factor F`` gives the engines F times the profile's KV (another GPU or
model: the benchmark's kv-half and kv-double cells) and adds a fourth row, the
baseline at the ceiling tuned for the manifest's own fleet (``tuned-once``): a
limit someone tuned and nobody re-tuned when the fleet changed.

The baseline is the real ``vllm-router`` binary when installed (the
``bench`` extra, which ``make demo`` installs); otherwise this project's
re-implementation of its ``cache_aware``, and the demo says so.

Engines run ``time_scale`` times faster than real time and report their
keep-up; rates are in modelled minutes, measured after a warm-up. Output:
a table, a verdict, ``out/demo/demo.png`` and ``out/demo/result.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Literal

import aiohttp
from pydantic import BaseModel, ConfigDict, Field
from rich.console import Console
from rich.table import Table

from misat_bench.demo_report import (
    CONVERGENCE,
    DemoReport,
    Row,
    RowSpec,
    RunFigures,
    SeriesSample,
    build_report,
    table_rows,
    window_converged,
)
from misat_bench.http_layer import RouterStartError, find_vllm_router, router_process, vllm_router_command
from misat_bench.suite import pick_oracle, refine_ceilings
from misat_cli.localpool import (
    PoolError,
    get_keep_up,
    load_manifest,
    render_local_config,
    start_sim_engines,
    stop_engines,
)
from misat_cli.processes import free_port
from misat_operator.models import RolloutPoolSpec
from misat_router.config import RouterConfig
from misat_router.policy.settings import CacheAwareSettings, PolicyName, PolicySettings
from misat_router.vllm_metrics import parse_vllm_page
from misat_sim.cluster import ClusterConfig, run_cluster
from misat_sim.config import SimEngineConfig
from misat_sim.engine_loop import keep_up_warning
from misat_sim.report import TrainerReport, mixture_constrained_rate, tv_distance_points
from misat_sim.trainer import Trainer, TrainerConfig
from misat_sim.workload import RolloutClass, WorkloadSpec

DEFAULT_MANIFEST = Path("examples/mixed-pool.yaml")
CACHED_SWEEPS = Path(__file__).parent / "data" / "demo_tuning.json"
"""Tuning sweeps shipped with the project, keyed by the digest of what they depend on."""
SAMPLE_S: float = 1.0
"""Wall seconds between time-series samples (trainer snapshot + engine KV use)."""
PROGRESS_S: float = 10.0
"""Wall seconds between progress lines."""
SCRAPE_TIMEOUT_S: float = 2.0
REQUEST_TIMEOUT_S: float = 3600.0
"""Trainer request timeout, wall seconds: nothing legitimate takes this long here."""
LAG_PROBE_S: float = 0.1
"""Period of the event-loop lag probe of the trainer's process."""
TRAINER_LAG_WARN_S: float = 0.05
"""Modelled seconds of mean trainer event-loop lag above which a run is warned about: the trainer,
not the engines or the routers, was short of CPU (its tool gaps and releases ran late)."""
ROUTER_SCRAPE_S: float = 0.5
"""Modelled seconds between this router's metric scrapes and admission epochs (as the cluster
layer's default); the wall period is this divided by the time scale."""


class DemoSettings(BaseModel):
    """The demo's knobs (flags of ``misat demo``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    manifest: Path = DEFAULT_MANIFEST
    profile: str = Field("qwen30b-a3b-h100", description="simulation profile of the engines")
    engines: int | None = Field(
        2, ge=1, description="engine replicas (None: the manifest's); two by default so that on a 2-core "
        "machine the engines, this router's process and the trainer all keep up at the time scale")
    time_scale: float = Field(6.0, gt=0, description="modelled seconds per wall second")
    duration_s: float = Field(960.0, gt=0, description="modelled seconds per run, warm-up included")
    warmup_s: float = Field(
        600.0, ge=0, description="modelled seconds excluded from every figure: the benchmark's steady-state "
        "rule (at least 5x the longest class's median residency, RLVR's ~95 s here; docs/benchmark.md), "
        "since admission policies' estimators are still filling before it")
    high_ceiling: int = Field(512, ge=1, description="the trainer ceiling of the untuned and high rows")
    kv_factor: float = Field(
        1.0, gt=0, description="the engines' KV blocks times this (the benchmark's kv-half is 0.5, kv-double 2); "
        "other than 1 adds the tuned-once row: the ceiling tuned for the fleet at 1, unchanged")
    tune_ceilings: tuple[int, ...] = Field((64, 96, 128, 160, 192, 256, 384),
                                           description="the cluster sweep for the tuned ceiling")
    tune_step: int = Field(8, ge=1, description="the sweep is refined around its best point to this step")
    seed: int = Field(0, description="workload seed of the first repeat; repeat k uses seed + k")
    repeat: int = Field(1, ge=1, description="runs per row (with 2 or more: 95% intervals)")
    retune: bool = Field(False, description="run the sweep even when a cached one matches")
    out: Path = Path("out/demo")


QUICK = {"duration_s": 150.0, "warmup_s": 50.0}
"""``--quick``: about a minute of runs; too short a window to compare policies (docs/demo.md)."""


def build_parser() -> argparse.ArgumentParser:
    d = DemoSettings()
    ap = argparse.ArgumentParser(prog="misat demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-f", "--filename", type=Path, default=d.manifest,
                    help=f"RolloutPool manifest (default {d.manifest})")
    ap.add_argument("--quick", action="store_true",
                    help=f"short runs ({QUICK['duration_s']:g} modelled s, {QUICK['warmup_s']:g} warm-up): "
                    "about a minute")
    ap.add_argument("--duration", type=float, default=None,
                    help=f"modelled seconds per run, warm-up included (default {d.duration_s:g})")
    ap.add_argument("--warmup", type=float, default=None,
                    help=f"modelled seconds excluded from the figures (default {d.warmup_s:g})")
    ap.add_argument("--engines", type=int, default=d.engines,
                    help=f"simulated engine replicas, overriding the manifest's (default {d.engines})")
    ap.add_argument("--time-scale", type=float, default=d.time_scale,
                    help=f"simulated engines run this many times faster than real time (default {d.time_scale:g})")
    ap.add_argument("--high-ceiling", type=int, default=d.high_ceiling,
                    help=f"trainer ceiling of the untuned row and the high baseline row (default {d.high_ceiling})")
    ap.add_argument("--kv-factor", type=float, default=d.kv_factor,
                    help="engines with this many times the profile's KV blocks, and a tuned-once row: the "
                    f"baseline at the ceiling tuned for the fleet at 1 (default {d.kv_factor:g})")
    ap.add_argument("--profile", default=d.profile, help=f"simulation profile of the engines (default {d.profile})")
    ap.add_argument("--seed", type=int, default=d.seed, help=f"workload seed (default {d.seed})")
    ap.add_argument("--repeat", type=int, default=d.repeat,
                    help=f"runs per row; 2 or more give 95%% intervals (default {d.repeat})")
    ap.add_argument("--retune", action="store_true", help="run the tuning sweep even if a cached one matches")
    ap.add_argument("--out", type=Path, default=d.out, help=f"report directory (default {d.out})")
    return ap


def settings_from_args(args: argparse.Namespace) -> DemoSettings:
    base = DemoSettings.model_validate(QUICK if args.quick else {})
    update: dict[str, Any] = {"manifest": args.filename, "time_scale": args.time_scale, "engines": args.engines,
                              "high_ceiling": args.high_ceiling, "kv_factor": args.kv_factor,
                              "profile": args.profile, "seed": args.seed,
                              "repeat": args.repeat, "retune": args.retune, "out": args.out}
    if args.duration is not None:
        update["duration_s"] = args.duration
    if args.warmup is not None:
        update["warmup_s"] = args.warmup
    s = DemoSettings.model_validate({**base.model_dump(), **update})
    if s.warmup_s >= s.duration_s:
        raise PoolError(f"--warmup ({s.warmup_s:g}) must be shorter than --duration ({s.duration_s:g})")
    return s


# --- the fleet and the workload, shared by the live runs and the tuning sweep --------------


def load_pool(s: DemoSettings) -> tuple[str, RolloutPoolSpec]:
    """The manifest, with the demo's engine count."""
    name, spec = load_manifest(s.manifest)
    if s.engines is not None and s.engines != spec.engines.replicas:
        spec = spec.model_copy(update={"engines": spec.engines.model_copy(update={"replicas": s.engines})})
    return name, spec


def workload_spec(spec: RolloutPoolSpec, seed: int, length_scale: float) -> WorkloadSpec:
    known = {c.value for c in RolloutClass}
    names = [w.name for w in spec.workloads]
    unknown = sorted(set(names) - known)
    if unknown:
        raise PoolError(f"the demo's trainer emulates the classes {sorted(known)}; the manifest has {unknown}")
    mixture = {RolloutClass(w.name): w.share for w in spec.workloads}
    return WorkloadSpec(seed=seed, mixture=mixture, session_prefix=f"demo{seed}", length_scale=length_scale)


def engine_config(spec: RolloutPoolSpec, profile: str, kv_factor: float = 1.0) -> SimEngineConfig:
    """The simulated engines as ``misat up`` starts them for this manifest (engine i: seed i), with
    ``kv_factor`` times the profile's KV blocks."""
    extra: dict[str, Any] = {}
    if spec.engines.max_num_seqs is not None:
        extra["max_num_seqs"] = spec.engines.max_num_seqs
    if spec.engines.max_num_batched_tokens is not None:
        extra["max_num_batched_tokens"] = spec.engines.max_num_batched_tokens
    try:
        cfg = SimEngineConfig(profile=profile, **extra)
        if kv_factor != 1.0:
            blocks = max(2, round(cfg.resolve().num_gpu_blocks * kv_factor))
            cfg = SimEngineConfig(profile=profile, num_gpu_blocks=blocks, **extra)
            cfg.resolve()  # a KV too small for the model's length is refused here, by name
        return cfg
    except ValueError as exc:
        flag = f" with --kv-factor {kv_factor:g}" if kv_factor != 1.0 else ""
        raise PoolError(f"simulation profile {profile!r}{flag}: {exc}") from None


# --- tuning ------------------------------------------------------------------------------


class Tuning(BaseModel):
    """The baseline's tuned ceiling and the sweep behind it."""

    model_config = ConfigDict(extra="forbid")
    key: str
    ceiling: int
    sweep: dict[int, float] = Field(description="ceiling -> mixture-constrained samples/min (cluster layer)")
    source: str = Field("", description="how this run got it")


def _source_digest() -> str:
    """Digest of the simulator's and the policies' source: a sweep is stale once either changes."""
    import misat_router.policy
    import misat_sim

    h = hashlib.sha256()
    for pkg in (misat_sim, misat_router.policy):
        root = Path(str(pkg.__file__)).parent
        for path in sorted(root.rglob("*.py")):
            h.update(path.relative_to(root).as_posix().encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def tuning_config(s: DemoSettings, spec: RolloutPoolSpec, ceiling: int) -> ClusterConfig:
    eng = engine_config(spec, s.profile, s.kv_factor)
    return ClusterConfig(engines=spec.engines.replicas, engine=eng, ceiling=ceiling,
                         policy=PolicySettings(name=PolicyName.CACHE_AWARE),
                         workload=workload_spec(spec, s.seed, eng.resolve().length_scale),
                         duration_s=s.duration_s, warmup_s=s.warmup_s, scrape_interval_s=ROUTER_SCRAPE_S)


def tuning_key(s: DemoSettings, spec: RolloutPoolSpec) -> str:
    cfg = tuning_config(s, spec, 1).model_dump(mode="json", exclude={"ceiling"})
    blob = json.dumps({"cluster": cfg, "ceilings": s.tune_ceilings, "step": s.tune_step, "source": _source_digest()},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _read_sweeps(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise PoolError(f"{path}: unreadable tuning cache: {exc}") from None
    return data if isinstance(data, dict) else {}


def tune(s: DemoSettings, spec: RolloutPoolSpec, console: Console) -> Tuning:
    """The tuned ceiling: from a matching cached sweep, else a sweep on the cluster simulation."""
    key = tuning_key(s, spec)
    local = s.out / "tuning.json"
    if not s.retune:
        for path in (CACHED_SWEEPS, local):
            hit = _read_sweeps(path).get(key)
            if hit is not None:
                # The entry's key is the one it is filed under: entries carry none of their own
                # (caches written before may, and a re-keyed file would leave those stale).
                t = Tuning.model_validate({**hit, "key": key} if isinstance(hit, dict) else hit)
                t.source = f"read from the cached sweep in {path} (key {key}; --retune runs it again)"
                return t
    console.print(f"tuning: no cached sweep matches (key {key}); sweeping cache_aware ceilings "
                  f"{list(s.tune_ceilings)} on the cluster simulation of this fleet ...")
    t0 = time.process_time()
    sweep: dict[int, float] = {}
    target = {k.value: v for k, v in workload_spec(spec, s.seed, 1.0).mixture_at(0.0).items()}

    def measure(c: int) -> None:
        r = run_cluster(tuning_config(s, spec, c))
        sweep[c] = round(mixture_constrained_rate(target, r.units_completed, r.measured_s / 60.0) or 0.0, 3)
        console.print(f"  ceiling {c}: {sweep[c]:.1f} mixture-constrained samples/min")

    for c in s.tune_ceilings:
        measure(c)
    while batch := refine_ceilings(sweep, step=s.tune_step):
        for c in batch:
            measure(c)
    t = Tuning(key=key, ceiling=pick_oracle(sweep), sweep=sweep,
               source=f"swept now on the cluster simulation ({time.process_time() - t0:.0f} CPU s); "
               f"saved in {local}")
    s.out.mkdir(parents=True, exist_ok=True)
    cached = _read_sweeps(local)
    cached[key] = t.model_dump(mode="json", exclude={"source", "key"})
    local.write_text(json.dumps(cached, indent=2, sort_keys=True) + "\n")
    return t


class LoopLag:
    """How late this process's event loop runs a timer: the trainer runs here (routers and engines
    have their own processes), so lag means the trainer is short of CPU."""

    def __init__(self) -> None:
        self.samples: list[float] = []

    async def run(self) -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(LAG_PROBE_S)  # the probe's period, not a synchronisation
            self.samples.append(max(0.0, time.monotonic() - t - LAG_PROBE_S))

    def mean_s(self) -> float | None:
        """Mean lag in wall seconds; None before any sample."""
        return sum(self.samples) / len(self.samples) if self.samples else None


def warnings(report: DemoReport, time_scale: float) -> list[str]:
    """Keep-up under ``KEEP_UP_WARN`` per engine, and a trainer that lagged, per run."""
    out = []
    for row in report.rows:
        for run in row.runs:
            line = keep_up_warning({f"engine-{i}": k for i, k in enumerate(run.keep_up)})
            if line:
                out.append(f"{row.spec.label} (seed {run.seed}): {line}")
            if row.router_saturated(run):
                out.append(f"{row.spec.label} (seed {run.seed}): this router's process used {run.router_cpu:.2f} of a "
                           "core: its event loop, not the policy, set the pace; lower --time-scale")
            if run.converged is False:
                out.append(f"{row.spec.label} (seed {run.seed}): its measured window did not converge (a class's "
                           f"completions over the last {CONVERGENCE.convergence_windows} windows of "
                           f"{CONVERGENCE.window_s:g} modelled s disagree between the early and late half): it may "
                           "still hold a transient; a longer --warmup or --duration measures past it")
            if run.trainer_lag_s is not None and run.trainer_lag_s * time_scale > TRAINER_LAG_WARN_S:
                out.append(f"{row.spec.label} (seed {run.seed}): the trainer's process lagged "
                           f"{1000 * run.trainer_lag_s:.0f} ms on average ({run.trainer_lag_s * time_scale:.2f} "
                           f"modelled s at x{time_scale:g}): it was short of CPU; lower --time-scale")
    return out


# --- one live run ------------------------------------------------------------------------


def router_config_for(name: str, spec: RolloutPoolSpec, urls: list[str], policy: PolicyName | None,
                      length_scale: float, time_scale: float) -> RouterConfig:
    """The router config ``misat up`` renders, with its periods scaled to the engines' speed."""
    cfg = render_local_config(name, spec, urls, 1, policy=policy, length_scale=length_scale)
    period = ROUTER_SCRAPE_S / time_scale
    admission = cfg.policy.admission.model_copy(update={"epoch_s": period})
    return cfg.model_copy(update={"policy": cfg.policy.model_copy(update={"admission": admission}),
                                  "scrape_interval_s": period,
                                  "health_interval_s": max(period, cfg.health_interval_s / time_scale)})


async def _engine_metrics(http: aiohttp.ClientSession, urls: list[str]) -> list[Any]:
    async def one(url: str) -> Any:
        try:
            async with http.get(url + "/metrics") as r:
                return parse_vllm_page(await r.text())[0]
        except (aiohttp.ClientError, TimeoutError):
            return None
    return list(await asyncio.gather(*(one(u) for u in urls)))


async def _keep_up(http: aiohttp.ClientSession, urls: list[str]) -> list[dict[str, Any] | None]:
    return list(await asyncio.gather(*(get_keep_up(http, u) for u in urls)))


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) a process has used, from ``/proc``; None where unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    # After the command name: state is field 3, utime and stime fields 14 and 15 (proc(5)).
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _router_status(http: aiohttp.ClientSession, base: str) -> dict[str, Any] | None:
    try:
        async with http.get(base + "/status") as r:
            body: dict[str, Any] = await r.json()
            return body
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


def _window_keep_up(start: list[dict[str, Any] | None], end: list[dict[str, Any] | None]) -> list[float | None]:
    """Per engine: modelled time advanced / busy time, over the measured window (None: not busy)."""
    out: list[float | None] = []
    for a, b in zip(start, end, strict=True):
        if a is None or b is None:
            out.append(None)
            continue
        busy = b["busy_s"] - a["busy_s"]
        out.append(round(min(1.0, (b["advanced_s"] - a["advanced_s"]) / busy), 4) if busy > 0 else None)
    return out


def _sample(t_model: float, snap: TrainerReport, metrics: list[Any], status: dict[str, Any] | None) -> SeriesSample:
    usage = [m.kv_usage for m in metrics if m is not None]
    return SeriesSample(t_s=round(t_model, 2), units=snap.units_completed,
                        units_by_class={k.value: v.units for k, v in snap.per_class.items()},
                        prompt_tokens=snap.prompt_tokens, cached_tokens=snap.cached_tokens,
                        kv_usage=round(sum(usage) / len(usage), 4) if usage else None,
                        held=None if status is None else status.get("held_requests"),
                        sessions_by_class=None if status is None else
                        {c["name"]: c["active_sessions"] for c in status.get("classes", [])})


def figures(seed: int, s: DemoSettings, warm: TrainerReport, end: TrainerReport, preemptions: int,
            keep_up: list[float | None], wall_s: float, series: list[SeriesSample]) -> RunFigures:
    """The measured window's figures (end minus warm-up snapshot), in modelled minutes."""
    window_s = (end.elapsed_s - warm.elapsed_s) * s.time_scale
    minutes = window_s / 60.0
    done = {k.value: float(end.per_class[k].units - warm.per_class[k].units) for k in end.per_class}
    target = {k.value: v for k, v in end.target_mixture_pct.items()}
    prompt = end.prompt_tokens - warm.prompt_tokens
    return RunFigures(
        seed=seed, window_s=round(window_s, 1),
        mixture_rate_per_min=mixture_constrained_rate(target, done, minutes),
        units_per_min=sum(done.values()) / minutes if minutes > 0 else 0.0,
        requests_per_min=(end.requests - warm.requests) / minutes if minutes > 0 else 0.0,
        prefix_hit_rate=(end.cached_tokens - warm.cached_tokens) / prompt if prompt else None,
        preemptions=preemptions,
        tv_points=tv_distance_points(target, done) if sum(done.values()) else None,
        consumed_pct={k: round(100 * v / sum(done.values()), 2) if sum(done.values()) else 0.0
                      for k, v in done.items()},
        keep_up=keep_up, errors=end.errors, wall_s=round(wall_s, 1), series=series,
        converged=window_converged(series, window_s),
    )


async def run_row(row: RowSpec, s: DemoSettings, seed: int, console: Console) -> RunFigures:
    """One run of one row on fresh engines behind a fresh router process."""
    name, spec = load_pool(s)
    eng = engine_config(spec, s.profile, s.kv_factor)
    length_scale = eng.resolve().length_scale
    log_dir = s.out / "logs" / f"{row.role}-seed{seed}"
    log_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    engines = await start_sim_engines(spec, profile=s.profile, time_scale=s.time_scale, host="127.0.0.1",
                                      log_dir=log_dir, num_gpu_blocks=eng.num_gpu_blocks)
    try:
        urls = [e.url for e in engines]
        port = free_port()
        if row.router == "vllm-router":
            binary = find_vllm_router()
            if binary is None:
                raise PoolError("vllm-router is not installed")
            cmd = vllm_router_command(binary, urls, port, time_scale=s.time_scale, cache=CacheAwareSettings())
            health = "/health"
        else:
            policy = None if row.role == "untuned" else PolicyName.CACHE_AWARE
            cfg = router_config_for(name, spec, urls, policy, length_scale, s.time_scale)
            cfg_path = log_dir / "router.json"
            cfg_path.write_text(cfg.model_dump_json(indent=2))
            cmd = [sys.executable, "-P", "-m", "misat_router.server", "--config", str(cfg_path),
                   "--host", "127.0.0.1", "--port", str(port)]
            health = "/ready"
        async with router_process(cmd, port, health, log_dir / "router.log") as router, \
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)) as http:
            trainer = Trainer(TrainerConfig(
                base_url=router.url, model=spec.model.served, max_in_flight=row.ceiling, mode="continuous",
                duration_s=s.duration_s / s.time_scale, time_scale=s.time_scale,
                request_timeout_s=REQUEST_TIMEOUT_S,
            ), workload_spec(spec, seed, length_scale))
            task = asyncio.create_task(trainer.run())
            lag = LoopLag()
            probe = asyncio.create_task(lag.run())
            series: list[SeriesSample] = []
            warm: TrainerReport | None = None
            warm_metrics: list[Any] = []
            warm_keep: list[dict[str, Any] | None] = []
            warm_cpu: tuple[float | None, float] = (None, 0.0)
            last_print = time.monotonic()
            while not task.done():
                await asyncio.wait({task}, timeout=SAMPLE_S)  # the sampling period, not a synchronisation
                snap = trainer.snapshot()
                t_model = snap.elapsed_s * s.time_scale
                metrics = await _engine_metrics(http, urls)
                status = await _router_status(http, router.url) if row.router == "misat" else None
                series.append(_sample(t_model, snap, metrics, status))
                if warm is None and t_model >= s.warmup_s:
                    warm, warm_metrics, warm_keep = snap, metrics, await _keep_up(http, urls)
                    warm_cpu = (process_cpu_s(router.pid), time.monotonic())
                if time.monotonic() - last_print >= PROGRESS_S:
                    last_print = time.monotonic()
                    console.print(f"  {row.label}: {t_model:4.0f}/{s.duration_s:.0f} modelled s, "
                                  f"{snap.units_completed} units, prefix hit "
                                  f"{100 * (snap.prefix_hit_rate or 0):.1f}%", highlight=False)
            end = task.result()
            probe.cancel()
            end_metrics = await _engine_metrics(http, urls)
            end_keep = await _keep_up(http, urls)
            router_status = await _router_status(http, router.url) if row.router == "misat" else None
            end_cpu = (process_cpu_s(router.pid), time.monotonic())
        if warm is None:
            raise PoolError(f"{row.label}: the run ended before its warm-up ({s.warmup_s:g} modelled s)")
        pre = sum(int(b.preemptions_total - a.preemptions_total)
                  for a, b in zip(warm_metrics, end_metrics, strict=True) if a is not None and b is not None)
        run = figures(seed, s, warm, end, pre, _window_keep_up(warm_keep, end_keep), time.monotonic() - t0,
                      series)
        run.trainer_lag_s = lag.mean_s()
        run.router_status = router_status
        if warm_cpu[0] is not None and end_cpu[0] is not None and end_cpu[1] > warm_cpu[1]:
            run.router_cpu = round((end_cpu[0] - warm_cpu[0]) / (end_cpu[1] - warm_cpu[1]), 3)
        return run
    finally:
        stop_engines(engines)


def row_specs(s: DemoSettings, policy: str, tuned: int, binary: bool, tuned_once: int | None = None) -> list[RowSpec]:
    """The three rows, and the tuned-once row when ``tuned_once`` is given; ``policy`` is the one this
    router runs for the manifest."""
    base_router: Literal["misat", "vllm-router"] = "vllm-router" if binary else "misat"
    base_label = "vLLM Router cache_aware" if binary else "cache_aware (this project's re-implementation)"
    return [
        RowSpec(role="untuned", label=f"misa-t router ({policy}, untuned)", router="misat", policy=policy,
                ceiling=s.high_ceiling),
        RowSpec(role="tuned", label=f"{base_label} @ tuned {tuned}", router=base_router, policy="cache_aware",
                ceiling=tuned),
        RowSpec(role="high", label=f"{base_label} @ high {s.high_ceiling}", router=base_router,
                policy="cache_aware", ceiling=s.high_ceiling),
    ] + ([] if tuned_once is None else [
        RowSpec(role="tuned-once", label=f"{base_label} @ tuned-once {tuned_once}", router=base_router,
                policy="cache_aware", ceiling=tuned_once),
    ])


async def demo(s: DemoSettings, console: Console) -> DemoReport:
    name, spec = load_pool(s)
    # The policy as the router will run it (what the manifest renders to), so the row says what ran.
    policy = render_local_config(name, spec, ["http://127.0.0.1:1"], 1).policy.name.value
    binary = find_vllm_router() is not None
    baseline = ("the vllm-router binary (PyPI vllm-router)" if binary else
                "this project's re-implementation of cache_aware: vllm-router is not installed "
                "(pip install 'misa-t[bench]')")
    console.print(f"baseline: {baseline}")
    tuning = tune(s, spec, console)
    console.print(f"tuned ceiling {tuning.ceiling}: {tuning.source}")
    tuned_once: Tuning | None = None
    if s.kv_factor != 1.0:
        tuned_once = tune(s.model_copy(update={"kv_factor": 1.0}), spec, console)
        console.print(f"tuned-once ceiling {tuned_once.ceiling} (tuned for the fleet at --kv-factor 1): "
                      f"{tuned_once.source}")
    rows = [Row(spec=r) for r in row_specs(s, policy, tuning.ceiling, binary,
                                           None if tuned_once is None else tuned_once.ceiling)]
    for k in range(s.repeat):
        for row in rows:
            console.print(f"[bold]{row.spec.label}[/] (trainer ceiling {row.spec.ceiling}, seed {s.seed + k}, "
                          f"{s.duration_s:g} modelled s at x{s.time_scale:g}, first {s.warmup_s:g} s not counted)")
            row.runs.append(await run_row(row.spec, s, s.seed + k, console))
    once = "" if tuned_once is None else (f"; tuned-once: ceiling {tuned_once.ceiling} of {tuned_once.sweep} "
                                          f"(the fleet at --kv-factor 1): {tuned_once.source}")
    return build_report(rows, baseline=baseline, target_pct={w.name: w.share for w in spec.workloads},
                        tuning=f"ceiling {tuning.ceiling} of {tuning.sweep}: {tuning.source}{once}")


def render_table(report: DemoReport) -> Table:
    cells = table_rows(report)
    table = Table(title="misat demo: rollout throughput with the trainer's mixture intact (modelled time)")
    for col in cells[0]:
        table.add_column(col, justify="left" if col in ("row", "ran") else "right")
    for r in cells[1:]:
        table.add_row(*r)
    return table


def plot(report: DemoReport, path: Path) -> bool:
    """Completions, prefix hit and KV use over modelled time; consumed mixture against target.

    False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    (ax_units, ax_hit), (ax_kv, ax_mix) = axes
    for row in report.rows:
        run = row.runs[0]
        ts = [p.t_s for p in run.series]
        ax_units.plot(ts, [p.units for p in run.series], label=row.spec.label)
        hit = []
        for a, b in zip(run.series, run.series[1:], strict=False):
            prompt = b.prompt_tokens - a.prompt_tokens
            hit.append(100 * (b.cached_tokens - a.cached_tokens) / prompt if prompt else float("nan"))
        ax_hit.plot(ts[1:], hit, label=row.spec.label, linewidth=0.8)
        ax_kv.plot(ts, [100 * (p.kv_usage or 0.0) for p in run.series], label=row.spec.label, linewidth=0.8)
    for ax in (ax_units, ax_hit, ax_kv):
        ax.set_xlabel("modelled time (s)")
        ax.legend(fontsize=7)
    warm_from = report.rows[0].runs[0].series[-1].t_s - report.rows[0].runs[0].window_s
    for ax in (ax_units, ax_hit, ax_kv):
        ax.axvspan(0, warm_from, color="lightgray", alpha=0.4, lw=0)
    ax_units.set_ylabel("completed rollout units (cumulative)")
    ax_units.set_title("Completions (grey: warm-up, not counted)")
    ax_hit.set_ylabel("prefix hit (% of prompt tokens)")
    ax_hit.set_title("Prefix hit over time")
    ax_kv.set_ylabel("KV cache in use (%, mean over engines)")
    ax_kv.set_title("KV in use")
    classes = list(report.rows[0].runs[0].consumed_pct)
    target = report.target_pct
    width = 0.8 / (len(report.rows) + 1)
    xs = range(len(classes))
    ax_mix.bar([x - 0.4 + width / 2 for x in xs], [target.get(c, 0.0) for c in classes], width,
               label="target", color="lightgray")
    for i, row in enumerate(report.rows, start=1):
        ax_mix.bar([x - 0.4 + width / 2 + i * width for x in xs],
                   [row.runs[0].consumed_pct.get(c, 0.0) for c in classes], width, label=row.spec.label)
    ax_mix.set_xticks(list(xs), classes)
    ax_mix.set_ylabel("% of completed units in the window")
    ax_mix.set_title("Mixture: consumed vs target")
    ax_mix.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Wide enough for the report table when output is a pipe or a log (rich assumes 80 there).
    console = Console() if sys.stdout.isatty() else Console(width=160)
    t0 = time.monotonic()
    try:
        s = settings_from_args(args)
        report = asyncio.run(demo(s, console))
    except (PoolError, RouterStartError) as exc:
        console.print(f"[bold red]misat demo:[/] {exc}")
        return 1
    except KeyboardInterrupt:
        console.print("interrupted")
        return 130
    console.print(render_table(report))
    console.print(f"baseline: {report.baseline}")
    console.print(f"tuned ceiling: {report.tuning}")
    for line in warnings(report, s.time_scale):
        console.print(f"[bold red]warning:[/] {line}")
    console.print("[bold]verdict:[/] " + " ".join(report.verdict))
    s.out.mkdir(parents=True, exist_ok=True)
    result_path = s.out / "result.json"
    result_path.write_text(json.dumps({"settings": s.model_dump(mode="json"), **report.model_dump(mode="json")},
                                      indent=2))
    png = s.out / "demo.png"
    plotted = plot(report, png)
    console.print(f"JSON result: {result_path}" + (f"; plot: {png}" if plotted else " (matplotlib missing: no plot)")
                  + f"; wall time {time.monotonic() - t0:.0f} s")
    failed = sum(r.errors for row in report.rows for r in row.runs)
    if failed:
        console.print(f"[bold red]{failed} request(s) failed[/]; see {s.out}/logs")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
