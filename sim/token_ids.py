"""Token ids drawn in bulk from a seeded stream: prompts and outputs alike.

An id is ``low + x % span`` for each 32-bit word ``x`` of the stream's bytes
(``random.Random.randbytes``, read in the machine's byte order), so the ids
are a pure function of the generator's state. The arithmetic runs in NumPy and
the ids come out of a table of ``int`` objects, one per id of the vocabulary.
Why (speed and memory only):
- building a Python ``int`` per token was most of a prompt's cost (a
  full-length agentic context runs to 100K tokens and is re-sent every turn);
- ids that are the same object compare by identity, so the router's prefix
  tree finds where a session's growing prompt and its edges part without
  comparing values;
- a context held by the workload, the engines and the tree costs a pointer a
  token, not an ``int`` object each (a full-length run's peak fell 3.7x).

The values are exactly those of the per-token formula; nothing reads an id's
identity. The modulo's bias (at most ``span / 2**32``) is far below anything a
hit rate can show.
"""

from __future__ import annotations

import functools
import random
from array import array

import numpy as np
import numpy.typing as npt

_TABLES_KEPT = 16
"""Id tables cached (one per vocabulary and EOS rule; a run uses one or two)."""

_BULK_MIN = 48
"""Draws of fewer ids than this take a plain loop over the table: NumPy's fixed cost per call
(about 2 us) is more than the loop's (about 45 ns an id) below it (speed only, same ids)."""


class _IdTable:
    """``low .. low + span - 1`` as shared ``int`` objects, as a list and as a NumPy object array."""

    __slots__ = ("array", "ids")

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids
        self.array: npt.NDArray[np.object_] = np.empty(len(ids), dtype=object)
        self.array[:] = ids


@functools.lru_cache(maxsize=_TABLES_KEPT)
def _id_table(low: int, span: int, avoid: int | None) -> _IdTable:
    """The ids of ``[low, low + span)``, ``avoid`` (if in range) mapped to ``low``."""
    ids = list(range(low, low + span))
    if avoid is not None and low <= avoid < low + span:
        ids[avoid - low] = ids[0]
    return _IdTable(ids)


def draw_token_ids(rng: random.Random, n: int, low: int, span: int, avoid: int | None = None) -> list[int]:
    """``n`` ids in ``[low, low + span)`` from ``rng``'s next ``4 * n`` bytes.

    ``avoid`` (an EOS id a sampler must not emit before its stop position) is
    replaced by ``low``, as the per-token rule ``v if v != avoid else low`` does.
    """
    if span < 1:
        raise ValueError(f"span must be at least 1, got {span}")
    table = _id_table(low, span, avoid)
    raw = rng.randbytes(4 * n)
    if n < _BULK_MIN:
        ids = table.ids
        return [ids[x % span] for x in array("I", raw)]
    drawn: list[int] = table.array[np.frombuffer(raw, dtype=np.uint32) % span].tolist()
    return drawn
