"""``misat bench``: this router's policies against the vLLM Router's cache_aware, cell by cell, over seeds.

Why: the project's headline (rollout throughput with the trainer's mixture
intact, without hand-tuning a concurrency limit) only means something next to
the baseline the paper used, on the same engines and the same seeded
workload, in steady state, with intervals over seeds. Two layers
(``docs/benchmark.md``):

1. cluster (the default): ``misat_sim.cluster`` in virtual time, every cell
   of the matrix (``misat_bench.suite``: a family of target mixtures on
   steady, the paper's mixture on the changing workloads, 4 and 16 engines),
   every baseline (oracle sweep refined to steps of 8, tuned-once,
   request-limit, high-load, small-fleet balance) and the policies under test.
2. http (``--layer http`` or ``all``): the real ``vllm-router`` binary and this
   project's router service over HTTP (``misat_bench.http_layer``); it
   validates the cluster layer.

Runs are cached by config digest under ``--out``/cache, so the matrix can be
run in pieces (``--cells``, ``--policies``) and merged: a later invocation
reuses every cached run. Output: ``result.json`` (``BenchResult``),
``table.md``, ``plots/<cell>.png``.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError
from rich.console import Console

from misat_bench.cluster_runs import RunCache, RunRecord, dump_records, run_all
from misat_bench.goals import evaluate_goals, render_goals
from misat_bench.report import BenchResult, markdown_table, plot_cell, render_table, summarise
from misat_bench.steady_state import measured_steady
from misat_bench.suite import (
    DEFAULT_POLICY,
    MIXTURE_FAMILY,
    POLICY_VARIANTS,
    QUICK,
    BenchSettings,
    Cell,
    Plan,
    RunSpec,
    default_variant,
    parse_cells,
    plan_suite,
)

DEFAULT_OUT = Path("out/bench")
"""Where results go unless ``--out`` says otherwise (``out/`` is git-ignored)."""

TABLE_WIDTH: int = 240
"""Console width when writing to a file (nohup logs): wide enough for one row a line."""

DEFAULT_JOBS: int = 2
"""Parallel cluster runs: this project's machine has 2 cores."""

MAX_STAGES: int = 64
"""The planner is asked again after every stage; it converges in a handful (the refinement's rounds
plus the tuned stage). A bound, so a planner bug cannot loop forever."""


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _names(text: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))


def build_parser() -> argparse.ArgumentParser:
    """The ``misat bench`` command line."""
    p = argparse.ArgumentParser(prog="misat bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="minutes-long subset: 2 engines, 2 seeds, steady on 2 mixtures, mix-shift, iterations")
    p.add_argument("--cells", help="only these cells, e.g. steady@paper,steady@rlvr70:4 (workload@mixture[:engines]; "
                   "their reference cell steady@paper:<engines> comes along for the tuned values)")
    p.add_argument("--policies", type=_names, help=f"policies under test (known: {', '.join(POLICY_VARIANTS)})")
    p.add_argument("--seeds", type=_ints, help="replicate seeds, e.g. 0,1,2")
    p.add_argument("--mixtures", type=_names, help=f"steady cells' mixtures (known: {', '.join(MIXTURE_FAMILY)})")
    p.add_argument("--layer", choices=["cluster", "http", "all"], default="cluster",
                   help="cluster: the in-process simulation (default); http: the real binary over HTTP")
    p.add_argument("--engines", type=int, help="engines of every cell but the large-fleet ones")
    p.add_argument("--large-fleet", type=_ints, help="large-fleet engine counts for steady (empty: none), e.g. 16")
    p.add_argument("--large-fleet-mixtures", type=_names,
                   help="steady cells' mixtures on the large fleets (default: paper), e.g. paper,rlvr70")
    p.add_argument("--profile", help="engine profile (misat_sim.profiles)")
    p.add_argument("--max-duration", type=float, help="cap on a run's virtual seconds")
    p.add_argument("--jobs", type=int, default=DEFAULT_JOBS, help=f"parallel cluster runs (default {DEFAULT_JOBS})")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"result directory (default {DEFAULT_OUT})")
    p.add_argument("--no-cache", action="store_true", help="ignore and do not write the per-run cache")
    p.add_argument("--no-plot", action="store_true", help="write no PNG plots")
    p.add_argument("--plan", action="store_true",
                   help="run nothing: list the runs the next stage would make and how many are cached")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: table, JSON and plots from the cached runs (a suite cut short or run in pieces)")
    from misat_bench.http_layer import add_http_arguments

    add_http_arguments(p)
    return p


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    """``BenchSettings`` from the defaults (or ``--quick``) plus explicit flags."""
    base = QUICK if args.quick else BenchSettings()
    update: dict[str, object] = {}
    for flag, name in [("engines", "engines"), ("profile", "profile"), ("seeds", "seeds"), ("policies", "policies"),
                       ("mixtures", "mixtures"), ("large_fleet", "large_fleet_engines"),
                       ("large_fleet_mixtures", "large_fleet_mixtures")]:
        value = getattr(args, flag)
        if value is not None:
            update[name] = value
    data = {**base.model_dump(), **update}
    if args.max_duration is not None:
        data["steady_state"] = {**data["steady_state"], "max_duration_s": args.max_duration}
    return BenchSettings.model_validate(data)


