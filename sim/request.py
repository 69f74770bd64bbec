"""One request inside the engine model: its tokens, progress, blocks and timestamps.

Generated tokens are a seeded function of (engine seed, prompt, sample index),
so a run is reproducible and a preempted request regenerates nothing (vLLM
keeps output tokens across a recompute preemption, and so do we). They are
produced lazily from one ``random.Random`` per request: the engine advances a
counter per decode step and only materialises ids when a block fills (its
hash needs them) or a caller asks for them; the first such need draws every
id up to the request's stop length at once.

Discarded outputs: a caller that will never read a request's output ids (the
in-process cluster, for a session's last turn) says so at ``add_request``, and
they are never drawn. A block that holds any of them is then keyed by a number
no ``hash()`` can return (hashes are 64-bit; these count up from 2**64), one
per block. Nothing can hit such a block, as nothing could have hit the block of
random output ids it stands for once no later prompt contains them; it is
cached, evicted and counted as before, and a preempted request's recompute
finds its own blocks by the same keys.

EOS: a randomly initialised model emits its EOS id with probability about
``1 / vocab_size`` per token, so without ``ignore_eos`` the stop position is
drawn once, when the request is created, from the geometric distribution with
that parameter; the token there is the EOS id and no earlier token is. With
``ignore_eos`` the request runs to ``max_tokens`` (or ``max_model_len``).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from enum import StrEnum

from misat_sim.kv_cache import NONE_HASH, KVBlock
from misat_sim.token_ids import draw_token_ids

_DISCARDED_OUTPUT_KEYS = itertools.count(1 << 64)
"""Keys of blocks holding discarded outputs: above every value ``hash()`` returns, never reused."""

FIRST_REGULAR_TOKEN_ID: int = 3
"""Ids below this are special (pad/unk, BOS, EOS in a Llama vocabulary); never generated."""


class StepCounter:
    """The scheduler's count of steps run, shared by its requests.

    A request in steady decode is not touched per step (see ``Scheduler``):
    its token counts are a base plus the steps run since, read through this.
    """

    __slots__ = ("g",)

    def __init__(self) -> None:
        self.g = 0


_DETACHED = StepCounter()
"""Counter of requests not (yet) in a scheduler; they are never lazy."""


class RequestStatus(StrEnum):
    """Where a request is in the scheduler's state machine."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(StrEnum):
    """vLLM's finish reasons (the ``finished_reason`` label of request_success_total)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


def sample_stop_length(rng: random.Random, max_tokens: int, eos_probability: float) -> int:
    """Output length at which a sampled EOS appears (geometric), capped at ``max_tokens + 1``.

    A result above ``max_tokens`` means no EOS before the length limit.
    """
    u = rng.random()
    if eos_probability <= 0.0:
        return max_tokens + 1
    pos = 1 + int(math.log1p(-u) / math.log1p(-eos_probability))
    return min(pos, max_tokens + 1)


class SimRequest:
    """Mutable state of one request, shaped like vLLM's ``Request``."""

    __slots__ = (
        "_ahead",
        "_bg",
        "_block_hashes",
        "_clock",
        "_comp",
        "_discarded",
        "_ev",
        "_fin",
        "_out",
        "_rng",
        "arrival_time",
        "block_size",
        "blocks",
        "eos_token_id",
        "finish_reason",
        "finish_time",
        "first_scheduled_time",
        "first_token_time",
        "ignore_eos",
        "max_tokens",
        "num_cached_blocks",
        "num_cached_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "output_token_ids",
        "prompt_token_ids",
        "request_id",
        "run_seq",
        "status",
        "stop_length",
        "stops_on_eos",
        "token_high",
        "token_low",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        *,
        ignore_eos: bool,
        arrival_time: float,
        block_size: int,
        vocab_size: int,
        eos_token_id: int,
        token_seed: int,
        prompt_block_hashes: list[int] | None = None,
        discard_output_ids: bool = False,
    ) -> None:
        self.request_id = request_id
        self._discarded = discard_output_ids
        # A tuple: immutable and shared, so a caller's tuple is kept, not copied (full-length
        # agentic prompts run to 100K tokens, and every turn sends one).
        self.prompt_token_ids: tuple[int, ...] = tuple(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.max_tokens = max_tokens
        self.ignore_eos = ignore_eos
        self.arrival_time = arrival_time
        self.block_size = block_size
        self.eos_token_id = eos_token_id
        self.token_low = FIRST_REGULAR_TOKEN_ID
        self.token_high = vocab_size
        self._rng = random.Random(token_seed)
        stop = sample_stop_length(self._rng, max_tokens, 0.0 if ignore_eos else 1.0 / vocab_size)
        self.stops_on_eos = stop <= max_tokens
        self.stop_length = min(stop, max_tokens)
        self.output_token_ids: list[int] = []
        self._ahead: list[int] = []
        """Output ids drawn so far (``output_token_ids`` is the emitted part of it)."""
        self._out = 0
        self._comp = 0
        self._bg = -1
        """Step count at which lazy decode started; -1 while the counts are explicit."""
        self._clock = _DETACHED
        self._ev = -1
        """Step at which a lazy request needs explicit handling (a block fills or is needed)."""
        self._fin = -1
        """Step at which a lazy request finishes."""
        self.run_seq = -1
        """Admission number: running order is increasing ``run_seq``."""
        self.blocks: list[KVBlock] = []
        self.num_cached_blocks = 0
        self._block_hashes: list[int] = prompt_block_hashes if prompt_block_hashes is not None else []
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self.num_cached_tokens = -1
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.finish_reason: FinishReason | None = None

    @property
    def num_output_tokens(self) -> int:
        """Output tokens emitted so far (a lazy request's base plus the steps run since)."""
        bg = self._bg
        return self._out if bg < 0 else self._out + self._clock.g - bg

    @num_output_tokens.setter
    def num_output_tokens(self, value: int) -> None:
        if self._bg >= 0:
            raise RuntimeError("cannot set the counts of a request in lazy decode")
        self._out = value

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV is computed (a lazy request's base plus the steps run since)."""
        bg = self._bg
        return self._comp if bg < 0 else self._comp + self._clock.g - bg

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        if self._bg >= 0:
            raise RuntimeError("cannot set the counts of a request in lazy decode")
        self._comp = value

    @property
    def outputs_discarded(self) -> bool:
        """Whether the caller said it will never read the output ids (they are never drawn)."""
        return self._discarded

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far."""
        return self.num_prompt_tokens + self.num_output_tokens

    def materialize_outputs(self, upto: int | None = None) -> list[int]:
        """Generate output ids up to ``upto`` (default: all emitted so far); returns the list."""
        if self._discarded:
            raise RuntimeError(f"request {self.request_id!r} was added with discard_output_ids: its output "
                               "ids are never drawn")
        target = self.num_output_tokens if upto is None else min(upto, self.num_output_tokens)
        out = self.output_token_ids
        if target > len(out):
            ahead = self._ahead
            if target > len(ahead):
                # Every id up to the stop in one draw, not one per block as they are needed: the
                # stream is the same (it is this request's alone, and nothing else is drawn from it
                # after the stop length), and a draw's fixed cost is paid once (speed only).
                lo = self.token_low
                more = max(target, self.stop_length) - len(ahead)
                ahead.extend(draw_token_ids(self._rng, more, lo, self.token_high - lo, self.eos_token_id))
                if self.stops_on_eos and len(ahead) >= self.stop_length:
                    ahead[self.stop_length - 1] = self.eos_token_id
            out.extend(ahead[len(out) : target])
        return out

    def token_at(self, position: int) -> int:
        """Token id at ``position`` of prompt + output."""
        p = self.num_prompt_tokens
        if position < p:
            return self.prompt_token_ids[position]
        return self.materialize_outputs(position - p + 1)[position - p]

    def hashes_upto(self, n: int) -> list[int]:
        """The request's block-hash list with at least its first ``n`` hashes computed."""
        hashes = self._block_hashes
        if len(hashes) < n:
            self.block_hash(n - 1)
        return hashes

    def known_block_hashes(self) -> list[int]:
        """A copy of the chained hashes computed so far (leading full blocks)."""
        return list(self._block_hashes)

    def block_hash(self, index: int) -> int:
        """Chained hash of full block ``index`` (computed on demand, then kept)."""
        hashes = self._block_hashes
        if index < len(hashes):
            return hashes[index]
        bs = self.block_size
        p = self.num_prompt_tokens
        end = (index + 1) * bs
        if end > p and self._discarded:
            prompt_blocks = p // bs
            if len(hashes) < prompt_blocks:
                self.block_hash(prompt_blocks - 1)
            hashes.extend(next(_DISCARDED_OUTPUT_KEYS) for _ in range(len(hashes), index + 1))
            return hashes[index]
        if end > p:
            self.materialize_outputs(end - p)
        prompt = self.prompt_token_ids
        out = self.output_token_ids
        parent = hashes[-1] if hashes else NONE_HASH
        for i in range(len(hashes), index + 1):
            s, e = i * bs, (i + 1) * bs
            if e <= p:
                toks = tuple(prompt[s:e])
            elif s >= p:
                toks = tuple(out[s - p : e - p])
            else:
                toks = tuple(prompt[s:]) + tuple(out[: e - p])
            parent = hash((parent, toks))
            hashes.append(parent)
        return parent

    def __repr__(self) -> str:
        return (
            f"SimRequest({self.request_id!r}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}/{self.stop_length}, computed={self.num_computed_tokens}, "
            f"blocks={len(self.blocks)}, {self.status.value})"
        )
