"""`misat demo` end to end: three rows on live simulated engines, the tuning cache, the report files."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from misat_bench.demo import DemoSettings, main, tune, tuning_key
from misat_cli.localpool import load_manifest
from tests.support.manifests import one_engine_manifest


def test_demo_runs_three_rows_side_by_side_and_writes_its_report(tmp_path: Path) -> None:
    out = tmp_path / "out"
    code = main(["-f", str(one_engine_manifest(tmp_path)), "--duration", "200", "--warmup", "50",
                 "--time-scale", "25", "--engines", "1", "--high-ceiling", "48", "--out", str(out)])
    assert code == 0
    result = json.loads((out / "result.json").read_text())
    roles = [r["spec"]["role"] for r in result["rows"]]
    assert roles == ["untuned", "tuned", "high"]
    untuned, tuned, high = result["rows"]
    # Names match what ran: the manifest's policy, the tuned ceiling the sweep picked.
    assert untuned["spec"]["policy"] == "misa-t" and "misa-t" in untuned["spec"]["label"]
    sweep = json.loads((out / "tuning.json").read_text())
    (entry,) = sweep.values()
    assert tuned["spec"]["ceiling"] == entry["ceiling"] and high["spec"]["ceiling"] == 48
    for row in result["rows"]:
        (r,) = row["runs"]
        assert r["errors"] == 0 and r["units_per_min"] > 0 and len(r["keep_up"]) == 1
        assert r["series"] and r["series"][-1]["t_s"] > 10
    assert result["ratios"]["tuned"]["interval"]["mean"] == 1.0
    assert result["verdict"] and "baseline" in result
    assert (out / "demo.png").stat().st_size > 0


def test_a_tuning_sweep_is_cached_by_what_it_depends_on(tmp_path: Path) -> None:
    manifest = one_engine_manifest(tmp_path)
    s = DemoSettings(manifest=manifest, engines=1, duration_s=30.0, warmup_s=10.0, tune_ceilings=(16, 64),
                     tune_step=24, out=tmp_path)
    _, spec = load_manifest(manifest)
    console = Console(record=True)
    first = tune(s, spec, console)
    assert first.source.startswith("swept now") and {16, 64} <= set(first.sweep)
    assert first.ceiling == max(first.sweep, key=lambda c: (first.sweep[c], -c))
    again = tune(s, spec, console)
    assert again.source.startswith("read from the cached sweep") and again.ceiling == first.ceiling
    # Another fleet or window is another key: the cached sweep is not reused for it.
    assert tuning_key(s.model_copy(update={"duration_s": 60.0}), spec) != tuning_key(s, spec)
    assert tune(s.model_copy(update={"retune": True}), spec, console).source.startswith("swept now")
