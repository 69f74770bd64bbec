"""``misat bench``: MISA-T against the vLLM Router's cache_aware, side by side, in one run.

Why: the project's headline (rollout throughput with the trainer's mixture
intact, without hand-tuning a concurrency limit) only means something next to
the baseline the paper used, on the same engines and the same seeded
workload. Two layers (``docs/benchmark.md``):

1. cluster: ``misat_sim.cluster`` in virtual time, every workload of the
   suite (``misat_bench.suite``), every baseline (oracle sweep,
   tuned-once, request-limit, high-load, balance thresholds) and this
   router's modes. Each run builds fresh engines.
2. http: the real ``vllm-router`` binary and this project's router service in
   front of simulated engines over HTTP, driven by the trainer emulator
   (``misat_bench.http_layer``); it validates the cluster layer.

Output under ``--out`` (default ``out/bench``): ``result.json``
(``BenchResult``), ``bench.png``, ``table.md``, and a per-run cache
(``cache/``) so an interrupted suite resumes.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from rich.console import Console

from misat_bench.cluster_runs import RunCache, RunRecord, dump_records, run_all
from misat_bench.report import BenchResult, markdown_table, plot, render_table, summarise
from misat_bench.suite import (
    QUICK,
    Baseline,
    BenchSettings,
    RunSpec,
    WorkloadName,
    fixed_runs,
    pick_oracle,
    refine_ceilings,
    run_priority,
    sweep_run,
    tuned_runs,
    workload_case,
)

DEFAULT_OUT = Path("out/bench")
"""Where results go unless ``--out`` says otherwise (``out/`` is git-ignored)."""

TABLE_WIDTH: int = 180
"""Console width when writing to a file (nohup logs): wide enough for one row a line."""

DEFAULT_JOBS: int = 2
"""Parallel cluster runs: this project's machine has 2 cores."""


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def build_parser() -> argparse.ArgumentParser:
    """The ``misat bench`` command line."""
    p = argparse.ArgumentParser(prog="misat bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small suite: 2 engines, short runs, steady + kv-half")
    p.add_argument("--workload", action="append", choices=[w.value for w in WorkloadName],
                   help="run only these workloads (repeatable)")
    p.add_argument("--layer", choices=["cluster", "http", "all"], default="all",
                   help="cluster: the in-process simulation; http: the real binary over HTTP (default all)")
    p.add_argument("--engines", type=int, help="engine replicas")
    p.add_argument("--profile", help="engine profile (misat_sim.profiles)")
    p.add_argument("--seed", type=int, help="workload seed (default: the suite's, 0)")
    p.add_argument("--duration", type=float, help="virtual seconds per continuous run")
    p.add_argument("--warmup", type=float, help="virtual seconds excluded from rates")
    p.add_argument("--ceilings", type=_ints, help="coarse trainer-ceiling grid, e.g. 64,128,256")
    p.add_argument("--refine", type=int, help="refinement rounds around the best ceiling")
    p.add_argument("--high", type=int, help="the high ceiling MISA-T and high-load run at")
    p.add_argument("--request-limits", type=_ints, help="router request limits swept on steady")
    p.add_argument("--iterations", type=int, help="iterations workload: weight updates")
    p.add_argument("--jobs", type=int, default=DEFAULT_JOBS, help=f"parallel cluster runs (default {DEFAULT_JOBS})")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"result directory (default {DEFAULT_OUT})")
    p.add_argument("--no-cache", action="store_true", help="ignore and do not write the per-run cache")
    p.add_argument("--no-plot", action="store_true", help="write no PNG plots")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: table, JSON and plot from the cached runs (a suite cut short)")
    from misat_bench.http_layer import add_http_arguments

    add_http_arguments(p)
    return p


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    """``BenchSettings`` from the defaults (or ``--quick``) plus explicit flags."""
    base = QUICK if args.quick else BenchSettings()
    update: dict[str, object] = {}
    for flag, field in [("engines", "engines"), ("profile", "profile"), ("seed", "seed"),
                        ("duration", "duration_s"), ("warmup", "warmup_s"), ("ceilings", "ceilings"),
                        ("refine", "refine_rounds"), ("high", "high_ceiling"), ("request_limits", "request_limits"),
                        ("iterations", "iterations")]:
        value = getattr(args, flag)
        if value is not None:
            update[field] = value
    if args.workload:
        update["workloads"] = tuple(WorkloadName(w) for w in dict.fromkeys(args.workload))
    return BenchSettings.model_validate({**base.model_dump(), **update})


