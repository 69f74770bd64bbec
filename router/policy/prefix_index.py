"""The router's guess of what each engine's prefix cache holds.

vLLM keys its prefix cache by a chain of block hashes: block ``i`` of a prompt
is identified by the hash of (block ``i-1``'s key, block ``i``'s token ids),
and only full blocks are cached. This index keys prompts the same way, so
"how many prompt tokens would hit on engine w" is the number of leading keys
of the prompt that engine ``w`` was sent, times the block size.

Text prompts get the same treatment over fixed-size character chunks, in a
separate key space; a character match is converted to tokens with
``chars_per_token``. No tokeniser and no round trip to an engine is needed.

Layout, chosen for the decision path: one dict maps a key to a bitmask of the
engines that hold it, so matching a prompt against every engine is one walk
over the prompt's keys, not one per engine, and that walk runs in C (a running
AND of the owner masks, cut at the first key no engine holds). Each engine
keeps its keys in LRU order for trimming; inserting a prompt moves the keys
the engine already holds to the recent end (in C too) and touches the bitmask
dict only for keys new to the engine. Python steps per block are what made
the index the router's largest cost per request (docs/scale.md). A prompt's
keys are computed once (``PromptKeys``) for the decision and the insert after
it, and a session's next prompt can take the keys of the blocks it shares with
the last one (``PromptKeys.continue_from``) instead of hashing them again.
"""

from __future__ import annotations

# and_/or_/xor rather than the int slot methods: accumulate and map call them once per block, and a slot
# wrapper costs 2.5x a builtin there (6.7 against 3.0 us per 32-key match). From _operator, the C
# module behind the standard library's operator: this repository's operator/ folder (the
# misat_operator package) takes the plain name for tools run from its root (mypy).
from _operator import and_, or_, xor
from bisect import bisect_left
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Mapping
from itertools import accumulate, compress, count, islice, repeat, takewhile

from .radix_tree import common_prefix
from .settings import PrefixIndexSettings
from .types import RequestMeta

# Distinct chain seeds put token-id keys and text keys in different key spaces: a key of
# one equals a key of the other only by a 64-bit coincidence (every key carries its seed).
_TOKEN_CHAIN_SEED = 0x6D697361
_TEXT_CHAIN_SEED = 0x74657874


_BATCH = 32
"""Keys computed per extension of a lazy chain by its iterator (amortises the loop set-up), and
the first chunk of a match's walk."""
_MAX_PENDING = 256
"""Inserts queued by ``insert_later`` before it applies them itself: a caller that never flushes
(the simulated cluster, whose continuations read nothing) holds at most this many prompts."""


