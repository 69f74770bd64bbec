"""Desired vs current: the smallest JSON merge patch that makes a child object what we render.

Three-way, as ``kubectl apply`` does, so that both problems of a two-way
compare are avoided:

- fields the API server adds (defaults such as ``imagePullPolicy``,
  ``terminationMessagePath``, a Service's ``clusterIP``) are not "changes":
  desired is compared as a *subset* of current;
- fields the operator rendered before and no longer renders (a removed
  ``nodeSelector`` entry, a dropped env var inside a list) are removed: the
  previous desired state is kept in the ``misat.dev/last-applied`` annotation,
  and keys present there but gone from desired become ``null`` in the patch.

Lists are replaced whole (merge-patch semantics), which is right for lists the
operator owns (containers, args, volumes). Pure functions only.
"""

from __future__ import annotations

import json
from typing import Any

LAST_APPLIED = "misat.dev/last-applied"
_SAME = object()


def contains(current: Any, desired: Any) -> bool:
    """Whether ``current`` holds everything in ``desired`` (extra keys in dicts allowed)."""
    if isinstance(desired, dict):
        return isinstance(current, dict) and all(
            k in current and contains(current[k], v) for k, v in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(current, list)
            and len(current) == len(desired)
            and all(contains(c, d) for c, d in zip(current, desired, strict=True))
        )
    if isinstance(desired, bool) or isinstance(current, bool):
        return desired is current
    return bool(desired == current)


def _diff(desired: Any, current: Any, last: Any) -> Any:
    if isinstance(desired, dict) and isinstance(current, dict):
        prev = last if isinstance(last, dict) else {}
        patch: dict[str, Any] = {}
        for key, value in desired.items():
            if key not in current:
                patch[key] = value
                continue
            sub = _diff(value, current[key], prev.get(key))
            if sub is not _SAME:
                patch[key] = sub
        for key in prev:
            if key not in desired and key in current:
                patch[key] = None
        return patch or _SAME
    return _SAME if contains(current, desired) else desired


def with_last_applied(desired: dict[str, Any]) -> dict[str, Any]:
    """``desired`` plus the annotation recording it (the base of the next three-way diff)."""
    record = {k: v for k, v in desired.items() if k not in ("status",)}
    meta = dict(desired.get("metadata", {}))
    annotations = dict(meta.get("annotations", {}))
    stripped = json.loads(json.dumps(record))
    stripped.get("metadata", {}).get("annotations", {}).pop(LAST_APPLIED, None)
    annotations[LAST_APPLIED] = json.dumps(stripped, sort_keys=True, separators=(",", ":"))
    meta["annotations"] = annotations
    return {**desired, "metadata": meta}


def last_applied(current: dict[str, Any]) -> dict[str, Any]:
    raw = current.get("metadata", {}).get("annotations", {}).get(LAST_APPLIED)
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def plan_patch(desired: dict[str, Any], current: dict[str, Any]) -> dict[str, Any] | None:
    """The merge patch turning ``current`` into ``desired`` (None when nothing differs).

    ``desired`` must already carry its last-applied annotation (``with_last_applied``).
    Identity fields (name, namespace, apiVersion, kind) are never patched.
    """
    patch = _diff(_managed(desired), current, _managed(last_applied(current)))
    return None if patch is _SAME else patch


def _managed(obj: dict[str, Any]) -> dict[str, Any]:
    body = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "status")}
    body["metadata"] = {
        k: v for k, v in obj.get("metadata", {}).items() if k not in ("name", "namespace")
    }
    return body
