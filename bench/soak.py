"""Bounded soak of the router: many concurrent streaming sessions against simulated engines.

On loopback: ``--engines`` simulated vLLM engines, each in its own process as in a
deployment (``misat_sim``, tiny-cpu geometry with a larger KV cache, fast ``--time-scale``;
``--in-process-engines`` puts them in this process), and in this process the real
router (MISA-T, served as ``misat router`` serves it: ``misat_router.service.RouterService``) and ``--sessions``
client tasks. Each client runs sessions back to back until ``--duration`` ends: an agentic
session of 2-4 streamed turns, or a single streamed RLVR/RLHF request; every request asks
for usage in the stream. Then the clients stop, the load drains, and the run reports:

- RSS of the process (``/proc/self/status``) at the end of warm-up (``--warmup`` seconds)
  and its maximum afterwards: growth must stay under 10 %;
- open file descriptors (``/proc/self/fd``) sampled over the run, and before the load
  vs. after it drained and the client pool closed: no leak;
- p50/p99 proxy overhead from the router's ``misat_proxy_overhead_seconds`` histogram
  (arrival to upstream request sent, hold time excluded; the bucket upper bound), and the
  client-side time to first byte;
- requests, errors, broken streams, and that every in-flight, held and per-engine count
  returned to zero.

    python -P -m misat_bench.soak --sessions 1000 --duration 600 --json out/soak.json

``tests/reliability/test_soak.py`` runs it under ``-m slow`` (``MISAT_SOAK_S`` seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import subprocess
import sys
import time
import tracemalloc
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from misat_cli.processes import free_port, start_process, stop_processes
from misat_router.app import create_app
from misat_router.config import RouterConfig
from misat_router.memory import DEFAULT_MMAP_THRESHOLD_BYTES, pin_mmap_threshold
from misat_router.server import LISTEN_BACKLOG
from misat_router.service import start_service
from misat_router.state import STATE
from misat_sim.config import SimEngineConfig
from misat_sim.server import LISTEN_BACKLOG as SIM_LISTEN_BACKLOG
from misat_sim.server import create_app as create_sim_app

MODEL = "soak"
RSS_GROWTH_LIMIT = 0.10
"""The issue's bound: RSS after warm-up grows less than 10 %."""
INDEX_FULL_FRACTION = 0.99
"""The prefix index counts as filled (warm) at this fraction of its bound."""


@dataclass(frozen=True)
class SoakConfig:
    sessions: int = 1000
    duration_s: float = 600.0
    warmup_s: float = 60.0
    engines: int = 4
    time_scale: float = 20.0
    max_tokens: int = 24
    sample_every_s: float = 5.0
    seed: int = 0
    engine_processes: bool = True
    """Engines in their own processes (default), so RSS and fds are not the engines'."""
    client_process: bool = True
    """The 1,000 clients in a child process (default), so RSS and fds are the router's alone."""
    loop: str = "uvloop"
    """The event loop the router runs on (recorded; chosen with ``--loop``)."""
    mmap_threshold: int = DEFAULT_MMAP_THRESHOLD_BYTES
    """glibc mmap threshold pinned in the router's process, as ``misat router`` does (0: not pinned)."""
    tracemalloc_top: int = 0
    """When > 0: trace Python allocations and report the lines whose memory grew most between
    warm-up and the end (slows the router down; for finding what grows, not for figures)."""


@dataclass
class SoakReport:
    config: dict[str, Any]
    wall_s: float = 0.0
    requests: int = 0
    ok: int = 0
    errors: int = 0
    errors_by_kind: dict[str, int] = field(default_factory=dict)
    broken_streams: int = 0
    sessions_completed: int = 0
    rss_before_mb: float = 0.0
    rss_warm_mb: float = 0.0
    warm_at_s: float = 0.0
    """When the RSS baseline was taken: ``--warmup`` or later, once every client had connected
    and the prefix index had filled to its bound."""
    rss_max_after_warm_mb: float = 0.0
    rss_end_mb: float = 0.0
    rss_growth: float = 0.0
    fds_before: int = 0
    fds_warm: int = 0
    fds_max_after_warm: int = 0
    fds_after_drain: int = 0
    overhead_p50_s: float | None = None
    overhead_p99_s: float | None = None
    overhead_count: int = 0
    ttfb_p50_s: float | None = None
    ttfb_p99_s: float | None = None
    drained: bool = False
    leftovers: dict[str, Any] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)
    heap_growth: list[str] = field(default_factory=list)
    """With ``tracemalloc_top``: traced Python memory at warm-up and at the end, then the top lines."""

    @property
    def passed(self) -> bool:
        return (self.rss_growth < RSS_GROWTH_LIMIT and self.drained and self.errors == 0
                and self.fds_after_drain <= self.fds_before + 16)


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


