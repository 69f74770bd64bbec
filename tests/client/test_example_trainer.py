"""examples/trainer/grpo_agentic.py runs end to end for a few seconds on a local pool it starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "trainer" / "grpo_agentic.py"
RUN_TIMEOUT_S = 180.0
"""Bound of the whole run (engine start-up included); the rollouts themselves take 4 s."""


def test_the_example_trainer_completes_samples_and_weight_updates(tmp_path: Path) -> None:
    doc = yaml.safe_load((ROOT / "examples" / "mixed-pool.yaml").read_text())
    doc["spec"]["engines"]["replicas"] = 2
    manifest = tmp_path / "pool.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-P", str(EXAMPLE), "--manifest", str(manifest), "--time-scale", "200",
         "--duration", "4", "--update-interval", "1", "--grpo-workers", "2", "--agents", "2",
         "--max-tokens", "16", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report == json.loads(proc.stdout)
    assert report["errors"] == 0
    assert report["groups"] > 0 and report["samples"] == report["groups"] * 4  # --group-size 4
    assert report["trajectories"] > 0 and report["agent_turns"] >= report["trajectories"]
    assert report["weight_updates"] >= 2 and report["final_weight_version"] == str(report["weight_updates"])
