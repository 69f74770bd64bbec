"""Observable behaviour on the pinned traces is unchanged: one engine (``engine_traces.py``)
and short cluster runs with the router's policies (``cluster_traces.py``).

A failure here means a change altered what clients or the router see, not just
the engine's cost. If that is intended, regenerate the golden file
(``MISAT_UPDATE_GOLDEN=1 pytest tests/sim/test_engine_equivalence.py``) and say why in the commit.
"""

from __future__ import annotations

import json
import os

import pytest

from . import cluster_traces
from .engine_traces import GOLDEN, TRACES, run_trace, write_golden

if os.environ.get("MISAT_UPDATE_GOLDEN") == "1":
    write_golden()
    cluster_traces.write_golden()
_golden = json.loads(GOLDEN.read_text())
_cluster_golden = json.loads(cluster_traces.GOLDEN.read_text())


@pytest.mark.parametrize("trace", TRACES, ids=lambda t: t.name)
def test_trace_outcome_matches_the_golden_record(trace) -> None:
    got = run_trace(trace)
    want = _golden[trace.name]
    for key in ("prefix_queries", "prefix_hits", "preemptions", "steps", "aborted", "finish_order"):
        assert got[key] == want[key], key
    assert got["requests"] == want["requests"]


@pytest.mark.parametrize("trace", TRACES, ids=lambda t: t.name)
def test_trace_output_ids_match_the_golden_record(trace) -> None:
    assert run_trace(trace)["output_digest"] == _golden[trace.name]["output_digest"]


@pytest.mark.parametrize("trace", TRACES, ids=lambda t: t.name)
def test_discarded_outputs_change_no_outcome(trace) -> None:
    # The cluster discards the output ids of every session's last turn: the blocks holding them
    # get keys nothing else can take, so hits, evictions, preemptions (a recompute finds its own
    # blocks) and every time must be as when the ids are drawn.
    got = run_trace(trace, discard_last_turn_outputs=True)
    want = _golden[trace.name]
    assert got["discarded"] > 0
    for key in ("prefix_queries", "prefix_hits", "preemptions", "steps", "aborted", "finish_order"):
        assert got[key] == want[key], key
    assert got["requests"] == want["requests"]


def test_the_traces_cover_their_regimes() -> None:
    # Each trace must keep exercising what it is named for, or it pins nothing.
    g = _golden
    assert g["healthy"]["prefix_hits"] / g["healthy"]["prefix_queries"] > 0.5
    assert g["thrash"]["prefix_hits"] / g["thrash"]["prefix_queries"] < 0.2 and g["thrash"]["preemptions"] > 0
    assert g["preempt"]["preemptions"] > 0
    assert g["reset"]["aborted"] > 0
    # Prompts longer than the 64-token step budget: prefill spans several steps.
    assert any(r["prompt"] - r["cached"] > 64 for r in g["chunked"]["requests"].values())


@pytest.mark.parametrize("name", sorted(cluster_traces.RUNS))
def test_cluster_run_matches_the_golden_record(name: str) -> None:
    assert cluster_traces.run(name) == _cluster_golden[name]