TCP_STATES = {"01": "established", "06": "time_wait", "08": "close_wait", "0A": "listen"}


def index_fill(state: Any) -> dict[str, int]:
    """Keys in the policy's prefix index and its bound, summed over engines (0/0 without one)."""
    index = getattr(state.runner.policy, "index", None)
    if index is None or not hasattr(index, "limits"):
        return {"index_keys": 0, "index_limit": 0}
    return {"index_keys": sum(index.sizes().values()), "index_limit": sum(index.limits().values())}


def socket_counts(router_port: int, engine_ports: set[int]) -> dict[str, int]:
    """This process's TCP sockets by side and state: ``client_*`` are connections accepted on
    the router's port, ``upstream_*`` are the router's connections to an engine."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    counts: dict[str, int] = {}
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            parts = line.split()
            if parts[9] not in inodes:
                continue
            local, remote = int(parts[1].split(":")[1], 16), int(parts[2].split(":")[1], 16)
            side = ("client" if local == router_port else "upstream" if remote in engine_ports
                    else "other")
            key = f"{side}_{TCP_STATES.get(parts[3], 'other')}"
            counts[key] = counts.get(key, 0) + 1
    return counts


def histogram_quantile(text: str, name: str, q: float) -> tuple[float | None, int]:
    """Upper bound of the bucket holding quantile ``q`` of a Prometheus histogram; and its count."""
    buckets: list[tuple[float, float]] = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name + "_bucket":
                buckets.append((float(s.labels["le"]), s.value))
    buckets.sort()
    if not buckets or buckets[-1][1] == 0:
        return None, 0
    total = buckets[-1][1]
    for le, cum in buckets:
        if cum >= q * total:
            return le, int(total)
    return float("inf"), int(total)


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def start_engine(i: int, cfg: SoakConfig) -> web.AppRunner:
    sim = SimEngineConfig(profile="tiny-cpu", served_model_name=MODEL, seed=i, time_scale=cfg.time_scale,
                          num_gpu_blocks=2048, max_num_seqs=512, max_num_batched_tokens=8192, engine_index=0)
    runner = web.AppRunner(create_sim_app(sim), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, backlog=SIM_LISTEN_BACKLOG).start()
    return runner


def engine_process(i: int, cfg: SoakConfig) -> tuple[str, subprocess.Popen[bytes]]:
    """One simulated engine in its own process, as in a deployment, so this process's RSS is
    the router's (and the clients'), not the engines' caches filling up."""
    port = free_port()
    cmd = [sys.executable, "-P", "-m", "misat_sim.server", "--profile", "tiny-cpu", "--port", str(port),
           "--served-model-name", MODEL, "--seed", str(i), "--time-scale", str(cfg.time_scale),
           "--num-gpu-blocks", "2048", "--max-num-seqs", "512", "--max-num-batched-tokens", "8192"]
    return f"http://127.0.0.1:{port}", start_process(cmd)


def port_of(runner: web.AppRunner) -> int:
    site = next(iter(runner.sites))
    return int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]


