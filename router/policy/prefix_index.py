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

from array import array
from collections import OrderedDict
from collections.abc import Iterable, Mapping

from .settings import PrefixIndexSettings
from .types import RequestMeta

# Distinct chain seeds keep token-id keys and text keys from ever being equal
# by construction of the chain (the seed is the parent of the first block).
_TOKEN_CHAIN_SEED = 0x6D697361
_TEXT_CHAIN_SEED = 0x74657874


class PromptKeys:
    """The chained keys of one prompt and how many tokens each key stands for."""

    __slots__ = ("keys", "tokens_per_key")

    def __init__(self, keys: tuple[int, ...], tokens_per_key: float) -> None:
        self.keys = keys
        self.tokens_per_key = tokens_per_key


def token_block_keys(token_ids: tuple[int, ...], block_size: int) -> tuple[int, ...]:
    """Chained keys of the full blocks of ``token_ids`` (a partial last block has no key)."""
    n_full = len(token_ids) // block_size
    if n_full == 0:
        return ()
    # Hashing bytes slices is several times faster than hashing int tuples.
    packed = array("q", token_ids[: n_full * block_size])
    raw = packed.tobytes()
    step = block_size * packed.itemsize
    keys = []
    parent = _TOKEN_CHAIN_SEED
    for start in range(0, n_full * step, step):
        parent = hash((parent, raw[start : start + step]))
        keys.append(parent)
    return tuple(keys)


def text_chunk_keys(text: str, chunk_chars: int) -> tuple[int, ...]:
    """Chained keys of the full ``chunk_chars``-character chunks of ``text``."""
    keys = []
    parent = _TEXT_CHAIN_SEED
    for start in range(0, (len(text) // chunk_chars) * chunk_chars, chunk_chars):
        parent = hash((parent, text[start : start + chunk_chars]))
        keys.append(parent)
    return tuple(keys)


def prompt_keys(req: RequestMeta, settings: PrefixIndexSettings) -> PromptKeys:
    """Keys of a request's prompt: token blocks when ids are known, else text chunks."""
    if req.prompt_token_ids is not None:
        return PromptKeys(token_block_keys(req.prompt_token_ids, settings.block_size),
                          float(settings.block_size))
    if req.prompt_text:
        return PromptKeys(text_chunk_keys(req.prompt_text, settings.text_chunk_chars),
                          settings.text_chunk_chars / settings.chars_per_token)
    return PromptKeys((), 0.0)


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
        if not keys.keys:
            return result
        alive = 0
        for e in result:
            bit = self._bit.get(e)
            if bit is not None:
                alive |= 1 << bit
        owners = self._owners
        depth = 0
        for key in keys.keys:
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
        if not keys.keys:
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
