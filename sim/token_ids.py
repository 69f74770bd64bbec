"""Token ids drawn in bulk from a seeded stream: prompts and outputs alike.

An id is ``low + x % span`` for each 32-bit word ``x`` of the stream's bytes
(``random.Random.randbytes``, read in the machine's byte order), so the ids
are a pure function of the generator's state. They come out of a table of
``int`` objects, one per id of the vocabulary, rather than as a new ``int``
per token. Why (speed and memory only; the values are those of the formula,
and nothing reads an id's identity):
- building an ``int`` per token was a large part of a prompt's cost (a
  full-length agentic context runs to 100K tokens and is re-sent every turn);
- ids that are the same object compare by identity, so the router's prefix
  tree finds where a session's growing prompt and its edges part without
  comparing values;
- a context held by the workload, the engines and the tree costs a pointer a
  token, not an ``int`` object each (a full-length run's peak fell 3.8x).

NumPy would draw long runs about 4x faster (measured: 3-4% of a 1/16-length
cluster run, 16-18% at full length), not enough to make it a dependency of
the base package. The modulo's bias (at most ``span / 2**32``) is far below
anything a hit rate can show.
"""

from __future__ import annotations

import functools
import random
from array import array

_TABLES_KEPT = 16
"""Id tables cached (one per vocabulary and EOS rule; a run uses one or two)."""


@functools.lru_cache(maxsize=_TABLES_KEPT)
def _id_table(low: int, span: int, avoid: int | None) -> tuple[int, ...]:
    """The ids of ``[low, low + span)`` as shared objects, ``avoid`` (if in range) mapped to ``low``."""
    ids = list(range(low, low + span))
    if avoid is not None and low <= avoid < low + span:
        ids[avoid - low] = ids[0]
    return tuple(ids)


def draw_token_ids(rng: random.Random, n: int, low: int, span: int, avoid: int | None = None) -> list[int]:
    """``n`` ids in ``[low, low + span)`` from ``rng``'s next ``4 * n`` bytes.

    ``avoid`` (an EOS id a sampler must not emit before its stop position) is
    replaced by ``low``, as the per-token rule ``v if v != avoid else low`` does.
    """
    if span < 1:
        raise ValueError(f"span must be at least 1, got {span}")
    ids = _id_table(low, span, avoid)
    return [ids[x % span] for x in array("I", rng.randbytes(4 * n))]