def router_config(urls: list[str]) -> RouterConfig:
    return RouterConfig.model_validate({
        "generation": 1, "model": MODEL, "engines": {"urls": urls},
        "workloads": {"classes": [{"name": "rlvr", "share": 40}, {"name": "rlhf", "share": 20},
                                  {"name": "agentic", "share": 40, "multi_turn": True}],
                      "default_class": None},
        "policy": {"name": "misa-t", "footprint": {"bootstrap_tokens": 512}},
        "hold_deadline_s": 120.0,
        # Engines, router and 1000 clients share one event loop here: a 0.4 s health timeout
        # would measure that loop's latency under load, not the engines' health.
        "health_timeout_s": 3.0, "unhealthy_after_failures": 3,
    })


class Clients:
    """``cfg.sessions`` rollout workers, each on its own keep-alive connection (as a worker with its
    own HTTP client would be): the router's client-side sockets are then the worker count from the
    first request on, and whatever else grows in the router is the router's doing."""

    def __init__(self, url: str, cfg: SoakConfig, report: SoakReport) -> None:
        self.url, self.cfg, self.report = url, cfg, report
        self.stop = asyncio.Event()
        self.ttfb: list[float] = []

    async def request(self, http: aiohttp.ClientSession, headers: dict[str, str], prompt: list[int]) -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": self.cfg.max_tokens, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        r = self.report
        r.requests += 1
        t0 = time.monotonic()
        try:
            async with http.post(self.url + "/v1/completions", json=body, headers=headers) as resp:
                first = await resp.content.readany()
                if len(self.ttfb) < 200_000:
                    self.ttfb.append(time.monotonic() - t0)
                data = first + await resp.read()
                if resp.status != 200:
                    self.error(f"status {resp.status}: {data[:120].decode(errors='replace')}")
                elif b"engine_stream_broken" in data:
                    r.broken_streams += 1
                elif not data.endswith(b"data: [DONE]\n\n"):
                    self.error("stream without [DONE]")
                else:
                    r.ok += 1
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.error(f"{type(exc).__name__}: {exc}"[:100])

    def error(self, kind: str) -> None:
        self.report.errors += 1
        key = kind if len(self.report.errors_by_kind) < 20 or kind in self.report.errors_by_kind else "other"
        self.report.errors_by_kind[key] = self.report.errors_by_kind.get(key, 0) + 1

    async def client(self, i: int) -> None:
        connector = aiohttp.TCPConnector(limit=1)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as http:
            await self.sessions(i, http)

    async def sessions(self, i: int, http: aiohttp.ClientSession) -> None:
        rnd = random.Random(self.cfg.seed * 1_000_003 + i)
        n = 0
        while not self.stop.is_set():
            n += 1
            prompt = [rnd.randrange(3, 2000) for _ in range(rnd.randrange(16, 64))]
            if rnd.random() < 0.4:
                sid = f"c{i}-s{n}"
                turns = rnd.randrange(2, 5)
                for t in range(turns):
                    headers = {"X-Rollout-Class": "agentic", "X-Session-Id": sid, "X-Session-Turn": str(t),
                               "X-Session-End": "true" if t == turns - 1 else "false"}
                    prompt = prompt + [rnd.randrange(3, 2000) for _ in range(8)]
                    await self.request(http, headers, prompt)
            else:
                await self.request(http, {"X-Rollout-Class": "rlvr" if rnd.random() < 0.67 else "rlhf"}, prompt)
            self.report.sessions_completed += 1


async def run_clients_only(url: str, cfg: SoakConfig) -> dict[str, Any]:
    """The client side alone (``--client-url``): load ``url`` for the duration, return the counts."""
    report = SoakReport(config=asdict(cfg))
    clients = Clients(url, cfg, report)
    tasks = [asyncio.create_task(clients.client(i)) for i in range(cfg.sessions)]
    await asyncio.sleep(cfg.duration_s)  # the load's duration, not a synchronisation
    clients.stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"requests": report.requests, "ok": report.ok, "errors": report.errors,
            "errors_by_kind": report.errors_by_kind, "broken_streams": report.broken_streams,
            "sessions_completed": report.sessions_completed,
            "ttfb_p50_s": quantile(clients.ttfb, 0.5), "ttfb_p99_s": quantile(clients.ttfb, 0.99)}


