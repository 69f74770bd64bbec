"""Paged KV cache with prefix caching, as vLLM V1's BlockPool keeps it.

Why it is shaped like this: admission policies are judged by prefix-hit rate,
and hit rate under pressure depends on exactly which cached blocks survive.
vLLM V1 (``vllm/v1/core/block_pool.py``, ``kv_cache_utils.py``) keeps:

- a fixed pool of blocks, block 0 reserved as the "null block" (never handed out);
- for each *full* block a chained hash ``hash(parent_hash, block_token_ids)``,
  so equal hashes mean equal whole prefixes, and a map hash -> cached block;
- reference counts: a block shared by several running requests is freed only
  when the last one lets go;
- one free queue holding every block with ref count 0, cached or not: freed
  blocks are appended at the tail (a request's blocks in reverse order, so its
  tail blocks go first), a new block is taken from the head, and taking a cached
  block from the head evicts it (drops its hash): least recently freed first;
- a cache hit on a free cached block takes it out of the free queue ("touch").

Cached-but-free blocks count as free for ``usage`` (``vllm:kv_cache_usage_perc``).

The free queue is an ``OrderedDict`` (insertion order = LRU order; O(1)
append, pop from the head and removal from the middle, in C). Hashes are
Python's ``hash`` of ``(parent_hash, tuple_of_ids)``: deterministic for ints
and tuples across runs, 64-bit, as vLLM's default ``builtin`` hash is.
Simplification: when a second block fills with a hash that is already cached
(two requests computed the same block concurrently), vLLM keeps both under the
hash; we keep the first only and leave the duplicate uncached.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Protocol

NONE_HASH: int = 0
"""Parent hash of a request's first block."""


