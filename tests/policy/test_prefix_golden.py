"""Differential test of the prefix structures against a golden record of their answers.

``golden/prefix_structures.json`` holds, for randomized operation sequences, every
answer of the radix tree (``cache_aware``'s tree), the prefix index (MISA's) and
of whole policies driven through a ``PolicyRunner``: matched lengths and their
order, sizes, eviction results, the tree's shape, token-block key values, and
every decision with its scores. It was written (``--write --reference``) by the
policy files of commit f995cf3, which predate the fast paths (divergence found
by 64-symbol chunks, two walks per placed prompt, every block hashed on every
turn, one Python step per block), so a change that keeps it passing takes the
same decisions. The ``keys`` records alone were rewritten since, when the key chain
moved into C (an XOR of position-tagged block hashes instead of multiply-and-XOR):
every other record, each match and decision, was unchanged by it; and again when a
token block and its position became one flat tuple to hash (257 of the 280 ``keys``
records changed, the text keys' did not, and no other record).

The sequences are regenerated here from their seeds; the record keeps, per
operation, its kind and a 32-bit digest of its canonical JSON answer, so a
failure names the first operation that answered differently and shows the
answer given now. Regenerate the record (only when a decision is meant to change) with
``python -P tests/policy/test_prefix_golden.py --write``, or from older copies of the
policy files with ``--write --reference DIR`` (see ``main``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from misat_router.policy.prefix_index import PrefixIndex, PromptKeys, prompt_keys
from misat_router.policy.radix_tree import RadixTree, text_tree, token_tree
from misat_router.policy.registry import build_policy
from misat_router.policy.runner import PolicyRunner
from misat_router.policy.settings import (
    CacheAwareSettings,
    ClassSpec,
    FootprintSettings,
    PolicyName,
    PolicySettings,
    PrefixIndexSettings,
    ResidencySettings,
    SessionAdmissionSettings,
    WorkloadMix,
)
from misat_router.policy.types import Completion, EngineSnapshot, RequestMeta

GOLDEN = Path(__file__).parent / "golden" / "prefix_structures.json"

Record = list[Any]


# ---- prompts ----------------------------------------------------------------

class Prompts:
    """Agentic-style prompts: shared system prompts, sessions that grow turn by turn,
    rewritten (truncated) histories, and unrelated one-off prompts."""

    def __init__(self, rng: random.Random, vocab: int, system_lens: list[int], turn_len: tuple[int, int],
                 max_len: int) -> None:
        self.rng = rng
        self.vocab = vocab
        self.turn_len = turn_len
        self.max_len = max_len
        self.systems = [self.fresh(n) for n in system_lens]
        self.sessions: list[list[int]] = []

    def fresh(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def next(self) -> tuple[int, ...]:
        rng = self.rng
        r = rng.random()
        if r < 0.35 or not self.sessions:
            prompt = list(rng.choice(self.systems)) + self.fresh(rng.randint(*self.turn_len))
            self.sessions.append(prompt)
        elif r < 0.75:
            prompt = rng.choice(self.sessions)
            prompt.extend(self.fresh(rng.randint(*self.turn_len)))
            if len(prompt) > self.max_len:
                del prompt[self.max_len:]
        elif r < 0.85:
            base = rng.choice(self.sessions)
            prompt = base[: rng.randint(0, len(base))] + self.fresh(rng.randint(0, self.turn_len[1]))
            self.sessions.append(prompt)
        elif r < 0.95:
            base = rng.choice(self.sessions)
            return tuple(base[: rng.randint(0, len(base))])
        else:
            return tuple(self.fresh(rng.randint(0, 3)))
        if len(self.sessions) > 24:
            self.sessions.pop(0)
        return tuple(prompt)


def _text(ids: tuple[int, ...]) -> str:
    return "".join(chr(97 + t % 26) if t % 7 else " " for t in ids)


# ---- the radix tree -----------------------------------------------------------

def _tree_shape(tree: RadixTree) -> Record:
    return [[len(n.edge), n.edge[:1], list(n.access.items())] for n in tree._walk()]


def radix_case(seed: int, n_ops: int, prompts: Callable[[random.Random], Prompts], text: bool,
               bounds: tuple[int, int]) -> Record:
    rng = random.Random(seed)
    gen = prompts(rng)
    tree: RadixTree = text_tree() if text else token_tree()
    engines = [f"e{i}" for i in range(5)]
    seen: list = []
    out: Record = []
    now = 0.0
    for _ in range(n_ops):
        now += rng.random()
        r = rng.random()
        seq: Any = gen.next()
        if text:
            seq = _text(seq)
        if r < 0.2:
            e = rng.choice(engines)
            tree.insert(seq, e, now)
            seen.append(seq)
            out.append(["ins", e, len(seq), list(tree.sizes().items())])
        elif r < 0.45:
            # As cache_aware does: match a prompt, then insert that same object; sometimes the
            # tree changes in between, or another prompt is matched.
            e = rng.choice(engines)
            if seen and rng.random() < 0.2:
                seq = rng.choice(seen)
            first = list(tree.match(seq).items())
            between = rng.random()
            if between < 0.1:
                tree.evict(rng.randint(*bounds))
            elif between < 0.15:
                tree.remove_engine(rng.choice(engines))
            elif between < 0.25 and seen:
                other = rng.choice(seen)
                tree.insert(other[: rng.randint(0, len(other))] if rng.random() < 0.5 else other,
                            rng.choice(engines), now)
            elif between < 0.35 and seen:
                tree.match(rng.choice(seen))
            tree.insert(seq, e, now)
            seen.append(seq)
            out.append(["match+ins", first, e, len(seq), list(tree.sizes().items()), tree.node_count()])
        elif r < 0.85:
            if seen and rng.random() < 0.5:
                seq = rng.choice(seen)
            out.append(["match", len(seq), list(tree.match(seq).items())])
        elif r < 0.95:
            bound = rng.randint(*bounds)
            freed = tree.evict(bound)
            probe = [list(tree.match(s).items()) for s in rng.sample(seen, min(4, len(seen)))]
            out.append(["evict", bound, freed, list(tree.sizes().items()), tree.node_count(), probe])
        elif r < 0.98:
            e = rng.choice(engines)
            tree.remove_engine(e)
            out.append(["remove", e, list(tree.sizes().items()), tree.node_count()])
        else:
            tree.insert(seq, rng.choice(engines), now)
            tree.insert(seq, rng.choice(engines), now)  # same time, two engines
            out.append(["ins2", list(tree.match(seq).items())])
    out.append(["shape", _tree_shape(tree), tree.engines()])
    return out


# ---- the prefix index -------------------------------------------------------

def index_case(seed: int, n_ops: int, prompts: Callable[[random.Random], Prompts], settings: PrefixIndexSettings,
               limits: tuple[int, int]) -> Record:
    rng = random.Random(seed)
    gen = prompts(rng)
    idx = PrefixIndex(settings)
    engines = [f"e{i}" for i in range(6)]
    seen: list[tuple[int, ...]] = []
    out: Record = []

    def keys_of(ids: tuple[int, ...], i: int) -> PromptKeys:
        if i % 3 == 2:  # a text prompt
            return prompt_keys(RequestMeta(f"r{i}", "c", prompt_text=_text(ids)), settings)
        return prompt_keys(RequestMeta(f"r{i}", "c", prompt_token_ids=ids), settings)

    for _ in range(n_ops):
        r = rng.random()
        ids = gen.next()
        if seen and rng.random() < 0.3:
            ids = rng.choice(seen)
        kind = rng.randrange(3)
        keys = keys_of(ids, kind)
        if kind != 2 and rng.random() < 0.3:
            # The key values themselves (hashes of int tuples are the same in every process;
            # text keys are salted per process, so only their matches are recorded).
            out.append(["keys", len(keys), hash(keys.keys)])
        if r < 0.5:
            # As MISA does: match the candidates, then insert the same keys for the winner.
            cands = rng.sample(engines, rng.randint(1, len(engines)))
            got = idx.match(keys, cands)
            e = rng.choice(cands)
            idx.insert(keys, e)
            seen.append(ids)
            out.append(["match+ins", len(keys), list(got.items()), e, idx.size(e)])
        elif r < 0.7:
            e = rng.choice(engines)
            idx.insert(keys, e)
            seen.append(ids)
            out.append(["ins", e, len(keys), list(idx.sizes().items())])
        elif r < 0.9:
            cands = rng.sample(engines, rng.randint(0, len(engines)))
            out.append(["match", len(keys), list(idx.match(keys, cands).items())])
        elif r < 0.96:
            e = rng.choice(engines)
            idx.set_limit(e, rng.randint(*limits))
            out.append(["limit", e, list(idx.sizes().items()), list(idx.limits().items())])
        elif r < 0.98:
            which = rng.choice([*engines, None])
            idx.clear(which)
            out.append(["clear", which, list(idx.sizes().items())])
        else:
            e = rng.choice(engines)
            idx.remove_engine(e)
            out.append(["remove", e, list(idx.sizes().items())])
    probes = [keys_of(s, j) for j, s in enumerate(rng.sample(seen, min(12, len(seen))))]
    out.append(["final", [list(idx.match(k, engines).items()) for k in probes], list(idx.limits().items())])
    return out


# ---- whole policies -----------------------------------------------------------

MIX = WorkloadMix(
    classes=(
        ClassSpec(name="agentic", share=48.6, multi_turn=True),
        ClassSpec(name="rlvr", share=33.2),
        ClassSpec(name="rlhf", share=18.2, max_share=0.6),
    )
)


def policy_case(name: PolicyName, seed: int, n_ops: int, n_engines: int, kv_tokens: int,
                inspect: Callable[[PolicyRunner], None] | None = None,
                session_prompt_cache_symbols: int = PrefixIndexSettings().session_prompt_cache_symbols) -> Record:
    rng = random.Random(seed)
    settings = PolicySettings(
        name=name,
        prefix=PrefixIndexSettings(block_size=16, text_chunk_chars=64, max_blocks_per_engine=4000,
                                   session_prompt_cache_symbols=session_prompt_cache_symbols),
        cache_aware=CacheAwareSettings(max_tree_size=30_000, eviction_interval_s=4.0, balance_abs_threshold=6),
        footprint=FootprintSettings(statistic="peak", min_samples=2, bootstrap_tokens=6000),
        residency=ResidencySettings(min_samples=2),
        # The record predates the occupancy footprint (the default since 2026-12-05) and the
        # guard's cost check and long memory (since 2026-12-04), and its snapshots' query counts
        # are not an engine's; each has its own tests (test_occupancy, test_misa_scenarios).
        admission=SessionAdmissionSettings(healthy_hit_decay=0.98, degradation_cost_tolerance=0.0),
    )
    runner = PolicyRunner(build_policy(settings, MIX), MIX)
    gen = Prompts(rng, 50_000, [0, 300, 1200, 2500], (20, 900), 12_000)
    pool = [f"w{i}" for i in range(n_engines)]
    alive = list(pool)
    hits = dict.fromkeys(pool, 0.0)
    queries = dict.fromkeys(pool, 0.0)
    in_flight: dict[str, tuple[RequestMeta, str]] = {}
    session_prompt: dict[str, list[int]] = {}
    session_turn: dict[str, int] = {}
    busy: set[str] = set()
    out: Record = []
    now = 0.0
    n = 0

    def snapshots() -> dict[str, EngineSnapshot]:
        load = {w: 0 for w in alive}
        for _, w in in_flight.values():
            if w in load:
                load[w] += 1
        return {
            w: EngineSnapshot(
                engine_id=w, healthy=rng.random() > 0.05, kv_capacity_tokens=kv_tokens,
                kv_usage=min(1.0, load[w] * 0.12), num_running=load[w], num_waiting=rng.randrange(2),
                prefix_queries_total=queries[w], prefix_hits_total=hits[w], scraped_at=now - rng.random() * 0.2,
            )
            for w in alive
        }

    engines = snapshots()
    runner.on_metrics(engines, now)

    def note(req: RequestMeta, d: Any) -> None:
        out.append([req.request_id, d.action.value, d.engine_id, d.reason.value, list(d.scores.items())])
        if d.placed:
            in_flight[req.request_id] = (req, d.engine_id)
            if req.session_id is not None:
                busy.add(req.session_id)

    for _ in range(n_ops):
        now += rng.expovariate(8.0)
        r = rng.random()
        if r < 0.45:
            idle = [s for s in session_prompt if s not in busy]
            n += 1
            if idle and rng.random() < 0.6:
                sid = rng.choice(idle)
                prompt = session_prompt[sid]
                if rng.random() < 0.1:  # the agent rewrote (compacted) its history
                    del prompt[rng.randint(0, len(prompt)):]
                prompt.extend(gen.fresh(rng.randint(10, 700)))
                session_turn[sid] += 1
                req = RequestMeta(f"r{n}", "agentic", session_id=sid, turn=session_turn[sid],
                                  prompt_token_ids=tuple(prompt), prompt_tokens=len(prompt))
            else:
                cls = rng.choice(["agentic", "rlvr", "rlhf"])
                ids = gen.next()
                new_sid = f"s{n}" if cls == "agentic" else None
                if new_sid is not None:
                    session_prompt[new_sid] = list(ids)
                    session_turn[new_sid] = 0
                if cls == "rlhf" and rng.random() < 0.5:
                    req = RequestMeta(f"r{n}", cls, prompt_text=_text(ids), prompt_tokens=len(ids) // 4)
                else:
                    req = RequestMeta(f"r{n}", cls, session_id=new_sid, prompt_token_ids=ids,
                                      prompt_tokens=len(ids))
            note(req, runner.submit(req, engines, now))
        elif r < 0.8 and in_flight:
            rid = rng.choice(sorted(in_flight))
            req, w = in_flight.pop(rid)
            cached = rng.randint(0, req.prompt_tokens)
            if w in hits:
                hits[w] += cached
                queries[w] += req.prompt_tokens
            runner.finish(req, w, Completion(req.prompt_tokens, rng.randint(5, 500), cached, ok=rng.random() > 0.03),
                          now)
            if req.session_id is not None:
                busy.discard(req.session_id)
                if rng.random() < 0.15:
                    runner.end_session(req.session_id, now)
                    session_prompt.pop(req.session_id, None)
        elif r < 0.9:
            engines = snapshots()
            runner.on_metrics(engines, now)
        elif r < 0.985:
            for req, d in runner.epoch(engines, now):
                note(req, d)
        elif r < 0.993 and len(alive) > 2:
            gone = rng.choice(alive)
            alive.remove(gone)
            runner.remove_engine(gone, now)
            engines = snapshots()
            out.append(["removed", gone])
        elif r < 0.996:
            runner.reset_prefix_caches(now)
            out.append(["reset"])
        else:
            alive = list(pool)
            engines = snapshots()
            runner.on_metrics(engines, now)
            out.append(["restored"])
    out.append(["describe", json.loads(json.dumps(runner.policy.describe(), sort_keys=True))])
    if inspect is not None:
        inspect(runner)
    return out


# ---- the cases ----------------------------------------------------------------

def _small(rng: random.Random) -> Prompts:
    """Tiny alphabet, short runs: many equal first symbols, splits at every position."""
    return Prompts(rng, 3, [0, 2, 5], (0, 6), 40)


def _mid(rng: random.Random) -> Prompts:
    return Prompts(rng, 40, [0, 30, 100, 250], (1, 120), 900)


def _long(rng: random.Random) -> Prompts:
    """Agentic sizes: 2K-40K tokens with long shared system prompts."""
    return Prompts(rng, 50_000, [0, 2000, 6000], (50, 6000), 40_000)


CASES: dict[str, Callable[[], Record]] = {
    "radix-small": lambda: radix_case(1, 700, _small, False, (0, 30)),
    "radix-mid": lambda: radix_case(2, 500, _mid, False, (0, 3000)),
    "radix-long": lambda: radix_case(3, 160, _long, False, (5000, 120_000)),
    "radix-text-small": lambda: radix_case(4, 500, _small, True, (0, 30)),
    "radix-text-mid": lambda: radix_case(5, 300, _mid, True, (0, 3000)),
    "index-small": lambda: index_case(6, 600, _small, PrefixIndexSettings(block_size=2, text_chunk_chars=3), (1, 30)),
    "index-mid": lambda: index_case(7, 500, _mid, PrefixIndexSettings(block_size=4, text_chunk_chars=8), (1, 400)),
    "index-long": lambda: index_case(8, 200, _long, PrefixIndexSettings(block_size=16), (200, 8000)),
}
for _seed, _name in enumerate(
    (PolicyName.CACHE_AWARE, PolicyName.MISA_T, PolicyName.MISA, PolicyName.SESSION_ADMISSION), start=20
):
    CASES[f"policy-{_name.value}"] = functools.partial(policy_case, _name, _seed, 900, 4, 60_000)


def generate() -> dict[str, Record]:
    return {name: make() for name, make in CASES.items()}


def _canonical(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def digest(answer: Record) -> str:
    """``kind:digest`` of one operation's answer (the kind is the first field, or a decision)."""
    kind = answer[0] if answer and answer[0] in _KINDS else "decision"
    return f"{kind}:{hashlib.blake2b(_canonical(answer).encode(), digest_size=4).hexdigest()}"


