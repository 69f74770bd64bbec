"""The router's prefix index: block-chained keys, bitmask matching, LRU trimming."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from misat_router.policy.prefix_index import PrefixIndex, PromptKeys, prompt_keys, token_block_keys
from misat_router.policy.settings import PrefixIndexSettings
from misat_router.policy.types import RequestMeta

S = PrefixIndexSettings(block_size=4, text_chunk_chars=8, chars_per_token=4.0)


def keys(ids: list[int]) -> PromptKeys:
    return prompt_keys(RequestMeta("r", "c", prompt_token_ids=tuple(ids)), S)


def test_only_full_blocks_are_keyed_and_keys_chain() -> None:
    assert token_block_keys(tuple(range(3)), 4) == ()
    a = token_block_keys((1, 2, 3, 4, 5, 6, 7, 8), 4)
    b = token_block_keys((9, 9, 9, 9, 5, 6, 7, 8), 4)
    assert len(a) == 2 and a[1] != b[1], "same block after a different parent must differ"


def test_match_counts_leading_blocks_per_engine() -> None:
    idx = PrefixIndex(S)
    idx.insert(keys(list(range(12))), "a")
    idx.insert(keys(list(range(8)) + [99, 99, 99, 99]), "b")
    got = idx.match(keys(list(range(16))), ["a", "b", "c"])
    assert got == {"a": 12.0, "b": 8.0, "c": 0.0}


def test_lru_trim_drops_oldest_keys_of_that_engine_only() -> None:
    idx = PrefixIndex(S)
    idx.insert(keys([1] * 8), "a")
    idx.insert(keys([1] * 8), "b")
    idx.insert(keys([2] * 8), "a")
    idx.set_limit("a", 2)
    assert idx.size("a") == 2
    assert idx.match(keys([1] * 8), ["a", "b"]) == {"a": 0.0, "b": 8.0}
    assert idx.match(keys([2] * 8), ["a"]) == {"a": 8.0}


def test_text_prompts_match_in_chunks_converted_to_tokens() -> None:
    idx = PrefixIndex(S)
    text = "system: you are a helpful agent. user: fix the failing test please"
    idx.insert(prompt_keys(RequestMeta("r", "c", prompt_text=text), S), "a")
    probe = prompt_keys(RequestMeta("r2", "c", prompt_text=text[:40] + " something else entirely"), S)
    assert idx.match(probe, ["a"])["a"] == 40 / 8 * 8 / 4.0  # 5 chunks of 8 chars, 2 tokens each


def test_clear_and_remove_engine_free_keys() -> None:
    idx = PrefixIndex(S)
    idx.insert(keys(list(range(8))), "a")
    idx.insert(keys(list(range(8))), "b")
    idx.remove_engine("a")
    assert idx.match(keys(list(range(8))), ["a", "b"]) == {"a": 0.0, "b": 8.0}
    idx.insert(keys(list(range(8))), "c")  # reuses a's bit
    idx.clear()
    assert idx.match(keys(list(range(8))), ["b", "c"]) == {"b": 0.0, "c": 0.0}


@settings(max_examples=200, deadline=None)
@given(
    inserts=st.lists(
        st.tuples(st.sampled_from("abc"), st.lists(st.integers(0, 3), max_size=24)), max_size=12
    ),
    probe=st.lists(st.integers(0, 3), max_size=24),
)
def test_match_equals_longest_common_full_block_prefix(inserts: list, probe: list[int]) -> None:
    idx = PrefixIndex(S)
    for engine, ids in inserts:
        idx.insert(keys(ids), engine)
    got = idx.match(keys(probe), ["a", "b", "c"])
    for engine in "abc":
        best = 0
        for e, ids in inserts:
            if e != engine:
                continue
            n = 0
            while n < min(len(ids), len(probe)) and ids[n] == probe[n]:
                n += 1
            best = max(best, (n // 4) * 4)
        assert got[engine] == best


# ---- keys carried over from a session's last prompt ---------------------------------

@settings(max_examples=300, deadline=None)
@given(
    prev=st.lists(st.integers(0, 2), max_size=40),
    keep=st.integers(0, 40),
    tail=st.lists(st.integers(0, 2), max_size=20),
    block=st.integers(1, 5),
    computed=st.integers(0, 12),
    text=st.booleans(),
)
def test_keys_continued_from_an_earlier_prompt_equal_fresh_ones(
    prev: list[int], keep: int, tail: list[int], block: int, computed: int, text: bool
) -> None:
    s = PrefixIndexSettings(block_size=block, text_chunk_chars=block, chars_per_token=1.0)
    new = prev[:keep] + tail

    def req(ids: list[int]) -> RequestMeta:
        if text:
            return RequestMeta("r", "c", prompt_text="".join("xyz"[i] for i in ids))
        return RequestMeta("r", "c", prompt_token_ids=tuple(ids))

    earlier = prompt_keys(req(prev), s)
    earlier._extend(computed)  # an earlier prompt may have been matched only part of the way
    continued = prompt_keys(req(new), s, earlier)
    fresh = prompt_keys(req(new), s)
    assert continued.keys == fresh.keys
    lcp = 0
    while lcp < min(len(prev), len(new)) and prev[lcp] == new[lcp]:
        lcp += 1
    assert len(continued) == len(fresh)
    reused = prompt_keys(req(new), s).continue_from(earlier)
    assert reused == min(lcp // block, min(computed, len(earlier)), len(new) // block)


def test_keys_are_not_continued_across_kinds_or_block_sizes() -> None:
    ids = tuple(range(32))
    tokens = prompt_keys(RequestMeta("r", "c", prompt_token_ids=ids), S)
    assert tokens.keys
    other = PrefixIndexSettings(block_size=8, text_chunk_chars=8, chars_per_token=4.0)
    assert prompt_keys(RequestMeta("r", "c", prompt_token_ids=ids), other).continue_from(tokens) == 0
    text = prompt_keys(RequestMeta("r", "c", prompt_text="x" * 32), S)
    assert text.continue_from(tokens) == 0
    started = prompt_keys(RequestMeta("r", "c", prompt_token_ids=ids), S)
    started._extend(1)
    assert started.continue_from(tokens) == 0, "only before any key is computed"
    assert started.keys == tokens.keys


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from("ab"), st.integers(0, 5), st.integers(0, 6), st.integers(0, 3)), max_size=25
    ),
    limit=st.integers(2, 12),
)
def test_insert_keeps_each_engines_keys_in_recency_order(ops: list, limit: int) -> None:
    # Prompts grow from a few stems (a session's turns: the engine holds a head of the next
    # prompt) or differ early; the index must order an engine's keys as "take the prompt's keys
    # out, append them in prompt order, trim the oldest", whichever path an insert takes.
    stems = [[s] * 4 + list(range(10 * s, 10 * s + 24)) for s in range(6)]
    idx = PrefixIndex(S)
    want: dict[str, list[int]] = {}
    for engine, stem, blocks, noise in ops:
        ids = stems[stem][: 4 * (1 + blocks)] + [noise] * (4 if noise else 0)
        k = keys(ids)
        seq = list(k.keys)
        idx.insert(k, engine)
        idx.set_limit(engine, limit)
        order = [key for key in want.get(engine, []) if key not in seq] + seq
        want[engine] = order[max(0, len(order) - limit):]
        assert list(idx._lru.get(engine, {})) == want[engine]
    for engine, held in want.items():
        bit = 1 << idx._bit[engine]
        assert {key for key, mask in idx._owners.items() if mask & bit} == set(held)


# ---- inserts put off until the request is on its way -----------------------------------

LONG = PrefixIndexSettings(block_size=1, text_chunk_chars=8, chars_per_token=4.0)


def long_keys(ids: list[int]) -> PromptKeys:
    return prompt_keys(RequestMeta("r", "c", prompt_token_ids=tuple(ids)), LONG)


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["later", "now", "match", "limit", "clear", "remove"]), st.sampled_from("abc"),
                  st.integers(0, 3), st.integers(0, 200), st.integers(0, 3)),
        max_size=20,
    ),
)
def test_put_off_inserts_answer_as_immediate_ones(ops: list) -> None:
    # Prompts of up to 200 one-token blocks from four stems: a match walks several of its
    # doubling chunks of keys before it leaves an engine's keys, or stops in the first.
    stems = [[s] * 3 + list(range(1000 * s, 1000 * s + 200)) for s in range(4)]
    lazy, eager = PrefixIndex(LONG), PrefixIndex(LONG)
    for op, engine, stem, length, noise in ops:
        ids = stems[stem][:length] + [noise] * noise
        if op in ("later", "now"):
            (lazy.insert_later if op == "later" else lazy.insert)(long_keys(ids), engine)
            eager.insert(long_keys(ids), engine)
        elif op == "match":
            assert lazy.match(long_keys(ids), "abc") == eager.match(long_keys(ids), "abc")
        elif op == "limit":
            lazy.set_limit(engine, length + 1)
            eager.set_limit(engine, length + 1)
        elif op == "clear":
            lazy.clear(engine)
            eager.clear(engine)
        else:
            lazy.remove_engine(engine)
            eager.remove_engine(engine)
        assert lazy.sizes() == eager.sizes() and lazy.limits() == eager.limits()
    lazy.flush()
    assert {e: list(lru) for e, lru in lazy._lru.items()} == {e: list(lru) for e, lru in eager._lru.items()}
    assert lazy._owners == eager._owners


def test_a_match_computes_keys_only_as_far_as_some_engine_holds_them() -> None:
    idx = PrefixIndex(LONG)
    shared = list(range(100))
    idx.insert(long_keys(shared + [7] * 100), "a")
    cold = long_keys([5] * 1000)
    assert idx.match(cold, ["a"]) == {"a": 0.0}
    assert len(cold._keys) < 100, "a prompt no engine holds needs its chain's first chunk only"
    warm = long_keys(shared + [9] * 900)
    assert idx.match(warm, ["a"]) == {"a": 100.0}
    assert 100 < len(warm._keys) < 1000, "keys past the walk's end are left to the insert"
    idx.insert_later(warm, "b")
    assert len(warm._keys) < 1000
    assert idx.match(long_keys(shared + [9] * 900), ["a", "b"]) == {"a": 100.0, "b": 1000.0}
