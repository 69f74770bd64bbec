"""Micro-benchmark of one MISA-T decision (not a test): ``make microbench``.

Setup: 64 engines, 10,000 live sessions spread over them (agentic sessions
whose prompts are in the prefix index), learned footprints and residencies.
Measures ``decide()`` for (a) a continuation of a live session and (b) a new
session with a 4,000-token prompt that shares its first 2,000 tokens with a
live session. Prints median and p99 in microseconds.

``--structures``: the prefix structures alone on agentic prompts (2K-40K token
ids: shared system prompts, sessions that grow turn by turn), per request:
``cache_aware``'s radix tree (match, then insert for the chosen engine) and
MISA's prefix index (keys + match for a session's first turn; keys + insert
for every turn, a continuation's keys starting from its session's last
prompt's where the implementation can, as MISA does). ``--reference DIR`` times copies of ``radix_tree.py`` and
``prefix_index.py`` from DIR (e.g. an older commit's) on the same requests,
interleaved with the current ones, and checks both answer alike.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import random
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

from misat_router.policy import prefix_index, radix_tree
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


def agentic_requests(
    n: int, seed: int, n_engines: int, fresh_ints: bool
) -> list[tuple[tuple[int, ...], str, bool, str]]:
    """``n`` requests (prompt ids, engine, first turn?, session) of 48 interleaved agentic sessions on
    system prompts of 2K-6K tokens, each turn adding 300-3,000 tokens, up to 40K.
    ``fresh_ints``: each prompt's ids are new int objects, as a JSON body parses to."""
    rng = random.Random(seed)
    systems = [[rng.randrange(150_000) for _ in range(k)] for k in (2000, 4000, 6000)]
    engines = [f"engine-{i:02d}" for i in range(n_engines)]

    def start() -> tuple[list[int], str]:
        return [*rng.choice(systems), *(rng.randrange(150_000) for _ in range(rng.randint(0, 2000)))], \
            rng.choice(engines)

    sessions = [start() for _ in range(48)]
    turn = [0] * len(sessions)
    started = list(range(len(sessions)))
    out = []
    for _ in range(n):
        i = rng.randrange(len(sessions))
        prompt, engine = sessions[i]
        ids = tuple(json.loads(json.dumps(prompt))) if fresh_ints else tuple(prompt)
        out.append((ids, engine, turn[i] == 0, f"s{started[i]}"))
        prompt.extend(rng.randrange(150_000) for _ in range(rng.randint(300, 3000)))
        turn[i] += 1
        if len(prompt) > 40_000:
            sessions[i], turn[i] = start(), 0
            started[i] = len(out) + len(sessions)
    return out


def load_reference(directory: Path) -> tuple[ModuleType, ModuleType]:
    """``radix_tree`` and ``prefix_index`` from ``directory``, as modules of the policy package."""
    mods = []
    for name in ("radix_tree", "prefix_index"):
        spec = importlib.util.spec_from_file_location(f"misat_router.policy._reference_{name}",
                                                      directory / f"{name}.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        mods.append(mod)
    return mods[0], mods[1]


def time_structures(
    tree_mod: ModuleType, index_mod: ModuleType, requests: list, warm: int
) -> tuple[dict[str, float], list]:
    """Seconds per phase over the requests after the first ``warm``, and every answer.

    As MISA does, a continuation's keys start from its session's last prompt's where the
    implementation can (``prompt_keys(..., previous)``)."""
    tree = tree_mod.token_tree()
    index = index_mod.PrefixIndex(PolicySettings().prefix)
    engines = sorted({e for _, e, _, _ in requests})
    settings = index.settings
    carries = "previous" in inspect.signature(index_mod.prompt_keys).parameters
    last: dict[str, object] = {}
    clock = time.perf_counter
    spent = dict.fromkeys(("tree match", "tree insert", "index keys+match", "index insert"), 0.0)
    answers = []
    for i, (ids, engine, first, session) in enumerate(requests):
        req = RequestMeta(f"r{i}", "agentic", session_id=session, prompt_token_ids=ids)
        t0 = clock()
        m = tree.match(ids)
        t1 = clock()
        tree.insert(ids, engine, float(i))
        t2 = clock()
        if first:
            keys = index_mod.prompt_keys(req, settings)
            h = index.match(keys, engines)
        t3 = clock()
        if not first:
            h = None
            keys = index_mod.prompt_keys(req, settings, last.get(session)) if carries else \
                index_mod.prompt_keys(req, settings)
        index.insert(keys, engine)
        if carries:
            last[session] = keys
        t4 = clock()
        if i >= warm:
            spent["tree match"] += t1 - t0
            spent["tree insert"] += t2 - t1
            spent["index keys+match"] += t3 - t2
            spent["index insert"] += t4 - t3
        answers.append((list(m.items()), h))
    return spent, answers


def structures(args: argparse.Namespace) -> None:
    requests = agentic_requests(args.requests, args.seed, 8, args.fresh_ints)
    warm = len(requests) // 2
    timed = requests[warm:]
    tokens = sum(len(ids) for ids, _, _, _ in timed)
    firsts = sum(first for _, _, first, _ in timed)
    print(f"{len(timed)} timed requests ({firsts} first turns) after {warm} warm-up ones, "
          f"{tokens / len(timed):,.0f} tokens each on average, fresh ints: {args.fresh_ints}")
    variants: dict[str, tuple[ModuleType, ModuleType]] = {"current": (radix_tree, prefix_index)}
    if args.reference is not None:
        variants = {"reference": load_reference(args.reference), **variants}
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    answers: dict[str, list] = {}
    for rep in range(args.repeat):
        order = list(variants) if rep % 2 == 0 else list(reversed(variants))
        for v in order:
            spent, answers[v] = time_structures(*variants[v], requests, warm)
            runs[v].append(spent)
    if len(answers) > 1:
        assert answers["reference"] == answers["current"], "the reference answered differently"
        print("reference and current answered alike on every request")
    phases = list(runs["current"][0])
    print(f"{'us per request':26s}" + "".join(f"{p:>20s}" for p in phases) + f"{'all':>12s}")
    for v, spents in runs.items():
        for stat, fn in (("min", min), ("median", statistics.median)):
            cells = []
            for p in phases:
                per = fn(s[p] for s in spents) / (firsts if p == "index keys+match" else len(timed)) * 1e6
                cells.append(f"{per:20.1f}")
            total = fn(sum(s.values()) for s in spents) / len(timed) * 1e6
            print(f"{v + ' ' + stat:26s}" + "".join(cells) + f"{total:12.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--structures", action="store_true", help="time the prefix structures alone (see above)")
    ap.add_argument("--reference", type=Path, default=None,
                    help="with --structures: a directory with older radix_tree.py and prefix_index.py")
    ap.add_argument("--requests", type=int, default=1200, help="with --structures: requests, half warm-up")
    ap.add_argument("--repeat", type=int, default=5, help="with --structures: passes per variant")
    ap.add_argument("--fresh-ints", action="store_true",
                    help="with --structures: every prompt's ids are new int objects (a parsed JSON body)")
    ap.add_argument("--engines", type=int, default=64)
    ap.add_argument("--sessions", type=int, default=10_000)
    ap.add_argument("--live-prompt", type=int, default=512, help="prompt tokens of each live session")
    ap.add_argument("--iterations", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    if args.structures:
        structures(args)
        return
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
