"""The router config builder of every suite.

One function, ``router_config``; each suite passes its own arguments (its policy, model
name, classes, probe and hold timings), usually bound once in its conftest with
``functools.partial``. Its defaults are the router suite's: round-robin, three classes,
fast probes and epochs, so that tests react in milliseconds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from misat_router.config import RouterConfig

MODEL = "tiny"
"""Served model name of the fake engines (``fake_engine.FakeEngine``'s default)."""

MIXED_CLASSES: tuple[Mapping[str, Any], ...] = (
    {"name": "rlvr", "share": 40},
    {"name": "rlhf", "share": 20},
    {"name": "agentic", "share": 40, "multi_turn": True},
)
"""Three classes, labels required (no default class)."""

FAST_EPOCH_S = 0.05
"""MISA-T's admission epoch in tests (the policy reacts within milliseconds)."""

FAST_PROBES: Mapping[str, Any] = {
    "scrape_interval_s": 0.05,
    "health_interval_s": 0.05,
    "health_timeout_s": 1.0,
    "unhealthy_after_failures": 1,
    "upstream_connect_timeout_s": 1.0,
    "hold_deadline_s": 5.0,
    "config_poll_interval_s": 0.05,
    "drain_timeout_s": 1.0,
}
"""``fast=True``: probes, config polls, holds and drains on a millisecond scale."""


def router_config(
    urls: Sequence[str],
    *,
    policy: str | None = "round-robin",
    policy_settings: Mapping[str, Any] | None = None,
    epoch_s: float | None = FAST_EPOCH_S,
    fast: bool = True,
    model: str = MODEL,
    classes: Sequence[Mapping[str, Any]] = MIXED_CLASSES,
    default_class: str | None = None,
    generation: int | None = 1,
    **overrides: Any,
) -> RouterConfig:
    """A validated ``RouterConfig`` in front of ``urls``.

    - ``policy``: the policy's name (None: the project default).
    - ``policy_settings``: more ``policy`` fields, set over ``{"name": policy, "admission":
      {"epoch_s": epoch_s}}`` one top-level key at a time (an ``admission`` given here replaces
      the epoch default whole).
    - ``epoch_s``: the admission epoch (None: the project default).
    - ``fast``: ``FAST_PROBES`` (False: the documented defaults).
    - ``generation``: None leaves the field out (a fresh router's 0).
    - ``overrides``: any other ``RouterConfig`` fields, set last.
    """
    policy_doc: dict[str, Any] = {}
    if policy is not None:
        policy_doc["name"] = policy
    if epoch_s is not None:
        policy_doc["admission"] = {"epoch_s": epoch_s}
    policy_doc.update(policy_settings or {})
    doc: dict[str, Any] = {
        "model": model,
        "engines": {"urls": list(urls)},
        "workloads": {"classes": [dict(c) for c in classes], "default_class": default_class},
    }
    if generation is not None:
        doc["generation"] = generation
    if policy_doc:
        doc["policy"] = policy_doc
    if fast:
        doc.update(FAST_PROBES)
    doc.update(overrides)
    return RouterConfig.model_validate(doc)