def hash_block_tokens(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """Chained hash of one full block: equal results mean equal whole prefixes."""
    return hash((parent_hash, token_ids))


def block_hashes_for(
    token_ids: Sequence[int], block_size: int, start_block: int = 0, parent_hash: int = NONE_HASH
) -> list[int]:
    """Hashes of the full blocks of ``token_ids`` from block ``start_block`` on.

    Blocks are cut by ``zip`` over one iterator (tuples built in C), which
    halves the cost of hashing a long prompt; the values are those of
    ``hash_block_tokens``.
    """
    out: list[int] = []
    append = out.append
    parent = parent_hash
    n_full = len(token_ids) // block_size
    if n_full <= start_block:
        return out
    it = iter(token_ids[start_block * block_size : n_full * block_size])
    for toks in zip(*([it] * block_size), strict=True):
        parent = hash((parent, toks))
        append(parent)
    return out


class KVBlock:
    """One KV block: its id, how many requests hold it, its hash while cached."""

    __slots__ = ("block_hash", "block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class BlockPool:
    """All KV blocks of one engine, the LRU free queue and the prefix-cache map."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError("num_blocks must be at least 2 (one is the reserved null block)")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        # vLLM reserves the first block as the null block (padding for sliding windows).
        self.null_block = self._free.popitem(last=False)[1]
        self._cached: dict[int, KVBlock] = {}
        self.num_evicted = 0
        """Blocks whose cached content was dropped to serve a new allocation."""

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0, cached or not."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently registered under a hash (in use or free)."""
        return len(self._cached)

    def usage(self) -> float:
        """Share of usable blocks in use (cached-free blocks count as free), 0..1."""
        return 1.0 - len(self._free) / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: int) -> KVBlock | None:
        """The block cached under ``block_hash``, if any."""
        return self._cached.get(block_hash)

    def free_block_ids_lru(self) -> list[int]:
        """Free block ids, next-to-be-reused first (for tests and debugging)."""
        return list(self._free)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the free queue."""
        free = self._free
        for blk in blocks:
            if blk.ref_cnt == 0:
                del free[blk.block_id]
            blk.ref_cnt += 1

    def allocate(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the head of the free queue, evicting cached ones."""
        free = self._free
        if n > len(free):
            raise ValueError(f"cannot allocate {n} blocks, {len(free)} free")
        cached = self._cached
        popitem = free.popitem
        out: list[KVBlock] = []
        append = out.append
        evicted = 0
        for _ in range(n):
            blk = popitem(False)[1]
            h = blk.block_hash
            if h is not None:
                if cached.get(h) is blk:
                    del cached[h]
                blk.block_hash = None
                evicted += 1
            blk.ref_cnt = 1
            append(blk)
        self.num_evicted += evicted
        return out

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the free tail in order."""
        free = self._free
        for blk in blocks:
            blk.ref_cnt -= 1
            if blk.ref_cnt == 0:
                free[blk.block_id] = blk

    def cache_block(self, blk: KVBlock, block_hash: int) -> None:
        """Register a block that just became full under its chained hash."""
        if not self.enable_caching or blk.block_hash is not None:
            return
        if block_hash in self._cached:
            return  # a duplicate of a cached block: left uncached (see module docstring)
        blk.block_hash = block_hash
        self._cached[block_hash] = blk

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; refused (False) while any block is in use, as in vLLM."""
        if len(self._free) != self.num_blocks - 1:
            return False
        for blk in self._cached.values():
            blk.block_hash = None
        self._cached.clear()
        return True


class BlockTable(Protocol):
    """What ``KVCacheManager`` needs from a request (``SimRequest`` provides it)."""

    blocks: list[KVBlock]
    """The request's block table, in token order."""
    num_cached_blocks: int
    """How many leading blocks of the table are registered in the prefix cache."""

    def block_hash(self, index: int) -> int:
        """Chained hash of the request's ``index``-th full block."""
        ...


class KVCacheManager:
    """Per-request block tables over a ``BlockPool`` (vLLM's KVCacheManager, one group).

    Requests are seen through the ``BlockTable`` protocol.
    """

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size

    def find_longest_hit(self, request: BlockTable, max_hit_tokens: int) -> list[KVBlock]:
        """The request's leading blocks found in the cache, at most ``max_hit_tokens`` tokens.

        vLLM caps the hit at ``num_tokens - 1``: the last token is always
        recomputed to produce logits. Hashes are asked for lazily, so a miss on
        block 0 costs one lookup.
        """
        if not self.pool.enable_caching:
            return []
        n = max_hit_tokens // self.block_size
        get = self.pool._cached.get
        hit: list[KVBlock] = []
        hashes_upto = getattr(request, "hashes_upto", None)
        if hashes_upto is not None and n > 0:
            # One list of precomputed hashes instead of a method call per block.
            append = hit.append
            hashes = hashes_upto(n)
            for i in range(n):
                blk = get(hashes[i])
                if blk is None:
                    break
                append(blk)
            return hit
        block_hash = request.block_hash
        for i in range(n):
            blk = get(block_hash(i))
            if blk is None:
                break
            hit.append(blk)
        return hit

    def can_allocate(self, num_blocks_now: int, tokens_after: int, hit: Sequence[KVBlock]) -> bool:
        """Whether a request holding ``num_blocks_now`` blocks can grow to ``tokens_after``."""
        need = -(-tokens_after // self.block_size) - num_blocks_now - len(hit)
        evictable_hits = sum(1 for b in hit if b.ref_cnt == 0)
        return max(need, 0) + evictable_hits <= self.pool.num_free_blocks

    def allocate_slots(self, request: BlockTable, tokens_after: int, hit: Sequence[KVBlock] = ()) -> bool:
        """Give ``request`` blocks for ``tokens_after`` tokens (hit blocks first); False if short.

        Nothing changes when it returns False, as with vLLM's ``allocate_slots``
        returning None.
        """
        blocks = request.blocks
        if not self.can_allocate(len(blocks), tokens_after, hit):
            return False
        if hit:
            self.pool.touch(hit)
            blocks.extend(hit)
            request.num_cached_blocks = len(blocks)
        need = -(-tokens_after // self.block_size) - len(blocks)
        if need > 0:
            blocks.extend(self.pool.allocate(need))
        return True

    def cache_full_blocks(self, request: BlockTable, num_computed_tokens: int) -> None:
        """Register the request's blocks that ``num_computed_tokens`` has filled."""
        if not self.pool.enable_caching:
            return
        n_full = num_computed_tokens // self.block_size
        start = request.num_cached_blocks
        if n_full <= start:
            return
        blocks = request.blocks
        hashes_upto = getattr(request, "hashes_upto", None)
        if hashes_upto is None:
            pool = self.pool
            for i in range(start, n_full):
                pool.cache_block(blocks[i], request.block_hash(i))
        else:
            # BlockPool.cache_block inlined: this runs once per block of every prefill.
            hashes = hashes_upto(n_full)
            cached = self.pool._cached
            for i in range(start, n_full):
                blk = blocks[i]
                if blk.block_hash is None:
                    h = hashes[i]
                    if h not in cached:  # a duplicate stays uncached (module docstring)
                        blk.block_hash = h
                        cached[h] = blk
        request.num_cached_blocks = n_full

    def free(self, request: BlockTable) -> None:
        """Release all of a request's blocks, tail first (so its tail is evicted first)."""
        blocks = request.blocks
        if blocks:
            self.pool.free(reversed(blocks))
            blocks.clear()
        request.num_cached_blocks = 0
