"""The bounded soak (``misat_bench.soak``) as a test: ``pytest -m slow tests/reliability/test_soak.py``.

``MISAT_SOAK_S`` (default 600) sets the duration and ``MISAT_SOAK_SESSIONS`` (default 1000)
the concurrent streaming sessions; warm-up is 10 % of the duration (at least 30 s when
the run allows) and lasts until every worker is connected and the prefix index is full.
Passing means: RSS after warm-up grew less than 10 %, file descriptors came back to their
pre-load count, no request failed, and every count drained to zero.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from misat_bench import soak


@pytest.mark.slow
def test_soak(tmp_path: Path) -> None:
    # The documented command, run as is: its own process, the router on uvloop as
    # `misat router` runs it (pytest's loop would be the stdlib one).
    duration = float(os.environ.get("MISAT_SOAK_S", "600"))
    out = tmp_path / "soak.json"
    cmd = [sys.executable, "-P", "-m", "misat_bench.soak", "--sessions", os.environ.get("MISAT_SOAK_SESSIONS", "1000"),
           "--duration", str(duration), "--warmup", str(min(max(30.0, duration * 0.1), duration / 2)),
           "--json", str(out)]
    subprocess.run(cmd, check=False, timeout=duration * 3 + 300)
    report = json.loads(out.read_text())
    summary = {k: v for k, v in report.items() if k != "samples"}
    print(json.dumps(summary, indent=2))
    assert report["config"]["loop"] == "uvloop"
    assert report["requests"] > 0 and report["errors"] == 0, summary
    assert report["drained"], report["leftovers"]
    assert report["rss_growth"] < soak.RSS_GROWTH_LIMIT, summary
    assert report["fds_after_drain"] <= report["fds_before"] + 16, summary
    assert report["overhead_p99_s"] is not None


async def test_soak_script_runs_and_drains() -> None:
    """A seconds-long soak in one process: the script works and its accounting drains (not its figures)."""
    cfg = soak.SoakConfig(sessions=20, duration_s=4.0, warmup_s=1.0, engines=2, sample_every_s=1.0,
                          engine_processes=False, client_process=False)
    report = await soak.run_soak(cfg, log=lambda _: None)
    summary = {k: v for k, v in vars(report).items() if k != "samples"}
    assert report.ok > 0 and report.errors == 0, summary
    assert report.drained, report.leftovers
    # Every worker held its own connection to the router while the load ran.
    assert max(s.get("client_established", 0) for s in report.samples) == cfg.sessions, report.samples
    assert report.fds_after_drain <= report.fds_before + 16, summary
