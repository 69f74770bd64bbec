"""Apply one desired object: create it, patch only what differs, or leave it alone.

The only effect is through ``KubeClient``; the decision (``diff.plan_patch``)
is pure. An object of the same name that the pool does not control is never
taken over: that is a permanent error for the pool, not a silent adoption.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from .diff import plan_patch, with_last_applied
from .kube import KubeClient


class Action(StrEnum):
    CREATED = "created"
    PATCHED = "patched"
    UNCHANGED = "unchanged"


class NotOwned(Exception):
    """A child's name is taken by an object this pool does not control."""


def controller_uid(obj: dict[str, Any]) -> str | None:
    for ref in obj.get("metadata", {}).get("ownerReferences") or ():
        if ref.get("controller"):
            return str(ref.get("uid"))
    return None


async def apply_object(kube: KubeClient, desired: dict[str, Any], owner_uid: str) -> Action:
    meta = desired["metadata"]
    body = with_last_applied(desired)
    current = await kube.get(desired["apiVersion"], desired["kind"], meta["namespace"], meta["name"])
    if current is None:
        await kube.create(body)
        return Action.CREATED
    if controller_uid(current) != owner_uid:
        raise NotOwned(f"{desired['kind']} {meta['name']} exists and is not controlled by this RolloutPool")
    patch = plan_patch(body, current)
    if patch is None:
        return Action.UNCHANGED
    await kube.patch(desired["apiVersion"], desired["kind"], meta["namespace"], meta["name"], patch)
    return Action.PATCHED