class PromptKeys:
    """The chained keys of one prompt, computed lazily, and how many tokens each stands for.

    Computed when first asked for (a continuation placed on its session's engine
    needs them only for the insert after it). Key ``i`` is the chain seed XOR the
    hashes of ``(j, block j's token ids...)`` (a text chunk: ``(j, chunk)``) for
    every ``j <= i``: it depends on every block
    before it and on where each sits, so equal blocks under different prefixes
    get different keys, as vLLM's chained block hashes do, and two prompts share
    key ``i`` only when they share blocks ``0..i`` (or on a 64-bit coincidence,
    which costs one wrong guess of a hit, never a wrong answer).

    The whole chain runs in C: a ``zip`` of a counter with the prompt's iterator
    repeated yields each block as a tuple tagged with its position, ``hash``
    maps it and ``accumulate`` XORs the running key. (A
    multiply-and-XOR chain needs a Python step per block, and that loop was
    the largest single cost of a decision, docs/scale.md.)
    """

    __slots__ = ("_blocks", "_count", "_keys", "_parent", "_seed", "_source", "_step", "tokens_per_key")

    def __init__(
        self, source: tuple[int, ...] | str, step: int, count: int, seed: int, tokens_per_key: float
    ) -> None:
        self._source = source
        self._step = step
        self._count = count
        self._seed = seed
        self._keys: list[int] = []
        self._parent = seed  # the last key computed (the chain seed before the first)
        self._blocks: Iterator[int] | None = None
        self.tokens_per_key = tokens_per_key

    def __len__(self) -> int:
        return self._count

    @property
    def symbols(self) -> int:
        """Length of the prompt (token ids or characters) these keys were cut from."""
        return len(self._source)

    def continue_from(self, previous: PromptKeys) -> int:
        """Take the keys of the blocks this prompt shares with ``previous`` (e.g. the prompt of
        the session's last turn) instead of hashing them again; returns how many.

        Exact: key ``i`` is a function of blocks ``0..i`` alone, and the shared blocks are
        found by comparing the prompts themselves. Only before any key is computed.
        """
        if (
            self._keys
            or previous._step != self._step
            or previous._seed != self._seed
            or type(previous._source) is not type(self._source)
        ):
            return 0
        shared = min(common_prefix(self._source, 0, previous._source) // self._step,
                     len(previous._keys), self._count)
        if shared:
            self._keys = previous._keys[:shared]
            self._parent = self._keys[-1]
        return shared

    def _extend(self, upto: int) -> None:
        keys = self._keys
        have = len(keys)
        n = min(upto, self._count) - have
        if n <= 0:
            return
        chain = self._blocks
        if chain is None:
            src, step = self._source, self._step
            tagged: Iterator[tuple[object, ...]]
            if isinstance(src, str):
                end = self._count * step
                tagged = zip(count(have), map(src.__getitem__, map(slice, range(have * step, end, step),
                                                                   range((have + 1) * step, end + step, step))))
            else:
                # One flat tuple per block, its position first: (j, t_0, ..., t_step-1). A partial
                # last block is dropped by zip. (A (j, block) pair built and hashed a second tuple
                # per block: 15% more time per token.)
                tagged = zip(count(have), *[iter(src[have * step:] if have else src)] * step, strict=False)
            chain = self._blocks = accumulate(map(hash, tagged), xor, initial=self._parent)
            next(chain)  # the initial value: the key before the first block computed here
        keys.extend(islice(chain, n))
        self._parent = keys[-1]
        if len(keys) == self._count:
            self._blocks = None  # done: drop the iterators

    def head(self, n: int) -> list[int]:
        """At least the first ``n`` keys, in order (computes the chain that far; fewer when the
        prompt has fewer); the list is the object's own."""
        if len(self._keys) < n:
            self._extend(n)
        return self._keys

    def _all(self) -> list[int]:
        """Every key, in order (computes the whole chain); the list is the object's own."""
        return self.head(self._count)

    def __iter__(self) -> Iterator[int]:
        i = 0
        keys = self._keys
        while i < self._count:
            if i >= len(keys):
                self._extend(i + _BATCH)
            yield keys[i]
            i += 1

    @property
    def keys(self) -> tuple[int, ...]:
        """Every key (computes the whole chain)."""
        return tuple(self._all())


def token_keys(token_ids: tuple[int, ...], block_size: int) -> PromptKeys:
    """Lazy chained keys of the full blocks of ``token_ids`` (a partial last block has no key).

    Blocks are hashed as tuples of the prompt's own ids, as the chain reaches them: no
    up-front conversion of the whole prompt, so a decision pays only for the blocks it walks.
    (Hashes of int tuples are not salted, so keys are the same in every process.)
    """
    return PromptKeys(token_ids, block_size, len(token_ids) // block_size, _TOKEN_CHAIN_SEED,
                      float(block_size))


