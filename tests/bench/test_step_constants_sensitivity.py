"""The step-constant variants: each replaces exactly what it names, and the KV one moves the ceilings with it."""

from __future__ import annotations

import pytest

from misat_bench.step_constants_sensitivity import (
    CEILING_STEP,
    REFERENCE_KV_TOKENS_AT_1_16,
    VARIANTS,
    plan,
    profile_name,
    summarise,
    variant_settings,
)
from misat_bench.suite import Baseline, BenchSettings
from misat_sim.config import SimEngineConfig
from misat_sim.profiles import PROFILES, QWEN30B_A3B_H100
from tests.support.run_records import run_record


def _tokens(variant: str) -> int:
    """KV tokens an engine of the variant's profile holds at the benchmark's block size and length scale."""
    s = variant_settings(variant)
    engine = SimEngineConfig(profile=s.profile, block_size=s.block_size).resolve()
    return engine.num_gpu_blocks * engine.block_size


def test_reference_kv_gives_each_engine_the_reference_models_million_tokens_at_1_16() -> None:
    assert _tokens("reference-kv") == pytest.approx(REFERENCE_KV_TOKENS_AT_1_16, rel=1e-3)
    assert _tokens("profile") == pytest.approx(REFERENCE_KV_TOKENS_AT_1_16 / VARIANTS["reference-kv"].kv_factor,
                                               rel=1e-3)


def test_reference_kv_scales_the_ceiling_grid_and_the_high_ceiling_in_steps_of_8() -> None:
    base, scaled = BenchSettings(), variant_settings("reference-kv")
    factor = VARIANTS["reference-kv"].kv_factor
    assert scaled.high(4) == pytest.approx(base.high(4) * factor, abs=4 * CEILING_STEP)
    for b, c in zip(base.ceilings_per_engine, scaled.ceilings_per_engine, strict=True):
        assert c % CEILING_STEP == 0 and c == pytest.approx(b * factor, abs=CEILING_STEP)
    # The run cap with them, in whole windows: a unit's residency grows with the ceiling.
    cap, window = scaled.steady_state.max_duration_s, scaled.steady_state.window_s
    assert cap % window == 0 and cap == pytest.approx(base.steady_state.max_duration_s * factor, abs=window)
    assert variant_settings("prefill-x8").steady_state == base.steady_state


@pytest.mark.parametrize(("variant", "times"), [("prefill-x4", 4), ("prefill-x8", 8)])
def test_prefill_variants_change_the_prefill_price_alone(variant: str, times: int) -> None:
    profile, base = PROFILES[profile_name(variant)], QWEN30B_A3B_H100
    assert profile.step_time.prefill_s_per_token == pytest.approx(times * base.step_time.prefill_s_per_token)
    assert profile.step_time.model_copy(update={"prefill_s_per_token": base.step_time.prefill_s_per_token}) \
        == base.step_time
    assert profile.kv_capacity_tokens == base.kv_capacity_tokens
    assert variant_settings(variant).ceilings(4) == BenchSettings().ceilings(4)


def test_the_summary_names_every_run_whose_window_never_reached_steady_state() -> None:
    """A run stopped by the cap before its warm-up rule was met measured a transient: the
    summary says so beside its figure and in its head line, and says nothing when all converged."""
    s = variant_settings("profile").model_copy(update={"seeds": (0,)})
    runs = plan(s)
    steady = [run_record(r, s, 100.0 + (r.ceiling or 0) / 100) for r in runs]
    assert "NOT CONVERGED" not in summarise("profile", s, steady)
    # The default's run alone stopped at the cap.
    unsteady = [run_record(r, s, 90.0, steady=False) if r.baseline is Baseline.POLICY else rec
                for r, rec in zip(runs, steady, strict=True)]
    text = summarise("profile", s, unsteady)
    head, seed_line = text.splitlines()
    assert f"NOT CONVERGED: 1 of {len(runs)} runs" in head
    assert seed_line.endswith("NOT CONVERGED") and seed_line.count("NOT CONVERGED") == 1
