"""Seeded engine traces whose observable outcome is pinned in ``golden/engine_traces.json``.

The engine model is optimised for speed again and again; these traces make
sure an optimisation changes the cost and nothing a client or the router can
observe: per request the finish reason, prompt / cached / output token
counts, arrival, first-scheduled, first-token and finish times, preemptions;
per trace the prefix-cache queries and hits, preemptions and step count.
Output token ids are pinned by a digest, separately, since a change of how
ids are drawn (not of what the engine does) may legitimately change them.

Regenerate the golden file (only for a change that is *meant* to alter the
engine's behaviour, stated in the commit)::

    MISAT_UPDATE_GOLDEN=1 .venv/bin/pytest tests/sim/test_engine_equivalence.py

Each trace exercises one regime: healthy prefix reuse, thrashing (the working
set exceeds KV, hits collapse), preemption (decode outgrows KV), chunked
prefill (prompts longer than the token budget), and a prefix-cache reset
with aborts between waves. Multi-turn sessions send their earlier turns'
outputs back as the next prompt, so output ids matter to hits.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from misat_sim.config import SimEngineConfig
from misat_sim.engine import FinishedRequest, SimEngine

GOLDEN = Path(__file__).parent / "golden" / "engine_traces.json"
TIME_DIGITS = 9
"""Times are compared rounded to a nanosecond of modelled time (float sums in another order differ in ulps)."""


@dataclass
class Trace:
    name: str
    engine: dict[str, Any]
    sessions: int
    turns: int
    prompt: tuple[int, int]
    """First-turn prompt length range (tokens)."""
    shared_prefix: int
    """Tokens every session's first prompt starts with (a system prompt)."""
    turn_growth: tuple[int, int]
    """Tokens a tool result adds per turn."""
    output: tuple[int, int]
    arrival_gap_s: float
    tool_gap_s: float
    ignore_eos: bool = True
    reset_at_s: float | None = None
    """Abort what is running, reset the prefix cache, continue (a weight update)."""
    driver: str = "advance"
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


TRACES: tuple[Trace, ...] = (
    Trace("healthy", {"num_gpu_blocks": 2048, "max_model_len": 4096}, sessions=12, turns=4,
          prompt=(40, 200), shared_prefix=64, turn_growth=(20, 80), output=(10, 60),
          arrival_gap_s=0.02, tool_gap_s=0.05),
    Trace("thrash", {"num_gpu_blocks": 160, "max_model_len": 512}, sessions=24, turns=4,
          prompt=(60, 160), shared_prefix=32, turn_growth=(20, 60), output=(10, 40),
          arrival_gap_s=0.005, tool_gap_s=0.2, seed=1),
    Trace("preempt", {"num_gpu_blocks": 96, "max_model_len": 256}, sessions=16, turns=1,
          prompt=(20, 60), shared_prefix=0, turn_growth=(0, 0), output=(120, 200),
          arrival_gap_s=0.001, tool_gap_s=0.0, ignore_eos=False, seed=2),
    Trace("chunked", {"num_gpu_blocks": 1024, "max_model_len": 2048, "max_num_batched_tokens": 64},
          sessions=6, turns=3, prompt=(300, 900), shared_prefix=128, turn_growth=(100, 300),
          output=(5, 30), arrival_gap_s=0.01, tool_gap_s=0.02, seed=3),
    Trace("reset", {"num_gpu_blocks": 512, "max_model_len": 1024}, sessions=10, turns=3,
          prompt=(50, 150), shared_prefix=48, turn_growth=(20, 60), output=(20, 80),
          arrival_gap_s=0.01, tool_gap_s=0.05, reset_at_s=0.4, seed=4),
    Trace("stepwise", {"num_gpu_blocks": 256, "max_model_len": 512}, sessions=8, turns=2,
          prompt=(30, 120), shared_prefix=32, turn_growth=(10, 40), output=(10, 50),
          arrival_gap_s=0.01, tool_gap_s=0.03, driver="step", seed=5),
)


def _engine(trace: Trace) -> SimEngine:
    fields: dict[str, Any] = {"profile": "tiny-cpu", "block_size": 16, "max_num_seqs": 16,
                              "max_num_batched_tokens": 256, "seed": trace.seed, **trace.engine}
    return SimEngine(SimEngineConfig.model_validate(fields))