def text_keys(text: str, chunk_chars: int, tokens_per_key: float) -> PromptKeys:
    """Lazy chained keys of the full ``chunk_chars``-character chunks of ``text``."""
    return PromptKeys(text, chunk_chars, len(text) // chunk_chars, _TEXT_CHAIN_SEED, tokens_per_key)


def token_block_keys(token_ids: tuple[int, ...], block_size: int) -> tuple[int, ...]:
    """All chained keys of the full blocks of ``token_ids``."""
    return token_keys(token_ids, block_size).keys


def prompt_keys(
    req: RequestMeta, settings: PrefixIndexSettings, previous: PromptKeys | None = None
) -> PromptKeys:
    """Keys of a request's prompt: token blocks when ids are known, else text chunks.

    ``previous``: keys of an earlier prompt (the session's last turn) whose shared leading
    blocks are taken rather than hashed again; the keys are the same either way.
    """
    if req.prompt_token_ids is not None:
        keys = token_keys(req.prompt_token_ids, settings.block_size)
    else:
        keys = text_keys(req.prompt_text or "", settings.text_chunk_chars,
                         settings.text_chunk_chars / settings.chars_per_token)
    if previous is not None:
        keys.continue_from(previous)
    return keys


class PrefixIndex:
    """Per-engine sets of prompt keys with LRU trimming, answering prefix-match queries."""

    def __init__(self, settings: PrefixIndexSettings) -> None:
        self.settings = settings
        self._owners: dict[int, int] = {}
        self._bit: dict[str, int] = {}
        self._engine_of_bit: dict[int, str] = {}
        self._lru: dict[str, OrderedDict[int, bool]] = {}
        self._limit: dict[str, int] = {}
        self._pending: list[tuple[PromptKeys, str]] = []

    def _bit_for(self, engine_id: str) -> int:
        bit = self._bit.get(engine_id)
        if bit is None:
            used = set(self._engine_of_bit)
            bit = next(i for i in range(len(used) + 1) if i not in used)
            self._bit[engine_id] = bit
            self._engine_of_bit[bit] = engine_id
            self._lru[engine_id] = OrderedDict()
        return bit

    def insert_later(self, keys: PromptKeys, engine_id: str) -> None:
        """``insert``, applied by ``flush`` or before anything reads or changes the index, in the
        order queued: no answer can tell the two apart. The router flushes once the request is
        on its way to the engine, so the insert (and the keys a decision did not need) costs
        the request no latency."""
        self._pending.append((keys, engine_id))
        if len(self._pending) >= _MAX_PENDING:
            self.flush()

    def flush(self) -> None:
        """Apply the queued inserts (every read and change of the index calls it first)."""
        pending = self._pending
        if pending:
            self._pending = []
            for keys, engine_id in pending:
                self._insert(keys, engine_id)

    def set_limit(self, engine_id: str, max_keys: int) -> None:
        """Bound one engine's keys (e.g. to its KV capacity in blocks); trims at once."""
        self.flush()
        self._limit[engine_id] = max(1, min(max_keys, self.settings.max_blocks_per_engine))
        if engine_id in self._bit:
            self._trim(engine_id)

    def match(self, keys: PromptKeys, engine_ids: Iterable[str]) -> dict[str, float]:
        """Expected prefix-hit tokens per engine (0 for engines that match nothing).

        One walk for all engines, in C: the running AND of the prompt's keys' owner masks
        (``accumulate``), cut at the first key no engine holds (``takewhile``). An engine's
        match length is where its bit leaves the running mask, found by bisection (the
        running masks only ever lose bits).
        """
        self.flush()
        result = dict.fromkeys(engine_ids, 0.0)
        total = len(keys)
        if not total:
            return result
        bits = self._bit
        alive = 0
        for e in result:
            bit = bits.get(e)
            if bit is not None:
                alive |= 1 << bit
        if not alive:
            return result
        # The walk needs keys only as far as some engine still holds them: computed in doubling
        # chunks, a prompt that leaves every engine's keys early (a new session's own tail)
        # leaves the rest of its chain to the insert.
        owner = self._owners.get
        running = [alive]
        done, upto = 0, min(total, _BATCH)
        while True:
            seq = keys.head(upto)
            part = list(takewhile(bool, accumulate(map(owner, islice(seq, done, upto), repeat(0)), and_,
                                                   initial=running[-1])))
            running += islice(part, 1, None)
            if len(part) <= upto - done or upto == total:
                break
            done, upto = upto, min(total, 2 * upto)
        last = len(running) - 1  # running[d]: the engines holding the prompt's first d keys
        if not last:
            return result
        tokens_per_key = keys.tokens_per_key
        end = running[last]
        for e in result:
            bit = bits.get(e)
            if bit is None:
                continue
            flag = 1 << bit
            if end & flag:
                depth = last
            elif running[1] & flag:
                depth = bisect_left(running, True, 2, last, key=lambda mask: not mask & flag) - 1
            else:
                continue
            result[e] = depth * tokens_per_key
        return result

    def insert(self, keys: PromptKeys, engine_id: str) -> None:
        """Record that ``engine_id`` was sent this prompt (its blocks become most recent).

        In C, as ``move_to_end`` key by key would leave it: the prompt's keys are taken out of
        the engine's LRU order and appended in prompt order; only keys new to the engine touch
        ``owners`` (a key in the engine's LRU already has the engine's bit there).
        """
        self.flush()
        self._insert(keys, engine_id)

    def _insert(self, keys: PromptKeys, engine_id: str) -> None:
        if not len(keys):
            return
        flag = 1 << self._bit_for(engine_id)
        lru = self._lru[engine_id]
        seq = keys._all()
        held = sum(map(lru.__contains__, seq)) if seq[0] in lru else 0
        if held == len(seq):  # a prompt the engine was sent before (a GRPO group, a retry)
            deque(map(lru.move_to_end, seq), maxlen=0)
            return
        if held and all(map(lru.__contains__, islice(seq, held))):
            # The keys the engine holds are a head of the prompt (a session's next turn): move
            # them to the recent end and append the rest, the same order as below in fewer steps.
            deque(map(lru.move_to_end, islice(seq, held)), maxlen=0)
            fresh = seq[held:]
            lru.update(zip(fresh, repeat(False)))
        else:
            new = list(map(lru.pop, seq, repeat(True)))  # True where the engine did not hold the key
            lru.update(zip(seq, repeat(False)))
            fresh = list(compress(seq, new))
        # The engine's bit on every key new to it, in C: owners[key] = owners.get(key, 0) | flag.
        owners = self._owners
        owners.update(zip(fresh, map(or_, map(owners.get, fresh, repeat(0)), repeat(flag)), strict=True))
        self._trim(engine_id)

    def _trim(self, engine_id: str) -> None:
        lru = self._lru[engine_id]
        limit = self._limit.get(engine_id, self.settings.max_blocks_per_engine)
        if len(lru) <= limit:
            return
        clear = ~(1 << self._bit[engine_id])
        owners = self._owners
        while len(lru) > limit:
            key, _ = lru.popitem(last=False)
            left = owners.get(key, 0) & clear
            if left:
                owners[key] = left
            else:
                owners.pop(key, None)

    def clear(self, engine_id: str | None = None) -> None:
        """Forget one engine's keys (or all), e.g. after a prefix-cache reset."""
        self.flush()
        for e in [engine_id] if engine_id is not None else list(self._lru):
            if e in self._lru:
                self._set_empty(e)

    def _set_empty(self, engine_id: str) -> None:
        clear = ~(1 << self._bit[engine_id])
        owners = self._owners
        for key in self._lru[engine_id]:
            left = owners.get(key, 0) & clear
            if left:
                owners[key] = left
            else:
                owners.pop(key, None)
        self._lru[engine_id].clear()

    def remove_engine(self, engine_id: str) -> None:
        """Drop an engine entirely; its bit becomes free for a later engine."""
        self.flush()
        if engine_id not in self._bit:
            return
        self._set_empty(engine_id)
        bit = self._bit.pop(engine_id)
        del self._engine_of_bit[bit]
        del self._lru[engine_id]
        self._limit.pop(engine_id, None)

    def size(self, engine_id: str) -> int:
        self.flush()
        lru = self._lru.get(engine_id)
        return len(lru) if lru is not None else 0

    def sizes(self) -> Mapping[str, int]:
        self.flush()
        return {e: len(lru) for e, lru in self._lru.items()}

    def limits(self) -> Mapping[str, int]:
        """Each engine's bound on keys (engines without a ``set_limit`` yet: the settings' cap)."""
        self.flush()
        return {e: self._limit.get(e, self.settings.max_blocks_per_engine) for e in self._lru}