class KeyMemo:
    """``RunSpec.key`` is a digest of the whole cluster config: computed once per spec."""

    def __init__(self, s: BenchSettings) -> None:
        self.s = s
        self._memo: dict[str, str] = {}

    def __call__(self, spec: RunSpec) -> str:
        text = spec.model_dump_json()
        key = self._memo.get(text)
        if key is None:
            key = self._memo[text] = spec.key(self.s)
        return key


def run_stages(s: BenchSettings, cells: list[Cell], policies: tuple[str, ...] | None,
               runner: Callable[[list[RunSpec]], list[RunRecord]], known: dict[str, RunRecord],
               on_stage: Callable[[int, int], None] | None = None) -> Plan:
    """Ask the planner, run what it names that is not known, repeat until it names nothing new.

    ``runner`` returns the records it could make (a cache-only runner may return fewer); the loop
    also stops when a stage adds nothing.
    """
    key = KeyMemo(s)

    def rate(spec: RunSpec) -> float | None:
        rec = known.get(key(spec))
        return None if rec is None else rec.metrics.mixture_rate_per_min

    plan = plan_suite(s, rate, cells, policies)
    for stage in range(MAX_STAGES):
        missing = list({key(sp): sp for sp in plan.runs if key(sp) not in known}.values())
        if not missing:
            break
        if on_stage:
            on_stage(stage, len(missing))
        added = 0
        for rec in runner(missing):
            if rec.key not in known:
                added += 1
            known[rec.key] = rec
        if not added:
            break
        plan = plan_suite(s, rate, cells, policies)
    return plan


def machine_description() -> str:
    """The machine a result was produced on (for the doc)."""
    return f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, " \
           f"Python {platform.python_version()}"


