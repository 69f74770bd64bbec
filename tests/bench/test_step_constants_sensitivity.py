"""The step-constant variants: each replaces exactly what it names, and the KV one moves the ceilings with it."""

from __future__ import annotations

import pytest

from misat_bench.step_constants_sensitivity import (
    CEILING_STEP,
    REFERENCE_KV_TOKENS_AT_1_16,
    VARIANTS,
    profile_name,
    variant_settings,
)
from misat_bench.suite import BenchSettings
from misat_sim.config import SimEngineConfig
from misat_sim.profiles import PROFILES, QWEN30B_A3B_H100


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


@pytest.mark.parametrize(("variant", "times"), [("prefill-x4", 4), ("prefill-x8", 8)])
def test_prefill_variants_change_the_prefill_price_alone(variant: str, times: int) -> None:
    profile, base = PROFILES[profile_name(variant)], QWEN30B_A3B_H100
    assert profile.step_time.prefill_s_per_token == pytest.approx(times * base.step_time.prefill_s_per_token)
    assert profile.step_time.model_copy(update={"prefill_s_per_token": base.step_time.prefill_s_per_token}) \
        == base.step_time
    assert profile.kv_capacity_tokens == base.kv_capacity_tokens
    assert variant_settings(variant).ceilings(4) == BenchSettings().ceilings(4)
