"""Render the policy settings reference (``docs/settings.md``) from the models.

``python -m misat_router.policy.settings_doc > docs/settings.md``; a test
fails when the committed file differs, so the documented defaults are always
the ones the code uses.
"""

from __future__ import annotations

from pydantic import BaseModel

from .settings import ClassSpec, PolicySettings, WorkloadMix


def _rows(model: type[BaseModel], prefix: str) -> list[str]:
    rows: list[str] = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows.extend(_rows(annotation, f"{path}."))
            continue
        default = "(required)" if field.is_required() else repr(field.get_default(call_default_factory=True))
        if hasattr(field.get_default(), "value"):
            default = repr(field.get_default().value)
        doc = (field.description or "").replace("\n", " ").replace("|", "\\|")
        rows.append(f"| `{path}` | `{default}` | {doc} |")
    return rows


def render() -> str:
    header = "| setting | default | meaning |\n|---|---|---|"
    parts = [
        "# Policy settings reference",
        "",
        "Generated from `router/policy/settings.py` by `python -m misat_router.policy.settings_doc`;",
        "a test keeps this file in sync. \"Project default\" marks constants the MISA-T paper",
        "does not give; `docs/policy.md` says how they were chosen.",
        "",
        "## `policy` (PolicySettings)",
        "",
        header,
        *_rows(PolicySettings, ""),
        "",
        "## `workloads` (WorkloadMix)",
        "",
        header,
        *_rows(WorkloadMix, ""),
        "",
        "## `workloads.classes[]` (ClassSpec)",
        "",
        header,
        *_rows(ClassSpec, ""),
        "",
    ]
    return "\n".join(parts)


if __name__ == "__main__":
    print(render(), end="")
