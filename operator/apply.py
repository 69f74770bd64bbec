"""Apply one desired object: create it, patch only what differs, or leave it alone.

The only effect is through ``KubeClient``; the decision (``diff.plan_patch``)
is pure. Two outcomes are the pool's problem rather than a retry's, and each
names the child:

- ``NameConflict``: an object of the child's name exists and this pool does
  not control it. It is never taken over (no silent adoption); the pool is
  Stalled until the foreign object goes, and every pass checks again.
- ``ChildRefused``: the API server refused the write (invalid, forbidden,
  over quota, too large: ``KubeError.refused``); the same write would be
  refused again, so the pool is Stalled and the generation backs off.

Races and load (404, 409, 429, 5xx, timeouts) stay ``KubeError`` and are
retried soon.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from .diff import plan_patch, with_last_applied
from .kube import KubeClient, KubeError


class Action(StrEnum):
    CREATED = "created"
    PATCHED = "patched"
    UNCHANGED = "unchanged"


class ChildProblem(Exception):
    """A child the pool cannot get into the desired state on its own; ``kind``/``name`` name it."""

    reason = ""

    def __init__(self, kind: str, name: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.name = name
        self.message = message


class NameConflict(ChildProblem):
    """A child's name is taken by an object this pool does not control."""

    reason = "NameConflict"


class ChildRefused(ChildProblem):
    """The API server refused to create or patch a child (its answer is the message)."""

    reason = "ChildRefused"


def controller_uid(obj: dict[str, Any]) -> str | None:
    for ref in obj.get("metadata", {}).get("ownerReferences") or ():
        if ref.get("controller"):
            return str(ref.get("uid"))
    return None


async def apply_object(kube: KubeClient, desired: dict[str, Any], owner_uid: str) -> Action:
    kind, meta = desired["kind"], desired["metadata"]
    body = with_last_applied(desired)
    try:
        current = await kube.get(desired["apiVersion"], kind, meta["namespace"], meta["name"])
        if current is None:
            await kube.create(body)
            return Action.CREATED
        if controller_uid(current) != owner_uid:
            owner = controller_uid(current)
            whose = f"controlled by uid {owner}" if owner else "not controlled by any object"
            raise NameConflict(
                kind, meta["name"],
                f"{kind} {meta['name']} already exists and is {whose}, not this RolloutPool: "
                "delete or rename it (it is never taken over)",
            )
        patch = plan_patch(body, current)
        if patch is None:
            return Action.UNCHANGED
        await kube.patch(desired["apiVersion"], kind, meta["namespace"], meta["name"], patch)
        return Action.PATCHED
    except KubeError as exc:
        if exc.refused:
            raise ChildRefused(
                kind, meta["name"], f"{kind} {meta['name']} refused by the API server: {exc}"
            ) from None
        raise