def run_trace(trace: Trace, discard_last_turn_outputs: bool = False) -> dict[str, Any]:
    """Drive one engine through ``trace`` as the cluster does; returns its observable outcome.

    ``discard_last_turn_outputs``: add each session's last turn with ``discard_output_ids``, as
    the cluster does (its ids are never drawn; ``discarded`` counts the requests that were)."""
    rng = random.Random(trace.seed)
    engine = _engine(trace)
    vocab = engine.limits.vocab_size
    shared = [rng.randrange(3, vocab) for _ in range(trace.shared_prefix)]
    # (time, seq, session, turn, prompt, max_tokens)
    arrivals: list[tuple[float, int, int, int, list[int], int]] = []
    for s in range(trace.sessions):
        prompt = shared + [rng.randrange(3, vocab) for _ in range(rng.randint(*trace.prompt))]
        arrivals.append((s * trace.arrival_gap_s, s, s, 0, prompt, rng.randint(*trace.output)))
    finished: list[FinishedRequest] = []
    prompts: dict[str, list[int]] = {}
    steps = 0
    seq = trace.sessions
    now = 0.0
    reset_pending = trace.reset_at_s is not None
    while arrivals or engine.has_unfinished_requests():
        arrivals.sort()
        next_at = arrivals[0][0] if arrivals else float("inf")
        if reset_pending and trace.reset_at_s is not None and trace.reset_at_s < next_at:
            next_at = trace.reset_at_s
        if engine.has_unfinished_requests() and engine.clock < next_at:
            if trace.driver == "step":
                result = engine.step(max(now, engine.clock))
            else:
                result = engine.advance(max(now, engine.clock), next_at)
            steps += result.num_steps
            now = engine.clock
            for f in result.finished:
                finished.append(f)
                sess, turn = (int(x) for x in f.request_id.split("-")[1:])
                if turn + 1 < trace.turns and f.finish_reason.value != "abort":
                    req_prompt = prompts[f.request_id]
                    growth = [rng.randrange(3, vocab) for _ in range(rng.randint(*trace.turn_growth))]
                    prompt = req_prompt + f.output_token_ids + growth
                    limit = engine.limits.max_model_len - 1
                    if len(prompt) < limit:
                        max_tokens = min(rng.randint(*trace.output), limit - len(prompt))
                        arrivals.append((f.finish_time + trace.tool_gap_s, seq, sess, turn + 1, prompt, max_tokens))
                        seq += 1
            continue
        now = max(now, next_at)
        if reset_pending and trace.reset_at_s is not None and now >= trace.reset_at_s:
            reset_pending = False
            for rid in sorted(engine.requests):
                engine.abort_request(rid, now)
            assert engine.reset_prefix_cache()
            continue
        at, _, sess, turn, prompt, max_tokens = arrivals.pop(0)
        rid = f"r-{sess}-{turn}"
        prompts[rid] = prompt
        engine.add_request(rid, prompt, max_tokens, ignore_eos=trace.ignore_eos, arrival_time=at,
                           discard_output_ids=discard_last_turn_outputs and turn + 1 == trace.turns)
    counters = engine.sync_counters()

    def t(x: float | None) -> float | None:
        return None if x is None else round(x, TIME_DIGITS)

    return {
        "requests": {
            f.request_id: {
                "finish_reason": f.finish_reason.value,
                "prompt": f.num_prompt_tokens,
                "cached": f.num_cached_tokens,
                "output": f.num_output_tokens,
                "arrival": t(f.arrival_time),
                "first_scheduled": t(f.first_scheduled_time),
                "first_token": t(f.first_token_time),
                "finish": t(f.finish_time),
                "preemptions": f.num_preemptions,
            }
            for f in finished
        },
        "finish_order": [f.request_id for f in finished],
        "prefix_queries": counters.prefix_cache_queries,
        "prefix_hits": counters.prefix_cache_hits,
        "preemptions": counters.num_preemptions,
        "steps": steps,
        "aborted": counters.request_success.get("abort", 0),
        "discarded": sum(1 for f in finished if f.num_output_tokens and not f.output_token_ids),
        "output_digest": hashlib.sha256(
            json.dumps([f.output_token_ids for f in finished]).encode()
        ).hexdigest(),
    }


def run_all() -> dict[str, dict[str, Any]]:
    return {trace.name: run_trace(trace) for trace in TRACES}


def write_golden() -> None:
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps(run_all(), indent=1, sort_keys=True) + "\n")
