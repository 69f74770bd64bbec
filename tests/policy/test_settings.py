"""Settings: strict decoding with path-naming errors, and the generated reference in sync."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from misat_router.policy.settings import ClassSpec, PolicySettings, WorkloadMix
from misat_router.policy.settings_doc import render

DOCS = Path(__file__).resolve().parents[2] / "docs" / "settings.md"


def test_settings_reference_is_in_sync() -> None:
    assert DOCS.read_text() == render(), (
        "docs/settings.md is stale: python -m misat_router.policy.settings_doc > docs/settings.md"
    )


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        ({"name": "misa-x"}, "name"),
        ({"admission": {"confirm_epoch": 3}}, "admission.confirm_epoch"),
        ({"footprint": {"percentile": 0}}, "footprint.percentile"),
        ({"kv_budget_fraction": 1.5}, "kv_budget_fraction"),
    ],
    ids=["unknown-policy", "typo-in-nested-setting", "percentile-zero", "budget-above-one"],
)
def test_bad_policy_settings_name_the_path(payload: dict, needle: str) -> None:
    with pytest.raises(ValidationError) as err:
        PolicySettings.model_validate(payload)
    assert needle in str(err.value).replace("\n", ".").replace(" ", "") or needle.split(".")[-1] in str(err.value)


@pytest.mark.parametrize(
    ("classes", "message"),
    [
        ([{"name": "a", "share": 60}, {"name": "b", "share": 30}], "sum to 100"),
        ([{"name": "a", "share": 50}, {"name": "a", "share": 50}], "unique"),
        ([{"name": "a", "share": 100, "min_share": 0.6, "max_share": 0.5}], "above max_share"),
        ([{"name": "a", "share": 50, "min_share": 0.7}, {"name": "b", "share": 50, "min_share": 0.7}], "above 1"),
        ([{"name": "Bad Name", "share": 100}], "pattern"),
    ],
    ids=["shares-not-100", "duplicate-names", "min-above-max", "min-shares-above-1", "bad-name"],
)
def test_bad_mixtures_are_rejected(classes: list, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        WorkloadMix.model_validate({"classes": classes})


def test_default_class_must_exist() -> None:
    with pytest.raises(ValidationError, match="default_class"):
        WorkloadMix(classes=(ClassSpec(name="a", share=100),), default_class="b")


def test_settings_are_frozen() -> None:
    s = PolicySettings()
    with pytest.raises(ValidationError):
        s.kv_budget_fraction = 0.5  # type: ignore[misc]
