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
engines that hold it, so matching a prompt against every engine walks the
prompt's keys once, stopping when no engine still matches, instead of once
per engine. Each engine keeps its keys in LRU order for trimming.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping

from .settings import PrefixIndexSettings
from .types import RequestMeta

# Distinct chain seeds keep token-id keys and text keys from ever being equal
# by construction of the chain (the seed is the parent of the first block).
_TOKEN_CHAIN_SEED = 0x6D697361
_TEXT_CHAIN_SEED = 0x74657874


_CHAIN_MULTIPLIER = 0x100000001B3
_KEY_MASK = (1 << 64) - 1


_BATCH = 32
"""Keys computed per extension of a lazy chain (amortises the loop set-up)."""


class PromptKeys:
    """The chained keys of one prompt, computed lazily, and how many tokens each stands for.

    Matching usually stops at the first block no engine holds, so a decision
    hashes only the matched part of a long prompt; the rest is hashed when
    (and if) the prompt is inserted after placement. Key ``i`` depends on
    every block before it (``parent * M ^ hash(block)``), so equal blocks under
    different prefixes get different keys, as vLLM's chained block hashes do.
    """

    __slots__ = ("_computed", "_count", "_source", "_step", "tokens_per_key")

    def __init__(
        self, source: tuple[int, ...] | str, step: int, count: int, seed: int, tokens_per_key: float
    ) -> None:
        self._source = source
        self._step = step
        self._count = count
        self._computed: list[int] = [seed]  # index 0 is the chain seed, not a key
        self.tokens_per_key = tokens_per_key

    def __len__(self) -> int:
        return self._count

    def _extend(self, upto: int) -> None:
        computed, src, step = self._computed, self._source, self._step
        parent = computed[-1]
        append = computed.append
        first = len(computed) - 1
        for start in range(first * step, min(upto, self._count) * step, step):
            parent = ((parent * _CHAIN_MULTIPLIER) ^ hash(src[start : start + step])) & _KEY_MASK
            append(parent)

    def __iter__(self) -> Iterator[int]:
        i = 1
        computed = self._computed
        while i <= self._count:
            if i >= len(computed):
                self._extend(i - 1 + _BATCH)
            yield computed[i]
            i += 1

    @property
    def keys(self) -> tuple[int, ...]:
        """Every key (computes the whole chain)."""
        self._extend(self._count)
        return tuple(self._computed[1:])


def token_keys(token_ids: tuple[int, ...], block_size: int) -> PromptKeys:
    """Lazy chained keys of the full blocks of ``token_ids`` (a partial last block has no key).

    Blocks are hashed as tuple slices of the prompt itself: no up-front conversion of the
    whole prompt, so a decision pays only for the blocks it walks. (Hashes of int tuples are
    not salted, so keys are the same in every process.)
    """
    return PromptKeys(token_ids, block_size, len(token_ids) // block_size, _TOKEN_CHAIN_SEED,
                      float(block_size))


def text_keys(text: str, chunk_chars: int, tokens_per_key: float) -> PromptKeys:
    """Lazy chained keys of the full ``chunk_chars``-character chunks of ``text``."""
    return PromptKeys(text, chunk_chars, len(text) // chunk_chars, _TEXT_CHAIN_SEED, tokens_per_key)


def token_block_keys(token_ids: tuple[int, ...], block_size: int) -> tuple[int, ...]:
    """All chained keys of the full blocks of ``token_ids``."""
    return token_keys(token_ids, block_size).keys


def prompt_keys(req: RequestMeta, settings: PrefixIndexSettings) -> PromptKeys:
    """Keys of a request's prompt: token blocks when ids are known, else text chunks."""
    if req.prompt_token_ids is not None:
        return token_keys(req.prompt_token_ids, settings.block_size)
    return text_keys(req.prompt_text or "", settings.text_chunk_chars,
                     settings.text_chunk_chars / settings.chars_per_token)


class PrefixIndex:
    """Per-engine sets of prompt keys with LRU trimming, answering prefix-match queries."""

    def __init__(self, settings: PrefixIndexSettings) -> None:
        self.settings = settings
        self._owners: dict[int, int] = {}
        self._bit: dict[str, int] = {}
        self._engine_of_bit: dict[int, str] = {}
        self._lru: dict[str, OrderedDict[int, None]] = {}
        self._limit: dict[str, int] = {}

    def _bit_for(self, engine_id: str) -> int:
        bit = self._bit.get(engine_id)
        if bit is None:
            used = set(self._engine_of_bit)
            bit = next(i for i in range(len(used) + 1) if i not in used)
            self._bit[engine_id] = bit
            self._engine_of_bit[bit] = engine_id
            self._lru[engine_id] = OrderedDict()
        return bit

    def set_limit(self, engine_id: str, max_keys: int) -> None:
        """Bound one engine's keys (e.g. to its KV capacity in blocks); trims at once."""
        self._limit[engine_id] = max(1, min(max_keys, self.settings.max_blocks_per_engine))
        if engine_id in self._bit:
            self._trim(engine_id)

    def match(self, keys: PromptKeys, engine_ids: Iterable[str]) -> dict[str, float]:
        """Expected prefix-hit tokens per engine (0 for engines that match nothing)."""
        result = dict.fromkeys(engine_ids, 0.0)
        if not len(keys):
            return result
        alive = 0
        for e in result:
            bit = self._bit.get(e)
            if bit is not None:
                alive |= 1 << bit
        owners = self._owners
        depth = 0
        for key in keys:
            held = owners.get(key, 0) & alive
            dropped = alive & ~held
            if dropped:
                self._credit(result, dropped, depth * keys.tokens_per_key)
            alive = held
            if not alive:
                break
            depth += 1
        if alive:
            self._credit(result, alive, depth * keys.tokens_per_key)
        return result

    def _credit(self, result: dict[str, float], mask: int, tokens: float) -> None:
        if tokens <= 0:
            return
        while mask:
            low = mask & -mask
            result[self._engine_of_bit[low.bit_length() - 1]] = tokens
            mask ^= low

    def insert(self, keys: PromptKeys, engine_id: str) -> None:
        """Record that ``engine_id`` was sent this prompt (its blocks become most recent)."""
        if not len(keys):
            return
        flag = 1 << self._bit_for(engine_id)
        lru = self._lru[engine_id]
        owners = self._owners
        for key in keys.keys:
            owners[key] = owners.get(key, 0) | flag
            lru[key] = None
            lru.move_to_end(key)
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
        if engine_id not in self._bit:
            return
        self._set_empty(engine_id)
        bit = self._bit.pop(engine_id)
        del self._engine_of_bit[bit]
        del self._lru[engine_id]
        self._limit.pop(engine_id, None)

    def size(self, engine_id: str) -> int:
        lru = self._lru.get(engine_id)
        return len(lru) if lru is not None else 0

    def sizes(self) -> Mapping[str, int]:
        return {e: len(lru) for e, lru in self._lru.items()}

    def limits(self) -> Mapping[str, int]:
        """Each engine's bound on keys (engines without a ``set_limit`` yet: the settings' cap)."""
        return {e: self._limit.get(e, self.settings.max_blocks_per_engine) for e in self._lru}