_KINDS = {"ins", "ins2", "keys", "match", "evict", "remove", "shape", "match+ins", "limit", "clear", "final",
          "removed", "reset", "restored", "describe"}


@pytest.fixture(scope="module")
def golden() -> dict[str, list[str]]:
    return json.loads(GOLDEN.read_text())["cases"]


@pytest.mark.parametrize("case", list(CASES))
def test_answers_match_the_golden_record(case: str, golden: dict[str, list[str]]) -> None:
    got = CASES[case]()
    want = golden[case]
    for i, (answer, recorded) in enumerate(zip(got, want, strict=False)):
        assert digest(answer) == recorded, f"{case}: operation {i} answered differently, now: {answer!r:.2000}"
    assert len(got) == len(want), f"{case}: {len(got)} operations, the record has {len(want)}"


@pytest.mark.parametrize("bound", [0, 5000, 1 << 21])
@pytest.mark.parametrize("name", [PolicyName.MISA_T, PolicyName.SESSION_ADMISSION], ids=lambda n: n.value)
def test_reusing_last_prompts_keys_changes_no_decision(
    name: PolicyName, bound: int, golden: dict[str, list[str]]
) -> None:
    """MISA keeps each session's last prompt keys for its next turn, within a bound on the
    symbols kept: none kept (bound 0), some dropped (5000) or all kept answers as the record."""
    from misat_router.policy import misa

    seen: list[int] = []

    def within_bound(runner: PolicyRunner) -> None:
        policy = runner.policy
        assert isinstance(policy, misa.MisaPolicy)
        kept = policy._last_prompt
        assert policy._last_prompt_symbols == sum(k.symbols for k in kept.values()) <= bound
        assert set(kept) <= set(runner.sessions), "an ended session's prompt is kept"
        seen.append(len(kept))

    seed = {PolicyName.MISA_T: 21, PolicyName.SESSION_ADMISSION: 23}[name]
    got = [digest(a) for a in policy_case(name, seed, 900, 4, 60_000, within_bound, bound)]
    assert got == golden[f"policy-{name.value}"]
    assert seen


