"""``misat replay``: a seeded synthetic trace through the pure policy, no engines.

Each session arrives, is decided (PLACE or HOLD), holds KV for a sampled
time, and completes; held work is re-evaluated every epoch. Engines are
static snapshots, so this shows what the policy decides (caps, holds,
placement reasons, mixture), not throughput: that needs the engine simulator.
"""

from __future__ import annotations

import argparse
import heapq
import random
from collections import Counter
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from misat_router.policy.registry import build_policy
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
# Scaled session shapes (tokens of peak KV, seconds of residency): lognormal medians.
ARRIVALS_PER_S = 1.5
"""Session arrival rate of the replayed trace."""
SHAPES = {"agentic": (6000, 60.0), "rlvr": (3000, 40.0), "rlhf": (500, 8.0)}


@dataclass(order=True)
class Event:
    time: float
    seq: int
    kind: str
    req: RequestMeta | None = None
    engine: str | None = None
    tokens: int = 0


def replay(policy: PolicyName, seed: int, sessions: int, engines: int, capacity: int) -> dict:
    rng = random.Random(seed)
    runner = PolicyRunner(build_policy(PolicySettings(name=policy), MIX), MIX)
    ids = [f"engine-{i}" for i in range(engines)]
    snaps = {e: EngineSnapshot(engine_id=e, kv_capacity_tokens=capacity) for e in ids}
    runner.on_metrics(snaps, 0.0)
    events: list[Event] = []
    seq = 0
    t = 0.0
    names = [c.name for c in MIX.classes]
    weights = [c.share for c in MIX.classes]
    group_prompt: tuple[int, ...] = ()
    for i in range(sessions):
        t += rng.expovariate(ARRIVALS_PER_S)
        cls = rng.choices(names, weights)[0]
        if (cls != "agentic" and i % 8 == 0) or not group_prompt:
            group_prompt = tuple(rng.randrange(2048) for _ in range(256))
        req = RequestMeta(f"r{i}", cls, session_id=f"s{i}" if cls == "agentic" else None,
                          prompt_token_ids=group_prompt, prompt_tokens=len(group_prompt))
        seq += 1
        heapq.heappush(events, Event(t, seq, "arrive", req))
    outcomes: Counter[tuple[str, str]] = Counter()
    held_at: dict[str, float] = {}
    waits: dict[str, list[float]] = {n: [] for n in names}
    epoch = runner.policy.settings.admission.epoch_s
    next_epoch = epoch

    def placed(req: RequestMeta, engine: str, now: float) -> None:
        nonlocal seq
        waits[req.workload_class].append(now - held_at.pop(req.request_id, now))
        tokens, residency = SHAPES[req.workload_class]
        seq += 1
        heapq.heappush(events, Event(now + rng.lognormvariate(0, 0.5) * residency, seq, "done", req, engine,
                                     int(rng.lognormvariate(0, 0.5) * tokens)))

    while events:
        ev = heapq.heappop(events)
        while next_epoch <= ev.time:
            for req, d in runner.epoch(snaps, next_epoch):
                outcomes[(req.workload_class, "released")] += 1
                placed(req, d.engine_id, next_epoch)  # type: ignore[arg-type]
            next_epoch += epoch
        assert ev.req is not None
        if ev.kind == "arrive":
            d = runner.submit(ev.req, snaps, ev.time)
            outcomes[(ev.req.workload_class, d.reason.value)] += 1
            if d.placed:
                placed(ev.req, d.engine_id, ev.time)  # type: ignore[arg-type]
            else:
                held_at[ev.req.request_id] = ev.time
        else:
            runner.finish(ev.req, ev.engine, Completion(ev.req.prompt_tokens, ev.tokens), ev.time)  # type: ignore[arg-type]
            if ev.req.session_id is not None:
                runner.end_session(ev.req.session_key, ev.time)
            for req, d in runner.release(snaps, ev.time):
                outcomes[(req.workload_class, "released")] += 1
                placed(req, d.engine_id, ev.time)  # type: ignore[arg-type]
    return {"runner": runner, "outcomes": outcomes, "waits": waits, "end": next_epoch}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="misat replay", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", action="append", choices=[p.value for p in PolicyName],
                    help="policy to replay (repeatable; default: misa-t, misa, session-admission)")
    ap.add_argument("--seed", type=int, default=1, help="seed of the synthetic sessions (default 1)")
    ap.add_argument("--sessions", type=int, default=2000, help="sessions to replay (default 2000)")
    ap.add_argument("--engines", type=int, default=4, help="engines the policy places on (default 4)")
    ap.add_argument("--kv-tokens", type=int, default=150_000,
                    help="KV capacity per engine, scaled tokens (default 150000)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console()
    policies = [PolicyName(p) for p in (args.policy or ["misa-t", "misa", "session-admission"])]
    console.print(f"[bold]Replaying {args.sessions} seeded sessions (seed {args.seed}) on {args.engines} "
                  f"engines of {args.kv_tokens:,} KV tokens through the policy (no engine model).[/]")
    table = Table(title="Policy replay: decisions per class")
    for col in ("policy", "class", "placed at once", "held", "mean hold wait s", "completed",
                "consumed %", "target %"):
        table.add_column(col, justify="right" if col not in ("policy", "class") else "left")
    for name in policies:
        res = replay(name, args.seed, args.sessions, args.engines, args.kv_tokens)
        runner: PolicyRunner = res["runner"]
        consumed = runner.mixture.consumed()
        for c in MIX.classes:
            oc = {k[1]: v for k, v in res["outcomes"].items() if k[0] == c.name}
            held = sum(v for k, v in oc.items() if k.startswith(("session_cap", "class_cap", "queued")))
            w = res["waits"][c.name]
            table.add_row(name.value, c.name, str(sum(v for k, v in oc.items() if k in (
                "new_session", "continuation", "cache_hit", "cache_miss", "least_loaded", "round_robin",
                "imbalance"))), str(held), f"{(sum(w) / len(w)) if w else 0:.2f}",
                str(runner.mixture.completed.get(c.name, 0)), f"{100 * consumed.get(c.name, 0):.1f}",
                f"{c.share:.1f}")
        tv = f"{runner.mixture.tv_points():.2f} pts"
        table.add_row(name.value, "[dim]TV distance[/]", "", "", "", "", tv, "", end_section=True)
    console.print(table)
    return 0
