"""How fast the engine model simulates: one engine under a high, mixed load.

Run ``python -P -m misat_bench.engine_speed`` (``--help`` for knobs). It keeps a
fixed number of closed-loop sessions in flight on one engine: agentic
sessions (many turns over a growing context with tool gaps), RLVR requests
(short prompt, long output) and RLHF requests, with the paper's median shapes
scaled by the engine's length scale, and reports modelled seconds simulated
per wall second plus the engine's prefix-hit rate and preemptions. It is a
yardstick for the simulator's cost, not a workload model (``sim/workload.py``
is); numbers in docs/simulator.md come from it.
"""

from __future__ import annotations

import argparse
import heapq
import random
import time
from array import array
from dataclasses import dataclass

from misat_sim.config import SimEngineConfig
from misat_sim.engine import SimEngine

AGENTIC_FIRST_CONTEXT: int = 4000
"""Real tokens of an agentic trajectory's first prompt (system prompt, task)."""
AGENTIC_TOOL_RESULT: int = 1300
"""Real tokens a tool result adds per turn: over ~70 turns the context grows to
about 100K, with a median near the paper's 37,757 input tokens per turn."""
AGENTIC_TURNS: int = 70
"""Turns of an agentic trajectory (paper: about 70)."""
AGENTIC_TURN_OUTPUT: int = 148
"""Median agentic output per turn, real tokens (paper)."""
RLVR_INPUT: int = 156
RLVR_OUTPUT: int = 47583
RLHF_INPUT: int = 60
RLHF_OUTPUT: int = 7344
TOOL_GAP_S: float = 2.0
"""Modelled tool time between agentic turns (already compressed like token time)."""
CLASS_SHARES: tuple[float, float, float] = (0.486, 0.331, 0.182)
"""Agentic / RLVR / RLHF shares of new sessions (the paper's target mixture)."""


@dataclass
class SpeedReport:
    """Result of one measurement."""

    simulated_s: float
    wall_s: float
    cpu_s: float
    """Process CPU time: the figure to compare on a shared machine, where wall time is noisy."""
    steps: int
    finished: int
    prefix_hit_rate: float
    preemptions: int

    @property
    def speed(self) -> float:
        """Modelled seconds per wall second."""
        return self.simulated_s / self.wall_s if self.wall_s > 0 else float("inf")

    @property
    def cpu_speed(self) -> float:
        """Modelled seconds per CPU second."""
        return self.simulated_s / self.cpu_s if self.cpu_s > 0 else float("inf")


@dataclass
class _Session:
    kind: str
    context: list[int]
    turns_left: int


def measure(
    profile: str = "qwen30b-a3b-h100", sim_seconds: float = 3600.0, sessions: int = 256, seed: int = 0
) -> SpeedReport:
    """Simulate ``sim_seconds`` of one engine with ``sessions`` sessions always in flight."""
    engine = SimEngine(SimEngineConfig(profile=profile, seed=seed))
    limits = engine.limits
    scale = limits.length_scale
    max_len = limits.max_model_len
    rng = random.Random(seed)
    live: dict[str, _Session] = {}
    events: list[tuple[float, int, str]] = []  # (time, seq, request id) of requests to submit
    seq = 0

    def new_session() -> _Session:
        kind = rng.choices(("agentic", "rlvr", "rlhf"), weights=CLASS_SHARES)[0]
        if kind == "agentic":
            return _Session(kind, _tokens(rng, max(1, int(AGENTIC_FIRST_CONTEXT * scale))), 0)
        n_in = RLVR_INPUT if kind == "rlvr" else RLHF_INPUT
        return _Session(kind, _tokens(rng, max(1, int(n_in * scale))), 1)

    def submit(rid: str, now: float) -> None:
        s = live[rid]
        if s.kind == "agentic":
            out = max(1, int(AGENTIC_TURN_OUTPUT * scale))
        else:
            out = max(1, int((RLVR_OUTPUT if s.kind == "rlvr" else RLHF_OUTPUT) * scale))
        engine.add_request(rid, s.context, out, ignore_eos=True, arrival_time=now)

    counter = 0
    for _ in range(sessions):
        rid = f"s{counter}"
        counter += 1
        live[rid] = new_session()
        if live[rid].kind == "agentic":
            live[rid].turns_left = AGENTIC_TURNS
        heapq.heappush(events, (0.0, seq, rid))
        seq += 1

    now = 0.0
    finished = 0
    t0 = time.perf_counter()
    c0 = time.process_time()
    while now < sim_seconds:
        next_event = events[0][0] if events else sim_seconds
        while events and events[0][0] <= now:
            _, _, rid = heapq.heappop(events)
            submit(rid, now)
        until = min(events[0][0] if events else sim_seconds, sim_seconds)
        if engine.has_unfinished_requests():
            result = engine.advance(now, max(until, now + 1e-9))
            now = max(engine.clock, now)
            for f in result.finished:
                finished += 1
                s = live.pop(f.request_id)
                s.turns_left -= 1
                grown = len(s.context) + f.num_output_tokens + 2 * int(AGENTIC_TOOL_RESULT * scale)
                if s.kind == "agentic" and s.turns_left > 0 and grown < max_len:
                    tool = _tokens(rng, int(AGENTIC_TOOL_RESULT * scale))
                    s.context = s.context + f.output_token_ids + tool
                else:
                    s = new_session()
                    if s.kind == "agentic":
                        s.turns_left = AGENTIC_TURNS
                rid = f"s{counter}"
                counter += 1
                live[rid] = s
                gap = TOOL_GAP_S if s.kind == "agentic" and s.turns_left < AGENTIC_TURNS else 0.0
                heapq.heappush(events, (now + gap, seq, rid))
                seq += 1
        else:
            now = next_event
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    c = engine.sync_counters()
    return SpeedReport(
        simulated_s=now,
        wall_s=wall,
        cpu_s=cpu,
        steps=c.num_steps,
        finished=finished,
        prefix_hit_rate=c.prefix_cache_hits / c.prefix_cache_queries if c.prefix_cache_queries else 0.0,
        preemptions=c.num_preemptions,
    )


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [3 + x % 30000 for x in array("I", rng.randbytes(4 * n))]


def main(argv: list[str] | None = None) -> int:
    """Print one measurement."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="qwen30b-a3b-h100")
    parser.add_argument("--sim-seconds", type=float, default=3600.0)
    parser.add_argument("--sessions", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    r = measure(args.profile, args.sim_seconds, args.sessions, args.seed)
    print(
        f"profile={args.profile} sessions={args.sessions} simulated={r.simulated_s:.0f}s "
        f"wall={r.wall_s:.2f}s speed={r.speed:.0f} sim-s/wall-s cpu={r.cpu_s:.2f}s "
        f"cpu_speed={r.cpu_speed:.0f} sim-s/cpu-s steps={r.steps} "
        f"finished={r.finished} prefix_hit={r.prefix_hit_rate:.3f} preemptions={r.preemptions}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
