"""The one interface every policy implements, and the load book they share.

A policy answers ``decide()`` without changing anything, so a decision can be
replayed, compared across policies and benchmarked. What it learns arrives
through explicit hooks that the runner (``PolicyRunner``) calls:

- ``on_placed``: a request was sent to an engine (insert its prefix, count it);
- ``on_finished``: the engine answered (or failed) that request;
- ``on_hold`` / ``on_unhold``: a request entered or left the HOLD ledger;
- ``on_session_end``: a session ended (explicitly, idle, or its one request done);
- ``on_metrics``: a fresh scrape of the engines;
- ``on_epoch``: periodic housekeeping (LRU sweeps, estimator refresh);
- ``on_engine_removed``: an engine left the pool; drop what it held.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping

from .settings import PolicyName, PolicySettings, WorkloadMix
from .types import Completion, Decision, EngineSnapshot, RequestMeta

Engines = Mapping[str, EngineSnapshot]


def healthy_ids(engines: Engines) -> list[str]:
    """Healthy engines in a stable order (sorted ids), so ties break the same way every run."""
    return sorted(e for e, snap in engines.items() if snap.healthy)


class LoadBook:
    """Sequences the router has in flight per engine (its own count, as the vLLM Router keeps).

    A request with ``samples`` > 1 (``n``, a batch) counts that many: the engine reports each
    of its sequences in ``num_requests_running``, and the two counts are compared."""

    __slots__ = ("_in_flight", "_total")

    def __init__(self) -> None:
        self._in_flight: dict[str, int] = {}
        self._total = 0

    def add(self, engine_id: str, count: int = 1) -> None:
        self._in_flight[engine_id] = self._in_flight.get(engine_id, 0) + count
        self._total += count

    def remove(self, engine_id: str, count: int = 1) -> None:
        n = self._in_flight.get(engine_id, 0)
        if n <= 0:
            return
        count = min(count, n)
        self._in_flight[engine_id] = n - count
        self._total -= count

    def drop_engine(self, engine_id: str) -> None:
        self._total -= self._in_flight.pop(engine_id, 0)

    def get(self, engine_id: str) -> int:
        return self._in_flight.get(engine_id, 0)

    def in_flight_map(self) -> Mapping[str, int]:
        """Read-only view for hot loops (``.get(engine, 0)``)."""
        return self._in_flight

    @property
    def total(self) -> int:
        return self._total

    def items(self) -> Iterable[tuple[str, int]]:
        return self._in_flight.items()


class Policy(ABC):
    """A routing policy: pure ``decide`` plus learning hooks."""

    name: PolicyName

    def __init__(self, settings: PolicySettings, mix: WorkloadMix) -> None:
        self.settings = settings
        self.mix = mix
        self.load = LoadBook()

    @abstractmethod
    def decide(self, req: RequestMeta, engines: Engines, now: float) -> Decision:
        """Place ``req`` on an engine or hold it. Must not change any state."""

    def on_placed(self, req: RequestMeta, engine_id: str, now: float) -> None:
        self.load.add(engine_id, req.samples)

    def on_finished(
        self, req: RequestMeta, engine_id: str, completion: Completion, now: float
    ) -> None:
        self.load.remove(engine_id, req.samples)

    def on_hold(self, req: RequestMeta, now: float) -> None:  # noqa: B027
        """``req`` entered the HOLD ledger (it counts as demand of its class)."""

    def on_unhold(self, req: RequestMeta, now: float) -> None:  # noqa: B027
        """``req`` left the ledger: about to be placed, or cancelled by its caller."""

    def on_prefix_cache_reset(self, now: float) -> None:  # noqa: B027
        """Every engine's prefix cache was reset (weight update): hit rates restart from zero."""

    def on_engine_restarted(self, engine_id: str, now: float) -> None:  # noqa: B027
        """One engine's process started again: its prefix cache is empty."""

    def on_session_end(self, session_key: str, now: float) -> None:  # noqa: B027
        """A multi-turn session ended. Policies without sessions ignore it."""

    def on_metrics(self, engines: Engines, now: float) -> None:  # noqa: B027
        """A fresh scrape arrived."""

    def on_epoch(self, now: float) -> None:  # noqa: B027
        """Periodic housekeeping; called every admission epoch."""

    def flush_deferred(self) -> None:  # noqa: B027
        """Do now the bookkeeping a placement put off (the prefix index's inserts). Never needed
        for correctness: whatever reads that state does it first. The router calls it once the
        placed request is on its way, so the work overlaps the engine's."""

    def release_rank(self, workload_class: str) -> float | None:
        """Where held new sessions of ``workload_class`` stand in the release order: lower goes
        first. None (the default): arrival order, for every class."""
        return None

    def hold_order(self, req: RequestMeta) -> tuple[int, float] | None:
        """For a held new session about to be decided again: a key such that, within one release
        pass, a hold of one held new session implies the same hold (the same reason) of every
        later one whose key is at least as large in both places. A pass only places work, so
        the policy must hold it whenever what frees room (a finish, a scrape, a session's end)
        cannot happen in between. None (the default): no such promise, decide every one."""
        return None

    def on_engine_removed(self, engine_id: str, now: float) -> None:
        self.load.drop_engine(engine_id)

    def set_mix(self, mix: WorkloadMix) -> None:
        """A new workload mixture (hot reload); what the policy learned is kept."""
        self.mix = mix

    def set_settings(self, settings: PolicySettings) -> bool:
        """Take new knobs in place (hot reload), keeping what was learned.

        Returns False when the change needs a different policy object (another
        policy name); the runner then builds one and hands it the live state.
        """
        if settings.name is not self.settings.name:
            return False
        self.settings = settings
        return True

    def adopt_session(  # noqa: B027
        self, session_key: str, workload_class: str, engine_id: str, admitted_at: float, now: float
    ) -> None:
        """A session that lives on ``engine_id`` from before this policy object existed."""

    def describe(self) -> dict[str, object]:
        """State worth showing in ``/status`` (JSON-serialisable)."""
        return {"policy": self.name.value, "in_flight": dict(self.load.items())}
