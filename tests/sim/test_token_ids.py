"""Token ids drawn in bulk: the per-token formula's values, shared objects, the stream's position."""

from __future__ import annotations

import random
from array import array

import pytest

from misat_sim.token_ids import draw_token_ids

LOW, SPAN = 3, 2045


def _per_token(rng: random.Random, n: int, low: int, span: int, avoid: int | None) -> list[int]:
    """The rule the bulk draw must reproduce, one id at a time."""
    out = []
    for x in array("I", rng.randbytes(4 * n)):
        v = low + x % span
        out.append(low if v == avoid else v)
    return out


# Short and long draws, and a full-length context.
@pytest.mark.parametrize("n", [0, 1, 47, 48, 49, 1000, 40_000])
@pytest.mark.parametrize("avoid", [None, 2, LOW, 1000, LOW + SPAN - 1, LOW + SPAN])
def test_ids_are_the_per_token_rule_of_the_same_stream(n: int, avoid: int | None):
    got = draw_token_ids(random.Random(f"k:{n}"), n, LOW, SPAN, avoid)
    assert got == _per_token(random.Random(f"k:{n}"), n, LOW, SPAN, avoid)
    assert all(type(v) is int for v in got)
    if avoid is not None and LOW < avoid < LOW + SPAN:  # (LOW itself is where it goes)
        assert avoid not in got


def test_the_stream_moves_on_as_far_as_the_per_token_rule_takes_it():
    bulk, single = random.Random(7), random.Random(7)
    for n in (5, 300, 48, 1):
        assert draw_token_ids(bulk, n, LOW, SPAN) == _per_token(single, n, LOW, SPAN, None)
    assert bulk.random() == single.random()


def test_equal_ids_are_one_object_across_draws():
    # What lets a re-sent context compare by identity and cost a pointer a token: the tree and
    # the engine see the same objects, whichever draw (prompt or output, short or long) made them.
    a = draw_token_ids(random.Random(1), 5_000, LOW, SPAN)
    b = draw_token_ids(random.Random(2), 20, LOW, SPAN)
    seen = {v: v for v in a}
    shared = [v for v in b if v in seen]
    assert shared
    assert all(seen[v] is v for v in shared)


def test_an_empty_vocabulary_is_refused():
    with pytest.raises(ValueError, match="span must be at least 1"):
        draw_token_ids(random.Random(0), 4, LOW, 0)