async def run_soak(cfg: SoakConfig, log: Any = print) -> SoakReport:
    report = SoakReport(config=asdict(cfg))
    if cfg.tracemalloc_top:
        tracemalloc.start()
    warm_snapshot: tracemalloc.Snapshot | None = None
    gc.collect()
    report.rss_before_mb, report.fds_before = rss_mb(), open_fds()
    if cfg.engine_processes:
        procs = [engine_process(i, cfg) for i in range(cfg.engines)]
        engines: list[web.AppRunner] = []
        urls = [u for u, _ in procs]
    else:
        procs = []
        engines = [await start_engine(i, cfg) for i in range(cfg.engines)]
        urls = [f"http://127.0.0.1:{port_of(e)}" for e in engines]
    app = create_app(router_config(urls), admin_token=None)
    router = await start_service(app, backlog=LISTEN_BACKLOG)
    url = router.url
    engine_ports = {int(u.rsplit(":", 1)[1]) for u in urls}
    state = app[STATE]
    await state.wait_until(lambda: state.registry.healthy_count() == cfg.engines, 30.0)

    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))  # for /metrics at the end
    clients = Clients(url, cfg, report)
    t0 = time.monotonic()
    child: subprocess.Popen[bytes] | None = None
    child_out = f"/tmp/misat-soak-clients-{os.getpid()}.json"
    if cfg.client_process:
        child = start_process(
            [sys.executable, "-P", "-m", "misat_bench.soak", "--client-url", url, "--sessions", str(cfg.sessions),
             "--duration", str(cfg.duration_s), "--max-tokens", str(cfg.max_tokens), "--json", child_out])
        tasks: list[asyncio.Task[None]] = []
    else:
        tasks = [asyncio.create_task(clients.client(i)) for i in range(cfg.sessions)]
    warm_taken = False
    try:
        while (elapsed := time.monotonic() - t0) < cfg.duration_s:
            await asyncio.sleep(min(cfg.sample_every_s, cfg.duration_s - elapsed))
            elapsed = time.monotonic() - t0
            sample: dict[str, Any] = {
                "t": round(elapsed, 1), "rss_mb": round(rss_mb(), 1), "fds": open_fds(),
                "requests": report.requests, "in_flight": len(state.dispatcher.in_flight),
                "held": state.runner.held_count(),
            } | socket_counts(router.port, engine_ports) | index_fill(state)
            report.samples.append(sample)
            log(json.dumps(sample))
            # Warm once the warm-up has passed, every worker has its connection (on a starved
            # machine the client process needs minutes to open 1,000) and the prefix index has
            # filled to its bound (a bounded cache filling is warm-up, not growth); at half the
            # run at the latest.
            connected = sample.get("client_established", 0) >= cfg.sessions
            index_full = sample["index_keys"] >= INDEX_FULL_FRACTION * sample["index_limit"]
            steady = connected and index_full
            if not warm_taken and elapsed >= cfg.warmup_s and (steady or elapsed >= cfg.duration_s / 2):
                gc.collect()
                if cfg.tracemalloc_top:
                    warm_snapshot = tracemalloc.take_snapshot()
                report.rss_warm_mb, report.fds_warm, warm_taken = rss_mb(), open_fds(), True
                report.warm_at_s = round(elapsed, 1)
            elif warm_taken:
                report.rss_max_after_warm_mb = max(report.rss_max_after_warm_mb, sample["rss_mb"])
                report.fds_max_after_warm = max(report.fds_max_after_warm, sample["fds"])
    finally:
        clients.stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        if child is not None:
            await asyncio.get_running_loop().run_in_executor(None, child.wait)
    if child is not None:
        with open(child_out) as f:
            counts = json.load(f)
        os.unlink(child_out)
        for key, value in counts.items():
            setattr(report, key, value)
    report.wall_s = time.monotonic() - t0
    gc.collect()
    report.rss_end_mb = rss_mb()
    if cfg.tracemalloc_top and warm_snapshot is not None:
        end_snapshot = tracemalloc.take_snapshot()
        report.heap_growth = [
            f"traced at warm-up {sum(st.size for st in warm_snapshot.statistics('filename')) / 1e6:.1f} MB, "
            f"at the end {sum(st.size for st in end_snapshot.statistics('filename')) / 1e6:.1f} MB"
        ] + [str(d) for d in end_snapshot.compare_to(warm_snapshot, "lineno")[: cfg.tracemalloc_top]]
    if warm_taken:
        report.rss_max_after_warm_mb = max(report.rss_max_after_warm_mb, report.rss_end_mb)
        report.rss_growth = report.rss_max_after_warm_mb / report.rss_warm_mb - 1.0

    # Drained: every count back to zero (multi-turn sessions all ended with their last turn).
    with contextlib.suppress(TimeoutError):
        await state.wait_until(lambda: not state.dispatcher.in_flight and state.runner.held_count() == 0, 30.0)
    pol = state.runner.policy
    report.leftovers = {
        "in_flight": len(state.dispatcher.in_flight), "held": state.runner.held_count(),
        "sessions": len(state.runner.sessions), "load_total": pol.load.total,
        "engine_sessions": sum(getattr(pol, "engine_sessions", {}).values()),
    }
    report.drained = not any(report.leftovers.values())
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    report.overhead_p50_s, report.overhead_count = histogram_quantile(text, "misat_proxy_overhead_seconds", 0.5)
    report.overhead_p99_s, _ = histogram_quantile(text, "misat_proxy_overhead_seconds", 0.99)
    if child is None:
        report.ttfb_p50_s, report.ttfb_p99_s = quantile(clients.ttfb, 0.5), quantile(clients.ttfb, 0.99)
    await http.close()
    await router.stop()
    for e in engines:
        await e.cleanup()
    stop_processes((proc for _, proc in procs), timeout_s=10.0)
    await asyncio.sleep(0)  # let closed transports release their sockets
    gc.collect()
    report.fds_after_drain = open_fds()
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=1000, help="concurrent client sessions (default 1000)")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    p.add_argument("--warmup", type=float, default=None, help="seconds before the RSS baseline (default 10%%)")
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--time-scale", type=float, default=20.0)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--in-process-engines", action="store_true",
                   help="run the engines in this process too (RSS then includes their caches)")
    p.add_argument("--in-process-clients", action="store_true",
                   help="run the clients in this process too (RSS then includes their connections)")
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop",
                   help="the router's event loop (default uvloop, as `misat router` uses when installed)")
    p.add_argument("--malloc-mmap-threshold", type=int, default=DEFAULT_MMAP_THRESHOLD_BYTES, metavar="BYTES",
                   help="as `misat router --malloc-mmap-threshold` (0: glibc's drifting default)")
    p.add_argument("--tracemalloc", type=int, default=0, metavar="N",
                   help="report the N source lines whose traced memory grew most after warm-up")
    p.add_argument("--client-url", help=argparse.SUPPRESS)  # internal: the client child process
    args = p.parse_args(argv)
    warmup = args.warmup if args.warmup is not None else max(5.0, args.duration * 0.1)
    cfg = SoakConfig(sessions=args.sessions, duration_s=args.duration, warmup_s=warmup, engines=args.engines,
                     time_scale=args.time_scale, max_tokens=args.max_tokens,
                     engine_processes=not args.in_process_engines,
                     client_process=not args.in_process_clients,
                     sample_every_s=min(5.0, max(1.0, args.duration / 60)), tracemalloc_top=args.tracemalloc,
                     loop=args.loop, mmap_threshold=args.malloc_mmap_threshold)
    if args.loop == "uvloop" or args.client_url:
        with contextlib.suppress(ImportError):
            import uvloop

            uvloop.install()
    if args.client_url:
        counts = asyncio.run(run_clients_only(args.client_url, cfg))
        with open(args.json, "w") as f:
            json.dump(counts, f)
        return 0
    pin_mmap_threshold(cfg.mmap_threshold)  # the router's process, as `misat router` does
    report = asyncio.run(run_soak(cfg, log=lambda s: print(s, file=sys.stderr)))
    out = asdict(report) | {"passed": report.passed}
    text = json.dumps(out, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    summary = {k: v for k, v in out.items() if k != "samples"}
    print(json.dumps(summary, indent=2))
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
