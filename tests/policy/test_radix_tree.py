"""The radix tree against a brute-force model of what each engine was given."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from misat_router.policy.radix_tree import RadixTree, text_tree, token_tree

ENGINES = ("a", "b", "c")

seqs = st.lists(st.integers(0, 3), max_size=12).map(tuple)
inserts = st.lists(st.tuples(st.sampled_from(ENGINES), seqs), max_size=25)


def _lcp(x: tuple[int, ...], y: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    return n


def _brute_match(held: dict[str, list[tuple[int, ...]]], query: tuple[int, ...]) -> dict[str, int]:
    out = {e: max((_lcp(query, s) for s in ss), default=0) for e, ss in held.items()}
    return {e: n for e, n in out.items() if n}


def _brute_size(ss: list[tuple[int, ...]]) -> int:
    """An uncompressed trie has one node per distinct non-empty prefix."""
    return len({s[:i] for s in ss for i in range(1, len(s) + 1)})


def _build(ops: list[tuple[str, tuple[int, ...]]]) -> tuple[RadixTree, dict[str, list]]:
    tree = token_tree()
    held: dict[str, list[tuple[int, ...]]] = {}
    for t, (engine, seq) in enumerate(ops):
        tree.insert(seq, engine, float(t))
        held.setdefault(engine, []).append(seq)
    return tree, held


@settings(max_examples=150, deadline=None)
@given(ops=inserts, query=seqs)
def test_match_is_longest_common_prefix_per_engine(ops, query) -> None:
    tree, held = _build(ops)
    assert tree.match(query) == _brute_match(held, query)


@settings(max_examples=150, deadline=None)
@given(ops=inserts)
def test_size_counts_distinct_prefix_symbols(ops) -> None:
    tree, held = _build(ops)
    for engine in ENGINES:
        assert tree.size(engine) == _brute_size(held.get(engine, []))


@settings(max_examples=100, deadline=None)
@given(ops=inserts, query=seqs, gone=st.sampled_from(ENGINES))
def test_remove_engine_forgets_only_that_engine(ops, query, gone) -> None:
    tree, held = _build(ops)
    tree.remove_engine(gone)
    held.pop(gone, None)
    assert tree.match(query) == _brute_match(held, query)
    assert tree.size(gone) == 0


@settings(max_examples=100, deadline=None)
@given(ops=inserts, query=seqs, bound=st.integers(0, 20))
def test_evict_bounds_every_engine_and_only_shrinks_matches(ops, query, bound) -> None:
    tree, _ = _build(ops)
    before_match = tree.match(query)
    before_size = {e: tree.size(e) for e in ENGINES}
    tree.evict(bound)
    after = tree.match(query)
    for engine in ENGINES:
        assert tree.size(engine) <= bound or before_size[engine] <= bound
        if before_size[engine] <= bound:
            assert tree.size(engine) == before_size[engine]
            assert after.get(engine) == before_match.get(engine)
        else:
            assert after.get(engine, 0) <= before_match.get(engine, 0)


@settings(max_examples=100, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(ENGINES), st.text("ab", max_size=10)), max_size=20),
       query=st.text("ab", max_size=10))
def test_text_tree_matches_characters(ops, query) -> None:
    tree = text_tree()
    held: dict[str, list[str]] = {}
    for t, (engine, s) in enumerate(ops):
        tree.insert(s, engine, float(t))
        held.setdefault(engine, []).append(s)
    expected = {
        e: max(len(_common(query, s)) for s in ss) for e, ss in held.items()
    }
    assert tree.match(query) == {e: n for e, n in expected.items() if n}


def _common(x: str, y: str) -> str:
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    return x[:n]


# ---- table-driven cases ---------------------------------------------------

@pytest.mark.parametrize(
    ("inserted", "bound", "survivors", "gone"),
    [
        pytest.param(
            [((1, 1, 1, 1), 1.0), ((2, 2, 2, 2), 2.0), ((3, 3, 3, 3), 3.0)], 8,
            [(2, 2, 2, 2), (3, 3, 3, 3)], [(1, 1, 1, 1)], id="oldest-disjoint-leaf-goes",
        ),
        pytest.param(
            [((1, 1, 1, 1), 3.0), ((2, 2, 2, 2), 2.0), ((3, 3, 3, 3), 1.0)], 8,
            [(1, 1, 1, 1), (2, 2, 2, 2)], [(3, 3, 3, 3)], id="lru-not-insertion-order",
        ),
        pytest.param(
            [((1, 2, 3, 4), 1.0), ((1, 2, 5, 6), 2.0)], 4,
            [(1, 2, 5, 6)], [(1, 2, 3, 4)], id="shared-prefix-keeps-trunk",
        ),
        pytest.param(
            [((1, 2, 3, 4), 1.0), ((9, 9), 2.0)], 2,
            [(9, 9)], [(1, 2, 3, 4)], id="leaf-then-parent-until-fits",
        ),
    ],
)
def test_evict_drops_least_recently_used_leaves(inserted, bound, survivors, gone) -> None:
    tree = token_tree()
    for seq, t in inserted:
        tree.insert(seq, "a", t)
    tree.evict(bound)
    assert tree.size("a") <= bound
    for seq in survivors:
        assert tree.match(seq)["a"] == len(seq)
    for seq in gone:
        assert tree.match(seq).get("a", 0) < len(seq)


def test_evict_is_per_engine() -> None:
    tree = token_tree()
    tree.insert((1, 2, 3, 4, 5, 6), "big", 1.0)
    tree.insert((1, 2, 3), "small", 0.0)
    tree.evict(3)
    assert tree.size("big") <= 3
    assert tree.size("small") == 3
    assert tree.match((1, 2, 3))["small"] == 3


def test_evict_drops_nodes_no_engine_holds() -> None:
    tree = token_tree()
    tree.insert((1, 2, 3), "a", 1.0)
    tree.insert((7, 8, 9), "a", 2.0)
    tree.evict(3)
    assert tree.node_count() == 1
    assert tree.match((1, 2, 3)) == {}


def test_reinsert_refreshes_access_time() -> None:
    tree = token_tree()
    tree.insert((1, 1), "a", 1.0)
    tree.insert((2, 2), "a", 2.0)
    tree.insert((1, 1), "a", 3.0)
    tree.evict(2)
    assert tree.match((1, 1)) == {"a": 2}
    assert tree.match((2, 2)) == {}


def test_equal_matches_listed_in_join_order() -> None:
    tree = token_tree()
    tree.insert((5, 6, 7), "z", 1.0)
    tree.insert((5, 6, 7), "a", 2.0)
    tree.insert((5, 6), "m", 3.0)
    assert list(tree.match((5, 6, 7, 8)).items()) == [("z", 3), ("a", 3), ("m", 2)]


def test_split_keeps_join_order() -> None:
    tree = token_tree()
    tree.insert((1, 2, 3, 4), "late", 1.0)
    tree.insert((1, 2, 9), "later", 2.0)
    assert list(tree.match((1, 2))) == ["late", "later"]


def test_long_prompts_share_one_path() -> None:
    tree = token_tree()
    base = tuple(range(4000))
    for i in range(50):
        tree.insert((*base, 10_000 + i), f"e{i % 8}", float(i))
    assert tree.node_count() == 51
    assert tree.match((*base, 10_003)) == {"e3": 4001, **{f"e{i}": 4000 for i in range(8) if i != 3}}


# ---- the divergence search and the match-then-insert path -----------------------

def _naive_common_prefix(a, a_start, b) -> int:
    n = 0
    while a_start + n < len(a) and n < len(b) and a[a_start + n] == b[n]:
        n += 1
    return n


@settings(max_examples=300, deadline=None)
@given(
    length=st.sampled_from([0, 1, 15, 16, 17, 100, 4095, 4096, 4097, 9000]),
    start=st.integers(0, 40),
    cut=st.integers(0, 9100),
    extra=st.integers(0, 3),
    text=st.booleans(),
)
def test_common_prefix_finds_the_first_difference(length, start, cut, extra, text) -> None:
    from misat_router.policy.radix_tree import common_prefix

    ids = tuple(range(length + start))
    other = ids[start:start + cut] + (-1,) * extra + ids[start + cut:]
    a: tuple[int, ...] | str = ids
    b: tuple[int, ...] | str = other
    if text:
        a, b = "".join(chr(65 + x % 50) for x in ids), "".join("~" if x < 0 else chr(65 + x % 50) for x in other)
    assert common_prefix(a, start, b) == _naive_common_prefix(a, start, b)
    assert common_prefix(a, len(a) + 3, b) == 0


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(ENGINES), seqs, st.sampled_from(["none", "evict", "remove", "other", "match"]),
                  seqs),
        max_size=25,
    ),
    query=seqs,
)
def test_insert_after_match_builds_the_same_tree(ops, query) -> None:
    """``insert`` reuses the path of a ``match`` of the same object; the tree is the one an
    insert alone builds, whatever changed the tree in between."""
    with_match, alone = token_tree(), token_tree()
    for t, (engine, seq, between, other) in enumerate(ops):
        with_match.match(seq)
        for tree in (with_match, alone):
            if between == "evict":
                tree.evict(6)
            elif between == "remove":
                tree.remove_engine(engine)
            elif between == "other":
                tree.insert(other, engine, float(t))
            elif between == "match" and tree is with_match:
                tree.match(other)
            tree.insert(seq, engine, float(t))
        assert with_match.sizes() == alone.sizes()
        assert list(with_match.match(query).items()) == list(alone.match(query).items())
    shape = [[(n.edge, list(n.access.items())) for n in tree._walk()] for tree in (with_match, alone)]
    assert shape[0] == shape[1]
