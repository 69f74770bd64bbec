"""Seeded logprobs for simulated output tokens.

The engine model draws output tokens uniformly (``misat_sim.request``); it has
no logits. For clients that read logprobs (RL trainers compute importance
ratios from them) each output position gets a made-up next-token distribution
that is deterministic, valid and consistent with the token the engine emitted:

- ``RANKS`` candidates per position with probabilities from stick breaking (each
  takes a share of what is left), sorted: they sum below 1, so every logprob is
  < 0 and the remaining mass is the rest of the vocabulary;
- the emitted token takes one rank: rank 1 for greedy requests (temperature 0),
  else a rank drawn from those probabilities, capped by ``top_k`` when set;
- the other ranks are distinct regular token ids other than the emitted one.

``PositionLogprobs.ranked`` is vLLM's per-position order: the sampled token
first, then the top ``k`` by rank (the sampled one once), so a response builder
takes what vLLM's serving code takes from its dict. Values do not depend on
``k``: asking for more top logprobs shows more of the same distribution.

A ``LogprobModel`` walks one output sequence in order; its seed comes from the
engine seed, the prompt and the sample (``seed_for``), so the same request on
the same engine gets the same logprobs.
"""

from __future__ import annotations

import math
import random
import zlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from misat_sim.openai_protocol import MAX_LOGPROBS
from misat_sim.request import FIRST_REGULAR_TOKEN_ID

RANKS: int = MAX_LOGPROBS + 1
"""Candidates modelled per position: every rank a request may see, plus one for a sampled
token outside the largest top-k."""
SHARE_LOW: float = 0.2
SHARE_HIGH: float = 0.8
"""Each candidate takes a uniform share in [low, high) of the probability mass left."""


def seed_for(engine_seed: int, prompt: Sequence[int], sample: int) -> int:
    """A stable seed (across processes: no ``hash()``) of one output sequence."""
    digest = zlib.crc32(array("q", prompt).tobytes())
    return (engine_seed * 1_000_003 + digest) * 65_537 + sample


@dataclass(frozen=True, slots=True)
class PositionLogprobs:
    """One output position: the emitted token's logprob and the top candidates in rank order."""

    token_id: int
    logprob: float
    rank: int
    """1-based rank of the emitted token among the candidates."""
    top: tuple[tuple[int, float], ...]
    """(token id, logprob) by descending logprob; the emitted token at ``rank`` if it is
    within the candidates."""

    def ranked(self, k: int) -> list[tuple[int, float]]:
        """vLLM's order for ``k`` top logprobs: sampled first, then the top ``k`` without it."""
        out = [(self.token_id, self.logprob)]
        out.extend(c for c in self.top[:k] if c[0] != self.token_id)
        return out


class LogprobModel:
    """The logprobs of one output sequence, position by position (see the module docstring)."""

    def __init__(self, seed: int, vocab_size: int, *, greedy: bool, top_k: int | None) -> None:
        self._rng = random.Random(seed)
        self._low = FIRST_REGULAR_TOKEN_ID
        self._span = vocab_size - FIRST_REGULAR_TOKEN_ID
        self._greedy = greedy
        self._top_k = top_k if top_k is not None and top_k > 0 else None

    def next(self, token_id: int) -> PositionLogprobs:
        """The logprobs at the next position, where the engine emitted ``token_id``."""
        rng = self._rng
        left = 1.0
        probs = []
        for _ in range(RANKS):
            p = left * rng.uniform(SHARE_LOW, SHARE_HIGH)
            probs.append(p)
            left -= p
        probs.sort(reverse=True)
        if self._greedy:
            rank = 1
        else:
            rank = 1 + _draw(rng, probs)
            if self._top_k is not None:
                rank = min(rank, self._top_k)
        ids: list[int] = []
        seen = {token_id}
        while len(ids) < RANKS - 1 and len(seen) < self._span + 1:
            t = self._low + rng.randrange(self._span)
            if t not in seen:
                seen.add(t)
                ids.append(t)
        rank = min(rank, len(ids) + 1)  # a vocabulary smaller than RANKS has fewer candidates
        ids.insert(rank - 1, token_id)
        top = tuple((t, math.log(p)) for t, p in zip(ids, probs, strict=False))
        return PositionLogprobs(token_id, math.log(probs[rank - 1]), rank, top)


def _draw(rng: random.Random, probs: Sequence[float]) -> int:
    """An index drawn in proportion to ``probs`` (their sum need not be 1)."""
    x = rng.random() * sum(probs)
    for i, p in enumerate(probs):
        x -= p
        if x < 0:
            return i
    return len(probs) - 1
