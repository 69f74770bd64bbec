"""Values that flow through the policy: what a request is, what an engine looks
like from its metrics, and what the policy decided.

Everything here is immutable. Policies never read a clock: every hook takes
``now`` (seconds, any monotonic origin) from its caller, so the same policy
objects run in the live router and in the simulator's virtual time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum

from ..vllm_metrics import VllmMetrics


@dataclass(frozen=True, slots=True)
class RequestMeta:
    """One request as the policy sees it.

    ``session_id`` may be ``None`` for single-request classes: the request is
    then its own session and ``request_id`` stands in for the session id.
    ``prompt_token_ids`` and ``prompt_text`` are alternatives; with neither,
    the request gets no prefix affinity. ``prompt_tokens`` is the prompt
    length in tokens (exact for token-id prompts, an estimate for text).
    """

    request_id: str
    workload_class: str
    session_id: str | None = None
    turn: int = 0
    prompt_token_ids: tuple[int, ...] | None = None
    prompt_text: str | None = None
    prompt_tokens: int = 0
    max_tokens: int | None = None
    end_of_session: bool = False
    engine_hint: str | None = None
    """The engine the client says the session's previous turn ran on (``X-Session-Engine``: the
    ``X-Misat-Engine`` of its last answer). Only a continuation of a session this router does not
    know (it restarted, or the session came from another shard) is placed by it."""
    samples: int = 1
    """Sequences the engine runs for this request: the OpenAI ``n`` times the prompts of a
    batch. vLLM runs each as its own request (children sharing the prompt's cached blocks), so
    load, occupancy and completed units count it this many times."""

    session_key: str = field(init=False, repr=False, compare=False)
    """The id under which the policy tracks this request's session (computed once: the policy and the
    runner look it up several times per request)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "session_key",
                           self.session_id if self.session_id is not None else f"req:{self.request_id}")

    @property
    def single_request(self) -> bool:
        return self.session_id is None


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSnapshot(VllmMetrics):
    """An engine as its last ``/metrics`` scrape and health check showed it.

    The metric fields are ``VllmMetrics``'s (the vLLM metrics contract):
    counters (``prefix_*_total``, ``preemptions_total``) are cumulative, as
    vLLM exports them, and policies difference consecutive snapshots. Every
    field is a keyword: ``EngineSnapshot(engine_id="e0", kv_capacity_tokens=...)``.
    """

    engine_id: str
    healthy: bool = True
    scraped_at: float = 0.0

    @classmethod
    def from_metrics(
        cls, engine_id: str, metrics: VllmMetrics, *, healthy: bool, scraped_at: float
    ) -> EngineSnapshot:
        """The one way a reading becomes a snapshot (the router's registry and the cluster simulator)."""
        values = {f.name: getattr(metrics, f.name) for f in fields(VllmMetrics)}
        return cls(engine_id=engine_id, healthy=healthy, scraped_at=scraped_at, **values)

    @property
    def kv_used_tokens(self) -> float:
        return self.kv_usage * self.kv_capacity_tokens


class Action(StrEnum):
    PLACE = "place"
    HOLD = "hold"


class Reason(StrEnum):
    """Why a decision came out as it did; metrics count these labels."""

    CONTINUATION = "continuation"
    """The session already lives on this engine."""
    CONTINUATION_MOVED = "continuation_moved"
    """The session's engine is gone; the continuation was placed anew."""
    CONTINUATION_HINTED = "continuation_hinted"
    """A session this router does not know, placed on the engine its client named (its KV is there)."""
    NEW_SESSION = "new_session"
    """Admitted as a new session, placed by estimated cost."""
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    CACHE_HIT = "cache_hit"
    """cache_aware: best prefix match above the threshold."""
    CACHE_MISS = "cache_miss"
    """cache_aware: no match above the threshold; least-loaded engine."""
    IMBALANCE = "imbalance"
    """cache_aware: load imbalance overrides prefix affinity."""
    HOLD_NO_ENGINE = "no_healthy_engine"
    HOLD_SESSION_CAP = "session_cap"
    """Every engine is at its (possibly cut) new-session cap."""
    HOLD_KV_FULL = "kv_full"
    """Engines with room by the caps report their KV nearly full of running requests."""
    HOLD_CLASS_CAP = "class_cap"
    """Engines with session room have no room in this class's KV budget."""
    HOLD_CONCURRENCY_LIMIT = "concurrency_limit"
    """The static global concurrency limit is reached."""
    HOLD_PAUSED = "paused"
    """The router is paused (weight update)."""
    HOLD_QUEUED = "queued_behind"
    """Older held work of this class goes first."""


@dataclass(frozen=True, slots=True)
class Decision:
    """Place on ``engine_id``, or hold, with the reason and the scores that led there."""

    action: Action
    reason: Reason
    engine_id: str | None = None
    scores: Mapping[str, float] = field(default_factory=dict)

    @staticmethod
    def place(engine_id: str, reason: Reason, scores: Mapping[str, float] | None = None) -> Decision:
        return Decision(Action.PLACE, reason, engine_id, scores or {})

    @staticmethod
    def hold(reason: Reason, scores: Mapping[str, float] | None = None) -> Decision:
        return Decision(Action.HOLD, reason, None, scores or {})

    @property
    def placed(self) -> bool:
        return self.action is Action.PLACE


@dataclass(frozen=True, slots=True)
class Completion:
    """What the router learns when a request finishes on an engine."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None
    ok: bool = True
