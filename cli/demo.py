"""``misat demo`` (what ``make demo`` runs): a local RolloutPool under a mixed RL workload.

``misat up`` on ``examples/mixed-pool.yaml`` (simulated vLLM engines, the
MISA-T router), then the trainer emulator releasing agentic, RLVR and RLHF
rollouts through it for a bounded time, with live progress; then a report
table, a PNG plot and a JSON result under ``--out``. ``--compare`` runs the
same seeded workload through the vLLM Router's ``cache_aware`` policy at the
same trainer ceiling and prints the ratios.

Every run reports each simulated engine's keep-up (modelled time advanced /
wall time x time scale while busy, ``misat_sim.engine_loop``), and warns when
one is under 0.95: the engines then ran slower than modelled, so the figures
measure this machine's CPU as much as the policies.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from misat_router.memory import DEFAULT_MMAP_THRESHOLD_BYTES, pin_mmap_threshold
from misat_router.policy.settings import PolicyName
from misat_router.server import event_loop_factory
from misat_sim.engine_loop import KEEP_UP_WARN, keep_up_warning

from .localpool import LocalPool, PoolError, keep_up_figures, local_pool

DEFAULT_MANIFEST = Path("examples/mixed-pool.yaml")
REFRESH_S = 1.0
"""Progress display refresh period."""
LAG_PROBE_S = 0.1
"""Period of the event-loop lag probe of the router + trainer process."""
ROUTER_LAG_WARN_S = 0.05
"""Modelled seconds of mean router + trainer event-loop lag above which a run is warned about."""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="misat demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-f", "--filename", type=Path, default=DEFAULT_MANIFEST, help="RolloutPool manifest")
    ap.add_argument("--duration", type=float, default=120.0, help="wall seconds of trainer load per run")
    ap.add_argument("--time-scale", type=float, default=10.0,
                    help="simulated engines (and tool gaps) run this many times faster than real time")
    ap.add_argument("--ceiling", type=int, default=512, help="trainer's max rollout units in flight")
    ap.add_argument("--profile", default="qwen30b-a3b-h100", help="simulation profile of the engines")
    ap.add_argument("--seed", type=int, default=0, help="workload seed (same seed, same sessions)")
    ap.add_argument("--no-drain", dest="drain", action="store_false",
                    help="stop at --duration without finishing in-flight units (the consumed mixture then "
                    "leans to short classes: long agentic trajectories are cut off)")
    ap.add_argument("--compare", action="store_true", help="also run the cache_aware baseline")
    ap.add_argument("--out", type=Path, default=Path("out/demo"), help="report directory")
    return ap


def workload_spec(pool: LocalPool, seed: int) -> Any:
    from misat_sim.workload import RolloutClass, WorkloadSpec

    known = {c.value for c in RolloutClass}
    names = [w.name for w in pool.spec.workloads]
    unknown = sorted(set(names) - known)
    if unknown:
        raise PoolError(f"the demo's trainer emulates the classes {sorted(known)}; the manifest has {unknown}")
    mixture = {RolloutClass(w.name): w.share for w in pool.spec.workloads}
    return WorkloadSpec(seed=seed, mixture=mixture, session_prefix=f"demo{seed}")


def _min_keep_up(readings: list[dict[str, Any] | None], key: str) -> float | None:
    values = [v for v in keep_up_figures(readings, key).values() if v is not None]
    return min(values) if values else None


def progress_view(policy: str, report: Any, status: dict[str, Any] | None, duration: float,
                  keep_up: list[dict[str, Any] | None] | None = None) -> Group:
    head = Table.grid(padding=(0, 2))
    hit = f"{100 * report.prefix_hit_rate:.1f}%" if report.prefix_hit_rate is not None else "-"
    tv = f"{report.mixture_tv_points:.2f} pts" if report.mixture_tv_points is not None else "-"
    k = _min_keep_up(keep_up or [], "recent")
    ku = "-" if k is None else (f"[bold]{k:.3f}[/]" if k >= KEEP_UP_WARN else f"[bold red]{k:.3f}[/]")
    head.add_row(f"[bold]{policy}[/]", f"{report.elapsed_s:5.0f}/{duration:.0f} s",
                 f"samples/min [bold]{report.sample_rate_per_min:7.1f}[/]", f"prefix hit [bold]{hit}[/]",
                 f"mixture TV [bold]{tv}[/]", f"held {status.get('held_requests', 0) if status else '-'}",
                 f"errors {report.errors}", f"keep-up {ku}")
    table = Table(expand=False)
    for col in ("class", "units done", "consumed %", "target %", "active sessions", "held", "KV used (tokens)"):
        table.add_column(col, justify="left" if col == "class" else "right")
    classes = {c["name"]: c for c in (status or {}).get("classes", [])}
    for cls, fig in report.per_class.items():
        c = classes.get(cls.value, {})
        used = c.get("kv_used_tokens")
        table.add_row(cls.value, str(fig.units), f"{report.consumed_mixture_pct.get(cls, 0.0):.1f}",
                      f"{report.target_mixture_pct.get(cls, 0.0):.1f}", str(c.get("active_sessions", "-")),
                      str(c.get("held_requests", "-")), f"{used:,.0f}" if isinstance(used, int | float) else "-")
    return Group(head, table)


async def run_once(args: argparse.Namespace, console: Console, policy: PolicyName | None) -> dict[str, Any]:
    from misat_sim.trainer import Trainer, TrainerConfig

    label = policy.value if policy else "pool policy"
    async with local_pool(args.filename, profile=args.profile, time_scale=args.time_scale, port=0,
                          policy=policy, log_dir=args.out / "logs" / label) as pool:
        label = pool.config.policy.name.value
        console.print(f"[bold]{label}[/]: router {pool.router_url}, {len(pool.engine_urls)} simulated engines "
                      f"({args.profile}, x{args.time_scale:g} speed), trainer ceiling {args.ceiling} units")
        trainer = Trainer(TrainerConfig(base_url=pool.router_url, model=pool.spec.model.served,
                                        max_in_flight=args.ceiling, duration_s=args.duration,
                                        drain=args.drain, time_scale=args.time_scale),
                          workload_spec(pool, args.seed))
        task = asyncio.create_task(trainer.run())
        lag = LoopLag()
        probe = asyncio.create_task(lag.run())
        status: dict[str, Any] | None = None
        keep_up: list[dict[str, Any] | None] = []
        with Live(console=console, refresh_per_second=2, transient=False) as live:
            while not task.done():
                with contextlib.suppress(Exception):
                    status = await pool.status()
                with contextlib.suppress(Exception):
                    keep_up = await pool.engine_keep_up()
                live.update(progress_view(label, trainer.snapshot(), status, args.duration, keep_up))
                await asyncio.wait({task}, timeout=REFRESH_S)
            report = task.result()
            probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await probe
            with contextlib.suppress(Exception):
                status = await pool.status()
            with contextlib.suppress(Exception):
                keep_up = await pool.engine_keep_up()
            live.update(progress_view(label, report, status, args.duration, keep_up))
    warning = keep_up_line(label, keep_up)
    if warning:
        console.print(f"[bold red]warning:[/] {warning}")
    loop_lag = lag.summary()
    lag_warning = loop_lag_line(label, loop_lag, args.time_scale)
    if loop_lag:
        console.print(f"{label}: router + trainer event-loop lag mean {loop_lag['mean_ms']:.1f} ms, "
                      f"p99 {loop_lag['p99_ms']:.1f} ms", highlight=False)
    if lag_warning:
        console.print(f"[bold red]warning:[/] {lag_warning}")
    return {"policy": label, "trainer": report.model_dump(mode="json"), "router_status": status,
            "keep_up": keep_up, "keep_up_warning": warning, "router_loop_lag": loop_lag,
            "router_loop_lag_warning": lag_warning}


def loop_lag_line(label: str, loop_lag: dict[str, float] | None, time_scale: float) -> str | None:
    """A warning when the router + trainer process's mean event-loop lag, in modelled time, exceeds
    ``ROUTER_LAG_WARN_S`` (the engines' delivery slice: what they guarantee to clients)."""
    if loop_lag is None:
        return None
    modelled = loop_lag["mean_ms"] / 1000 * time_scale
    if modelled <= ROUTER_LAG_WARN_S:
        return None
    return (f"{label}: the router + trainer process lagged {loop_lag['mean_ms']:.0f} ms on average "
            f"({modelled:.2f} modelled s at x{time_scale:g}): it, not the engines, was short of CPU, so the "
            "figures measure this machine; lower --time-scale")


class LoopLag:
    """How late this process's event loop runs a timer: the router and the trainer share it here, so
    lag means they, not the engines, are short of CPU (a deployed router has its own cores)."""

    def __init__(self) -> None:
        self.samples: list[float] = []

    async def run(self) -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(LAG_PROBE_S)  # the probe's period, not a synchronisation
            self.samples.append(max(0.0, time.monotonic() - t - LAG_PROBE_S))

    def summary(self) -> dict[str, float] | None:
        """Mean and 99th percentile lag in milliseconds; None before any sample."""
        if not self.samples:
            return None
        ordered = sorted(self.samples)
        return {"mean_ms": 1000 * sum(ordered) / len(ordered),
                "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]}


def keep_up_line(label: str, readings: list[dict[str, Any] | None]) -> str | None:
    """The run's keep-up warning (any engine under 0.95 over the run while busy), or None."""
    line = keep_up_warning(keep_up_figures(readings, "run"))
    return f"{label}: {line}" if line else None


def summary_table(results: list[dict[str, Any]]) -> Table:
    table = Table(title="misat demo: rollout throughput with the mixture intact")
    for col in ("policy", "samples/min", "requests/min", "decode tok/s", "prefix hit %", "mixture TV pts",
                "units done", "errors", "keep-up per engine"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in results:
        t = r["trainer"]
        hit = t["prefix_hit_rate"]
        tv = t["mixture_tv_points"]
        table.add_row(r["policy"], f"{t['sample_rate_per_min']:.1f}", f"{t['requests_per_min']:.0f}",
                      f"{t['decode_tokens_per_s']:.0f}", f"{100 * hit:.1f}" if hit is not None else "-",
                      f"{tv:.2f}" if tv is not None else "-", str(t["units_completed"]), str(t["errors"]),
                      keep_up_cell(r.get("keep_up") or []))
    return table


def keep_up_cell(readings: list[dict[str, Any] | None]) -> str:
    """Each engine's keep-up over the run, e.g. ``0.994 0.981 0.990 1.000``; red under 0.95."""
    cells = []
    for v in keep_up_figures(readings, "run").values():
        if v is None:
            cells.append("-")
        else:
            cells.append(f"{v:.3f}" if v >= KEEP_UP_WARN else f"[red]{v:.3f}[/]")
    return " ".join(cells) or "-"


def plot(results: list[dict[str, Any]], path: Path) -> bool:
    """Throughput over time and mixture against target; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        # Cumulative completions: per-second buckets of long rollouts are too spiky to read.
        pts = r["trainer"]["throughput_series"]
        total, cumulative = 0, []
        for p in pts:
            total += p["units"]
            cumulative.append(total)
        ax1.plot([p["t_s"] for p in pts], cumulative, label=r["policy"])
    ax1.set_xlabel("wall time (s)")
    ax1.set_ylabel("completed rollout units (cumulative)")
    ax1.set_title("Rollout throughput (slope = sample rate)")
    ax1.legend()
    classes = list(results[0]["trainer"]["target_mixture_pct"])
    width = 0.8 / (len(results) + 1)
    xs = range(len(classes))
    ax2.bar([x - 0.4 + width / 2 for x in xs], [results[0]["trainer"]["target_mixture_pct"][c] for c in classes],
            width, label="target", color="lightgray")
    for i, r in enumerate(results, start=1):
        ax2.bar([x - 0.4 + width / 2 + i * width for x in xs],
                [r["trainer"]["consumed_mixture_pct"].get(c, 0.0) for c in classes], width, label=r["policy"])
    ax2.set_xticks(list(xs), classes)
    ax2.set_ylabel("% of completed units")
    ax2.set_title("Mixture: consumed vs target")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


async def demo(args: argparse.Namespace, console: Console) -> list[dict[str, Any]]:
    args.out.mkdir(parents=True, exist_ok=True)
    results = [await run_once(args, console, None)]
    if args.compare:
        results.append(await run_once(args, console, PolicyName.CACHE_AWARE))
    return results


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Wide enough for the report table when output is a pipe or a log (rich assumes 80 there).
    console = Console() if sys.stdout.isatty() else Console(width=120)
    pin_mmap_threshold(DEFAULT_MMAP_THRESHOLD_BYTES)  # as `misat router` does
    try:
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:  # the router's loop, as deployed
            results = runner.run(demo(args, console))
    except PoolError as exc:
        console.print(f"[bold red]misat demo:[/] {exc}")
        return 1
    except KeyboardInterrupt:
        console.print("interrupted")
        return 130
    console.print(summary_table(results))
    for r in results:
        for key in ("keep_up_warning", "router_loop_lag_warning"):
            if r.get(key):
                console.print(f"[bold red]warning:[/] {r[key]}")
    if len(results) == 2:
        a, b = (r["trainer"] for r in results)
        if b["sample_rate_per_min"] > 0:
            console.print(f"MISA-T / cache_aware sample rate at the same trainer ceiling ({args.ceiling}): "
                          f"[bold]{a['sample_rate_per_min'] / b['sample_rate_per_min']:.2f}x[/]")
    result_path = args.out / "result.json"
    result_path.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": results},
                                      indent=2))
    png = args.out / "demo.png"
    plotted = plot(results, png)
    console.print(f"JSON result: {result_path}" + (f"; plot: {png}" if plotted else " (matplotlib missing: no plot)"))
    failed = sum(r["trainer"]["errors"] for r in results)
    if failed:
        console.print(f"[bold red]{failed} request(s) failed[/]; see {args.out}/logs")
        return 1
    return 0
