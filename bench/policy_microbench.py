"""Micro-benchmark of one MISA-T decision (not a test): ``make microbench``.

Setup: 64 engines, 10,000 live sessions spread over them (agentic sessions
whose prompts are in the prefix index), learned footprints and residencies.
Measures ``decide()`` for (a) a continuation of a live session and (b) a new
session with a 4,000-token prompt that shares its first 2,000 tokens with a
live session. Prints median and p99 in microseconds.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from misat_router.policy.misa import MisaPolicy
from misat_router.policy.runner import PolicyRunner
from misat_router.policy.settings import ClassSpec, PolicyName, PolicySettings, WorkloadMix
from misat_router.policy.types import Completion, EngineSnapshot, RequestMeta

MIX = WorkloadMix(
    classes=(
        ClassSpec(name="agentic", share=48.6, multi_turn=True),
        ClassSpec(name="rlvr", share=33.2),
        ClassSpec(name="rlhf", share=18.2),
    )
)


def setup(n_engines: int, n_sessions: int, prompt_len: int, seed: int) -> tuple[PolicyRunner, dict]:
    rng = random.Random(seed)
    policy = MisaPolicy(PolicySettings(name=PolicyName.MISA_T), MIX)
    runner = PolicyRunner(policy, MIX)
    engines = {
        f"engine-{i:02d}": EngineSnapshot(engine_id=f"engine-{i:02d}", kv_capacity_tokens=50_000_000, scraped_at=0.0)
        for i in range(n_engines)
    }
    runner.on_metrics(engines, 0.0)
    # Teach footprints and residencies.
    for i in range(64):
        cls = MIX.classes[i % 3].name
        sid = f"warm-{i}" if cls == "agentic" else None
        r = RequestMeta(f"warm-{i}", cls, session_id=sid, prompt_token_ids=(1, 2, 3), prompt_tokens=3)
        d = runner.submit(r, engines, 0.0)
        runner.finish(r, d.engine_id, Completion(1000 + i, 2000), 5.0 + i % 7)  # type: ignore[arg-type]
        if sid:
            runner.end_session(sid, 6.0 + i % 7)
    sessions = []
    for i in range(n_sessions):
        cls = MIX.classes[i % 3].name
        ids = tuple(rng.randrange(50_000) for _ in range(prompt_len))
        r = RequestMeta(f"s{i}", cls, session_id=f"sess-{i}", prompt_token_ids=ids, prompt_tokens=prompt_len)
        d = runner.submit(r, engines, 10.0)
        assert d.placed, d
        sessions.append((r, d.engine_id))
    return runner, engines


def measure(fn, n: int, clock=time.perf_counter_ns) -> tuple[float, float]:
    """Median and p99 in microseconds of ``n`` calls, on the given clock."""
    samples = []
    for _ in range(n):
        t0 = clock()
        fn()
        samples.append((clock() - t0) / 1000.0)
    samples.sort()
    return statistics.median(samples), samples[min(len(samples) - 1, int(0.99 * len(samples)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, default=64)
    ap.add_argument("--sessions", type=int, default=10_000)
    ap.add_argument("--live-prompt", type=int, default=512, help="prompt tokens of each live session")
    ap.add_argument("--iterations", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    runner, engines = setup(args.engines, args.sessions, args.live_prompt, args.seed)
    policy = runner.policy
    rng = random.Random(args.seed + 1)
    counter = iter(range(10**9))

    def continuation() -> None:
        i = rng.randrange(args.sessions)
        policy.decide(RequestMeta(f"c{next(counter)}", MIX.classes[i % 3].name, session_id=f"sess-{i}",
                                  turn=3, prompt_tokens=4000), engines, 20.0)

    shared = tuple(rng.randrange(50_000) for _ in range(2000))

    # Prompt construction is the client's cost, not the decision's: build ids outside the timer.
    prompts = [shared + tuple(rng.randrange(50_000) for _ in range(2000)) for _ in range(256)]

    def new_session_prebuilt() -> None:
        ids = prompts[next(counter) % len(prompts)]
        policy.decide(RequestMeta(f"n{next(counter)}", "rlvr", prompt_token_ids=ids, prompt_tokens=4000),
                      engines, 20.0)

    print(f"engines={args.engines} live_sessions={len(policy.sessions)} "  # type: ignore[attr-defined]
          f"indexed_blocks={sum(policy.index.sizes().values())}")  # type: ignore[attr-defined]
    cases = [("continuation", continuation), ("new session, 4000-token prompt", new_session_prebuilt)]
    for name, fn in cases:
        for _ in range(200):
            fn()
        med, p99 = measure(fn, args.iterations)
        cmed, cp99 = measure(fn, args.iterations, time.thread_time_ns)
        # Wall time includes being descheduled on a shared machine; thread CPU time does not.
        print(f"{name:32s} wall median {med:7.1f} us p99 {p99:8.1f} us | "
              f"cpu median {cmed:7.1f} us p99 {cp99:8.1f} us")


if __name__ == "__main__":
    main()
