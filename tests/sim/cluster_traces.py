"""Short seeded cluster runs whose results are pinned in ``golden/cluster_runs.json``.

The engine traces (``engine_traces.py``) pin one engine; these pin the whole
in-process path the benchmark measures: workload plans, the router's policy
(placement, admission, prefix index, radix tree), engines, trainer. Speed work
on any of them must leave every figure of these runs as it was.

Regenerate (only for an intended behaviour change, stated in the commit)::

    MISAT_UPDATE_GOLDEN=1 .venv/bin/pytest tests/sim/test_engine_equivalence.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from misat_router.policy.settings import FootprintSettings, PolicyName, PolicySettings, SessionAdmissionSettings
from misat_sim.cluster import ClusterConfig, run_cluster
from misat_sim.workload import WorkloadSpec

GOLDEN = Path(__file__).parent / "golden" / "cluster_runs.json"
DIGITS = 9
RECORDED_GUARD = SessionAdmissionSettings(healthy_hit_decay=0.98, degradation_cost_tolerance=0.0)
"""The hit guard the record was taken with (the default until 2026-12-04): the record checks the
engine model, so a change of the policy's defaults leaves it as it is."""
RECORDED_FOOTPRINT = FootprintSettings(statistic="peak", percentile=25.0)
"""The footprint the record was taken with (the default until 2026-12-05), for the same reason."""

RUNS: dict[str, ClusterConfig] = {
    f"{policy.value}@{ceiling}": ClusterConfig(
        engines=2, policy=PolicySettings(name=policy, admission=RECORDED_GUARD, footprint=RECORDED_FOOTPRINT),
        ceiling=ceiling,
        duration_s=60.0, warmup_s=10.0,
        workload=WorkloadSpec(seed=7),
    )
    for policy, ceiling in (
        (PolicyName.CACHE_AWARE, 48), (PolicyName.CACHE_AWARE, 256), (PolicyName.MISA_T, 256),
        (PolicyName.MISA, 256), (PolicyName.LEAST_LOADED, 64),
    )
}


def run(name: str) -> dict[str, Any]:
    r = run_cluster(RUNS[name])
    out = {}
    for k, v in r.as_dict().items():
        if isinstance(v, float):
            v = round(v, DIGITS)
        elif k == "series":
            v = [[round(t, DIGITS), n] for t, n in v]
        out[k] = v
    return out


def write_golden() -> None:
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps({name: run(name) for name in RUNS}, indent=1, sort_keys=True) + "\n")
