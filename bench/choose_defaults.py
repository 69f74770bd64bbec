"""Measure the policy defaults that the paper leaves open (not a test).

Runs the in-process cluster (``misat_sim.cluster``: simulated engines, the
real policy objects, a trainer at a concurrency ceiling) on the paper's
steady mixture and prints, side by side:

- the vLLM Router ``cache_aware`` policy at a sweep of trainer ceilings (the
  tuned baseline is the best of these);
- MISA-T and session-admission at a high ceiling, with the footprint
  estimator at several settings (statistic and percentile).

``python -P -m misat_bench.choose_defaults --json out/defaults.json``; docs/policy.md
records the figures and the default chosen from them.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from misat_router.policy.settings import FootprintSettings, PolicyName, PolicySettings
from misat_sim.cluster import ClusterConfig, run_cluster
from misat_sim.workload import WorkloadSpec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--duration", type=float, default=1200.0, help="virtual seconds per run")
    ap.add_argument("--warmup", type=float, default=300.0)
    ap.add_argument("--ceilings", default="48,96,144,192,288", help="cache_aware trainer ceilings")
    ap.add_argument("--high", type=int, default=1024, help="the ceiling MISA-T runs at")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--footprints", default="peak:50,peak:90,mean:50",
                    help="MISA-T footprint estimators to run, statistic:percentile,...")
    ap.add_argument("--no-session-admission", action="store_true", help="skip the session-admission run")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    runs: list[tuple[str, PolicySettings, int]] = []
    for c in (int(x) for x in args.ceilings.split(",") if x):
        runs.append((f"cache-aware @{c}", PolicySettings(name=PolicyName.CACHE_AWARE), c))
    variants = [(f.split(":")[0], float(f.split(":")[1])) for f in args.footprints.split(",") if f]
    for stat, pct in variants:
        fp = FootprintSettings(statistic=stat, percentile=pct)
        runs.append((f"misa-t {stat} p{pct:g} @{args.high}", PolicySettings(name=PolicyName.MISA_T, footprint=fp),
                     args.high))
    if not args.no_session_admission:
        runs.append((f"session-admission @{args.high}", PolicySettings(name=PolicyName.SESSION_ADMISSION),
                     args.high))
    results = []
    print(f"{'run':34s} {'units/min':>9s} {'hit %':>6s} {'KV %':>5s} {'TV pts':>6s} {'preempt':>7s} "
          f"{'cpu s':>6s}", flush=True)
    for label, policy, ceiling in runs:
        t0 = time.process_time()
        r = run_cluster(ClusterConfig(engines=args.engines, policy=policy, ceiling=ceiling,
                                      duration_s=args.duration, warmup_s=args.warmup,
                                      workload=WorkloadSpec(seed=args.seed)))
        cpu = time.process_time() - t0
        print(f"{label:34s} {r.sample_rate_per_min:9.1f} {100 * r.prefix_hit_rate:6.1f} "
              f"{100 * r.mean_kv_usage:5.1f} {r.tv_points:6.2f} {r.preemptions:7d} {cpu:6.0f}", flush=True)
        results.append({"run": label, **{k: v for k, v in r.as_dict().items() if k != "series"}})
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
