"""`misat demo` end to end: three rows on live simulated engines, the tuning cache, the report files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from misat_bench.demo import (
    CACHED_SWEEPS,
    QUICK,
    DemoSettings,
    engine_config,
    load_pool,
    main,
    row_specs,
    tune,
    tuning_key,
)
from misat_cli.localpool import load_manifest
from tests.support.manifests import one_engine_manifest


def test_demo_runs_its_rows_side_by_side_and_writes_its_report(tmp_path: Path) -> None:
    """With ``--kv-factor``: engines with half the KV, their own tuned ceiling, and the tuned-once row."""
    out = tmp_path / "out"
    manifest = one_engine_manifest(tmp_path)
    code = main(["-f", str(manifest), "--duration", "200", "--warmup", "50", "--time-scale", "25",
                 "--engines", "1", "--high-ceiling", "48", "--kv-factor", "0.5", "--out", str(out)])
    assert code == 0
    result = json.loads((out / "result.json").read_text())
    roles = [r["spec"]["role"] for r in result["rows"]]
    assert roles == ["untuned", "tuned", "high", "tuned-once"]
    untuned, tuned, high, once = result["rows"]
    # Names match what ran: the manifest's policy, the tuned ceilings the sweeps picked.
    assert untuned["spec"]["policy"] == "session-admission" and "session-admission" in untuned["spec"]["label"]
    s = DemoSettings(manifest=manifest, engines=1, duration_s=200.0, warmup_s=50.0, out=out)
    _, spec = load_manifest(manifest)
    sweeps = json.loads((out / "tuning.json").read_text())
    half, full = sweeps[tuning_key(s.model_copy(update={"kv_factor": 0.5}), spec)], sweeps[tuning_key(s, spec)]
    assert tuned["spec"]["ceiling"] == half["ceiling"] and once["spec"]["ceiling"] == full["ceiling"]
    assert high["spec"]["ceiling"] == 48
    # The engines ran with half the profile's KV blocks (this router's /status reports what they export).
    limits = engine_config(spec, s.profile).resolve()
    (engine,) = untuned["runs"][0]["router_status"]["engines"]
    assert engine["kv_capacity_tokens"] == round(limits.num_gpu_blocks * 0.5) * limits.block_size
    for row in result["rows"]:
        (r,) = row["runs"]
        assert r["errors"] == 0 and r["units_per_min"] > 0 and len(r["keep_up"]) == 1
        assert r["series"] and r["series"][-1]["t_s"] > 10 and r["converged"] is not None
    assert result["ratios"]["tuned"]["interval"]["mean"] == 1.0 and "untuned/tuned-once" in result["ratios"]
    assert result["verdict"] and "baseline" in result
    assert (out / "demo.png").stat().st_size > 0


def test_the_tuned_once_row_comes_only_with_its_ceiling() -> None:
    s = DemoSettings()
    assert [r.role for r in row_specs(s, "misa-t", 96, binary=True)] == ["untuned", "tuned", "high"]
    rows = row_specs(s, "misa-t", 48, binary=True, tuned_once=96)
    assert [(r.role, r.ceiling) for r in rows] == [("untuned", 512), ("tuned", 48), ("high", 512), ("tuned-once", 96)]


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
    # Filed under its key alone: re-keying the file (docs/demo.md) leaves no stale copy inside.
    saved = json.loads((tmp_path / "tuning.json").read_text())
    assert list(saved) == [tuning_key(s, spec)] and "key" not in saved[tuning_key(s, spec)]
    assert again.key == tuning_key(s, spec)
    # Another fleet or window is another key: the cached sweep is not reused for it.
    assert tuning_key(s.model_copy(update={"duration_s": 60.0}), spec) != tuning_key(s, spec)
    assert tune(s.model_copy(update={"retune": True}), spec, console).source.startswith("swept now")


def test_a_kv_factor_scales_the_engines_blocks_and_keys_its_own_sweep(tmp_path: Path) -> None:
    from misat_cli.localpool import PoolError

    manifest = one_engine_manifest(tmp_path)
    _, spec = load_manifest(manifest)
    profile = DemoSettings().profile
    full = engine_config(spec, profile).resolve().num_gpu_blocks
    assert engine_config(spec, profile, 0.5).resolve().num_gpu_blocks == round(full * 0.5)
    assert engine_config(spec, profile, 2.0).resolve().num_gpu_blocks == round(full * 2.0)
    s = DemoSettings(manifest=manifest, engines=1, out=tmp_path)
    assert tuning_key(s.model_copy(update={"kv_factor": 0.5}), spec) != tuning_key(s, spec)
    # A KV that cannot hold one sequence of the model's length is refused, naming the flag.
    with pytest.raises(PoolError, match=r"--kv-factor 0\.0001"):
        engine_config(spec, profile, 0.0001)


def test_the_shipped_sweeps_match_the_default_and_quick_demo_as_the_code_stands() -> None:
    """``make demo`` and ``--quick`` read their tuned ceiling from the shipped sweeps. The key
    digests the simulator's and the policies' source, so an edit there leaves them unread (the
    demo sweeps again, every run) until the file is re-keyed or re-swept (docs/demo.md)."""
    shipped = json.loads(CACHED_SWEEPS.read_text())
    for s in (DemoSettings(), DemoSettings.model_validate(QUICK)):
        key = tuning_key(s, load_pool(s)[1])
        assert key in shipped, f"no shipped sweep for key {key} (settings {s.model_dump(mode='json')})"
        assert "key" not in shipped[key], "an entry is filed under its key alone (it would go stale on re-keying)"