def run_cluster_layer(s: BenchSettings, *, jobs: int, cache: RunCache, out: Path, console: Console,
                      cached_only: bool = False) -> tuple[list[RunRecord], dict[str, object]]:
    """All cluster runs, in stages: fixed runs, refinement, steady-tuned runs elsewhere."""
    done: list[RunRecord] = []

    def report(rec: RunRecord, cached: bool) -> None:
        m = rec.metrics
        console.print(f"  {rec.spec.workload.value:13s} {rec.spec.label:48s} {m.sample_rate_per_min:7.1f}/min "
                      f"hit {100 * m.prefix_hit_rate:5.1f}% TV {m.tv_points:5.2f} preempt {m.preemptions:6d} "
                      f"{'(cached)' if cached else f'cpu {rec.cpu_s:.0f}s'}", highlight=False)
        done.append(rec)
        dump_records(done, out / "runs.partial.json")

    all_specs: list[RunSpec] = []

    def stage(name: str, specs: list[RunSpec]) -> list[RunRecord]:
        console.print(f"[bold]cluster stage: {name}[/bold] ({len(specs)} runs)")
        all_specs.extend(specs)
        return run_all(specs, s, jobs=jobs, cache=cache, on_done=report, cached_only=cached_only)

    fixed = fixed_runs(s)
    # Steady in full and every workload's sweep + MISA-T first; the steady-tuned baselines next; the
    # ablations on the other workloads last: a suite cut short by CPU is still a whole comparison.
    records = stage("steady; every workload's sweep and MISA-T", [r for r in fixed if run_priority(r) <= 1])
    later = [r for r in fixed if run_priority(r) > 1]

    def sweep_points(w: WorkloadName) -> dict[int, float]:
        return {r.spec.ceiling: r.metrics.sample_rate_per_min for r in records
                if r.spec.workload is w and r.spec.baseline is Baseline.SWEEP}

    for round_no in range(s.refine_rounds):
        extra = [sweep_run(w, c) for w in s.workloads for c in refine_ceilings(sweep_points(w))]
        if not extra:
            break
        records += stage(f"refinement {round_no + 1}", extra)
    oracle = {w: pick_oracle(sweep_points(w)) for w in s.workloads if sweep_points(w)}
    limits = {r.spec.policy.concurrency_limit: r.metrics.sample_rate_per_min for r in records
              if r.spec.workload is WorkloadName.STEADY and r.spec.baseline is Baseline.REQUEST_LIMIT}
    steady_limit = pick_oracle({k: v for k, v in limits.items() if k is not None}) if limits else None
    records += stage("tuned on steady", tuned_runs(s, oracle, steady_limit, None))
    records += stage("ablations on the other workloads", sorted(later, key=run_priority))
    balance = {(r.spec.policy.cache_aware.balance_abs_threshold, r.spec.policy.cache_aware.balance_rel_threshold):
               r.metrics.sample_rate_per_min for r in records
               if r.spec.workload is WorkloadName.STEADY and r.spec.baseline is Baseline.BALANCE_SMALL}
    steady_balance = max(balance, key=lambda k: balance[k]) if balance else None
    if steady_balance is not None and len(s.workloads) > 1:
        records += stage("small-fleet balance elsewhere", [
            r for r in tuned_runs(s, oracle, steady_limit, steady_balance)
            if r.baseline is Baseline.BALANCE_SMALL and r.workload is not WorkloadName.STEADY])
    tuned: dict[str, object] = {
        "oracle_ceiling": {w.value: c for w, c in oracle.items()},
        "steady_request_limit": steady_limit,
        "steady_balance": list(steady_balance) if steady_balance else None,
    }
    # One record per key: the stages list some runs twice (a swept ceiling reused as tuned-once).
    unique = {(r.key, r.spec.baseline, r.spec.label): r for r in records}
    return list(unique.values()), tuned


def main(argv: list[str] | None = None) -> int:
    """Run the suite; prints the table, writes result.json, table.md and bench.png under --out."""
    args = build_parser().parse_args(argv)
    s = settings_from_args(args)
    console = Console(width=TABLE_WIDTH) if not sys.stdout.isatty() else Console()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    cache = RunCache(None if args.no_cache else out / "cache")
    started = time.monotonic()
    descriptions = {w.value: workload_case(w, s).description for w in s.workloads}
    result = BenchResult(command="misat bench " + shlex.join(sys.argv[1:] if argv is None else argv), settings=s)
    if args.layer in ("cluster", "all"):
        records, tuned = run_cluster_layer(s, jobs=args.jobs, cache=cache, out=out, console=console,
                                           cached_only=args.report_only)
        result.runs = records
        result.tuned = tuned
        result.workloads = summarise(records, s, descriptions)
        result.cpu_s_total = sum(r.cpu_s for r in records)
    http_rows = []
    if args.layer in ("http", "all"):
        from misat_bench.http_layer import run_http_layer

        http = run_http_layer(args, s, console)
        result.http = http.model_dump(mode="json")
        http_rows = http.rows
    (out / "result.json").write_text(result.model_dump_json(indent=1))
    console.print(render_table(result.workloads, http_rows))
    (out / "table.md").write_text(markdown_table(result.workloads) + "\n")
    if not args.no_plot and result.workloads:
        plot(result.workloads, out / "bench.png")
    console.print(f"wrote {out / 'result.json'} ({time.monotonic() - started:.0f} s wall)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