_WITH_REFERENCE = """
import importlib.util, runpy, sys
from pathlib import Path
import misat_router.policy
directory, module = Path(sys.argv[1]), sys.argv[2]
for mod in ("radix_tree", "prefix_index", "cache_aware", "misa"):
    if (directory / f"{mod}.py").exists():
        name = f"misat_router.policy.{mod}"
        spec = importlib.util.spec_from_file_location(name, directory / f"{mod}.py")
        m = importlib.util.module_from_spec(spec)
        sys.modules[name] = m
        spec.loader.exec_module(m)
sys.argv = [module, "--write"]
runpy.run_path(module, run_name="__main__")
"""


def main(argv: list[str]) -> None:
    """``--write``: record what this checkout's policy modules answer; ``--write --reference
    DIR``: what the ``radix_tree``/``prefix_index``/``cache_aware``/``misa`` files in DIR answer
    (e.g. ``git show <commit>:router/policy/<name>.py`` copies), the rest from the checkout."""
    if argv[:1] != ["--write"] or len(argv) not in (1, 3) or (len(argv) == 3 and argv[1] != "--reference"):
        raise SystemExit("usage: python -P tests/policy/test_prefix_golden.py --write [--reference DIR]")
    if len(argv) == 3:
        import subprocess

        subprocess.run([sys.executable, "-P", "-c", _WITH_REFERENCE, argv[2], __file__], check=True)
        return
    import misat_router.policy.prefix_index as used

    GOLDEN.parent.mkdir(exist_ok=True)
    cases = {name: [digest(a) for a in answers] for name, answers in generate().items()}
    GOLDEN.write_text(json.dumps({"version": 1, "cases": cases}, indent=0) + "\n")
    print(f"wrote {GOLDEN} ({GOLDEN.stat().st_size} bytes) with {Path(used.__file__).parent}")


if __name__ == "__main__":
    main(sys.argv[1:])