def main(argv: list[str] | None = None) -> int:
    """Run the suite; prints the table and goals, writes result.json, table.md and plots under --out."""
    args = build_parser().parse_args(argv)
    console = Console(width=TABLE_WIDTH) if not sys.stdout.isatty() else Console()
    try:
        s = settings_from_args(args)
        cells = parse_cells(args.cells, s) if args.cells else s.cells()
    except ValidationError as exc:
        why = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
        console.print(f"[red]misat bench: {why}[/red]", highlight=False)
        return 2
    except ValueError as exc:
        console.print(f"[red]misat bench: {exc}[/red]", highlight=False)
        return 2
    policies = args.policies
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    cache = RunCache(None if args.no_cache else out / "cache")
    started = time.monotonic()
    result = BenchResult(command="misat bench " + shlex.join(sys.argv[1:] if argv is None else argv), settings=s,
                         machine=machine_description())
    if args.layer in ("cluster", "all"):
        known: dict[str, RunRecord] = {}
        done: list[RunRecord] = []

        def report(rec: RunRecord, cached: bool) -> None:
            m, sp = rec.metrics, rec.spec
            flag = "" if measured_steady(m.converged, m.warmup_ok) else " NOT CONVERGED"
            console.print(f"  {sp.cell(s).id:22s} s{sp.seed_of(s)} {sp.label:44s} {m.mixture_rate_per_min:7.1f} "
                          f"mix/min {m.sample_rate_per_min:7.1f}/min hit {100 * m.prefix_hit_rate:5.1f}% "
                          f"(ideal {100 * m.ideal_prefix_hit_rate:5.1f}%) TV {m.tv_points:5.2f} "
                          f"warm-up {m.window_start_s:5.0f}s measured {m.measured_s:5.0f}s"
                          f"{flag} {'(cached)' if cached else f'cpu {rec.cpu_s:.0f}s'}", highlight=False)
            done.append(rec)
            dump_records(done, out / "runs.partial.json")

        if args.plan:
            key = KeyMemo(s)

            def cached(specs: list[RunSpec]) -> list[RunRecord]:
                return run_all(specs, s, jobs=1, cache=cache, cached_only=True)

            plan = run_stages(s, cells, policies, cached, known)
            todo = list({key(sp): sp for sp in plan.runs if key(sp) not in known}.values())
            console.print(f"cells: {', '.join(c.id for c in cells)}")
            console.print(f"cached runs usable: {len(known)}; next stage: {len(todo)} runs")
            for sp in todo:
                console.print(f"  {sp.cell(s).id:22s} s{sp.seed_of(s)} {sp.label}", highlight=False)
            return 0

        def runner(specs: list[RunSpec]) -> list[RunRecord]:
            return run_all(specs, s, jobs=args.jobs, cache=cache, on_done=report, cached_only=args.report_only)

        def on_stage(i: int, n: int) -> None:
            console.print(f"[bold]cluster stage {i + 1}[/bold] ({n} runs{', cache only' if args.report_only else ''})")

        plan = run_stages(s, cells, policies, runner, known, on_stage)
        key = KeyMemo(s)
        used = {key(sp) for sp in plan.runs}
        result.runs = [known[k] for k in sorted(used) if k in known]
        result.tuned = plan.tuned
        summaries = summarise(plan.runs, known, s, cells, plan.tuned)
        empty = [c.cell for c in summaries if not c.rows]
        if empty:
            console.print(f"[yellow]no runs yet for {', '.join(empty)} (left out of the result)[/yellow]")
        result.cells = [c for c in summaries if c.rows]
        # The goals are the default policy's, under whichever name this invocation ran it.
        result.goals = evaluate_goals(result.cells, default_variant(policies or s.policies) or DEFAULT_POLICY)
        result.cpu_s_total = sum(r.cpu_s for r in result.runs)
    http_rows = []
    if args.layer in ("http", "all"):
        from misat_bench.http_layer import run_http_layer

        http = run_http_layer(args, s, console)
        result.http = http.model_dump(mode="json")
        http_rows = http.rows
    (out / "result.json").write_text(result.model_dump_json(indent=1))
    console.print(render_table(result.cells, http_rows))
    if result.goals:
        console.print(render_goals(result.goals), highlight=False)
    (out / "table.md").write_text(markdown_table(result.cells, result.goals) + "\n")
    if not args.no_plot:
        for cs in result.cells:
            plot_cell(cs, out / "plots" / f"{cs.cell.replace('@', '_').replace(':', '_')}.png")
    console.print(f"wrote {out / 'result.json'} ({len(result.runs)} runs, {result.cpu_s_total:.0f} CPU-s in runs, "
                  f"{time.monotonic() - started:.0f} s wall)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
