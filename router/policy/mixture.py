"""The consumed mixture of completed rollout units and its distance to the target."""

from __future__ import annotations

from collections.abc import Mapping


def tv_distance(p: Mapping[str, float], q: Mapping[str, float]) -> float:
    """Total-variation distance ``0.5 * sum |p_b - q_b|`` between two distributions (0..1)."""
    keys = set(p) | set(q)
    return 0.5 * sum(abs(p.get(k, 0.0) - q.get(k, 0.0)) for k in keys)


class MixtureTracker:
    """Counts completed units per class (a whole agentic trajectory is one unit)."""

    def __init__(self, target: Mapping[str, float]) -> None:
        total = sum(target.values())
        self.target = {k: v / total for k, v in target.items()} if total > 0 else dict(target)
        self.completed: dict[str, int] = dict.fromkeys(self.target, 0)

    def retarget(self, target: Mapping[str, float]) -> None:
        """A new target mixture (config reload); completed counts are kept."""
        total = sum(target.values())
        self.target = {k: v / total for k, v in target.items()} if total > 0 else dict(target)
        for k in self.target:
            self.completed.setdefault(k, 0)

    def record(self, workload_class: str, units: int = 1) -> None:
        """``units`` completed units of the class (a group of n samples is n units)."""
        self.completed[workload_class] = self.completed.get(workload_class, 0) + units

    @property
    def total(self) -> int:
        return sum(self.completed.values())

    def consumed(self) -> dict[str, float]:
        n = self.total
        if n == 0:
            return dict.fromkeys(self.completed, 0.0)
        return {k: v / n for k, v in self.completed.items()}

    def tv_points(self) -> float:
        """TV distance in percentage points (0 before anything completed)."""
        if self.total == 0:
            return 0.0
        return 100.0 * tv_distance(self.target, self.consumed())
