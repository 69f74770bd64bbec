"""The rollout labels a request carries to the router: workload class, session, turn, end, engine.

Dependency-free (standard library only), so any HTTP client can use it. The names are the
router's (``docs/router.md``, "Rollout metadata"); ``tests/client`` checks them against
``misat_router.request_meta`` so the two cannot drift apart.

A label travels either as headers (``RolloutLabels.headers()``) or, for a client that cannot
set headers, as a top-level ``"rollout"`` object in the JSON body (``RolloutLabels.body()``),
which the router removes before forwarding to vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

HEADER_CLASS = "X-Rollout-Class"
HEADER_SESSION_ID = "X-Session-Id"
HEADER_TURN = "X-Session-Turn"
HEADER_END = "X-Session-End"
HEADER_ENGINE = "X-Session-Engine"
ANSWER_ENGINE_HEADER = "X-Misat-Engine"
"""The router's answer names the engine that served it; a session sends it back as HEADER_ENGINE."""
BODY_ROLLOUT_FIELD = "rollout"
SESSION_END_PATH = "/v1/sessions/{session_id}/end"
"""Where a live multi-turn session is ended explicitly (200 when it was live, 404 when not)."""


@dataclass(frozen=True, slots=True)
class RolloutLabels:
    """What the router needs to know about one request.

    - ``rollout_class``: one of the router's ``workloads.classes`` (None: the router's
      ``default_class``, or a 400 when it has none);
    - ``session_id``: keeps a multi-turn trajectory (or a GRPO group) together;
    - ``turn``: the turn number, >= 0 (the router treats an unknown session with turn > 0 as a
      continuation);
    - ``end``: the session ends when this request completes;
    - ``engine``: the engine that served the session's previous turn (its answer's
      ``X-Misat-Engine``). A router that does not know the session (it restarted, or the
      session came from another shard) places the turn there, where its KV is.
    """

    rollout_class: str | None = None
    session_id: str | None = None
    turn: int | None = None
    end: bool = False
    engine: str | None = None

    def __post_init__(self) -> None:
        if self.turn is not None and (isinstance(self.turn, bool) or self.turn < 0):
            raise ValueError(f"turn must be an integer >= 0, got {self.turn!r}")
        if self.session_id is not None and not self.session_id.strip():
            raise ValueError("session_id must not be empty")
        if self.rollout_class is not None and not self.rollout_class.strip():
            raise ValueError("rollout_class must not be empty")
        if self.engine is not None and not self.engine:
            raise ValueError("engine must not be empty")

    def with_turn(self, turn: int, *, end: bool = False, engine: str | None = None) -> RolloutLabels:
        """The same labels for turn ``turn`` (whose previous turn ran on ``engine``, if known)."""
        return replace(self, turn=turn, end=end, engine=engine)

    def headers(self) -> dict[str, str]:
        """The labels as HTTP headers (only the fields that are set)."""
        out: dict[str, str] = {}
        if self.rollout_class is not None:
            out[HEADER_CLASS] = self.rollout_class
        if self.session_id is not None:
            out[HEADER_SESSION_ID] = self.session_id
        if self.turn is not None:
            out[HEADER_TURN] = str(self.turn)
        if self.end:
            out[HEADER_END] = "true"
        if self.engine is not None:
            out[HEADER_ENGINE] = self.engine
        return out

    def body(self) -> dict[str, Any]:
        """The labels as the body's ``"rollout"`` object (only the fields that are set)."""
        out: dict[str, Any] = {}
        if self.rollout_class is not None:
            out["class"] = self.rollout_class
        if self.session_id is not None:
            out["session_id"] = self.session_id
        if self.turn is not None:
            out["turn"] = self.turn
        if self.end:
            out["end"] = True
        if self.engine is not None:
            out["engine"] = self.engine
        return out

    def add_to_body(self, payload: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``payload`` with the labels as its ``"rollout"`` object."""
        return {**payload, BODY_ROLLOUT_FIELD: self.body()}


def session_end_path(session_id: str) -> str:
    """The path that ends ``session_id`` (percent-encoded, so any id is one path segment)."""
    from urllib.parse import quote

    return SESSION_END_PATH.format(session_id=quote(session_id, safe=""))
