"""Block pool and KV manager: hash chaining, refcounts, LRU eviction, reset."""

from __future__ import annotations

from misat_sim.kv_cache import NONE_HASH, BlockPool, KVCacheManager, block_hashes_for, hash_block_tokens


class _Req:
    """Minimal block table over a fixed token list."""

    def __init__(self, tokens: list[int], block_size: int) -> None:
        self.blocks = []
        self.num_cached_blocks = 0
        self._hashes = block_hashes_for(tokens, block_size)

    def block_hash(self, i: int) -> int:
        return self._hashes[i]


def test_hashes_chain_over_the_whole_prefix() -> None:
    a = block_hashes_for([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = block_hashes_for([1, 2, 3, 4, 5, 6, 7, 8], 4)
    c = block_hashes_for([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2  # the partial third block has no hash
    assert a == b
    assert c[0] != a[0] and c[1] != a[1]  # same second block, different parent
    assert a[1] == hash_block_tokens(hash_block_tokens(NONE_HASH, (1, 2, 3, 4)), (5, 6, 7, 8))


def test_null_block_is_reserved_and_usage_counts_cached_free_blocks_as_free() -> None:
    pool = BlockPool(5)
    assert pool.num_free_blocks == 4
    kv = KVCacheManager(pool, 4)
    req = _Req(list(range(8)), 4)
    assert kv.allocate_slots(req, 8)
    assert pool.usage() == 0.5
    kv.cache_full_blocks(req, 8)
    kv.free(req)
    assert pool.usage() == 0.0
    assert pool.num_cached_blocks == 2


def test_shared_block_is_freed_only_by_its_last_holder() -> None:
    pool = BlockPool(4)
    kv = KVCacheManager(pool, 4)
    a = _Req([1, 2, 3, 4, 9], 4)
    assert kv.allocate_slots(a, 5)
    kv.cache_full_blocks(a, 4)
    b = _Req([1, 2, 3, 4, 7], 4)
    hit = kv.find_longest_hit(b, 4)
    assert [blk.block_id for blk in hit] == [a.blocks[0].block_id]
    assert kv.allocate_slots(b, 5, hit)
    assert hit[0].ref_cnt == 2
    kv.free(a)
    assert hit[0].ref_cnt == 1 and hit[0].block_id not in pool.free_block_ids_lru()
    kv.free(b)
    assert hit[0].ref_cnt == 0 and hit[0].block_id in pool.free_block_ids_lru()


def test_eviction_is_lru_with_a_request_tail_first() -> None:
    pool = BlockPool(7)  # 6 usable
    kv = KVCacheManager(pool, 2)
    old = _Req([1, 2, 3, 4, 5, 6], 2)
    assert kv.allocate_slots(old, 6)
    kv.cache_full_blocks(old, 6)
    first, second, third = old.blocks
    kv.free(old)
    lru = pool.free_block_ids_lru()
    # Never-used blocks first, then the freed request tail first.
    assert lru[-3:] == [third.block_id, second.block_id, first.block_id]
    new = _Req([9] * 8, 2)
    assert kv.allocate_slots(new, 8)  # 4 blocks: 3 never used + the old tail
    assert third.block_hash is None and pool.num_evicted == 1
    assert first.block_hash is not None and second.block_hash is not None
    # The old request's first block is still a hit.
    again = _Req([1, 2, 3, 4, 0, 0], 2)
    assert len(kv.find_longest_hit(again, 5)) == 2


def test_hit_on_a_free_cached_block_counts_against_free_blocks() -> None:
    pool = BlockPool(3)  # 2 usable
    kv = KVCacheManager(pool, 2)
    a = _Req([1, 2, 3], 2)
    assert kv.allocate_slots(a, 3)
    kv.cache_full_blocks(a, 2)
    kv.free(a)
    b = _Req([1, 2, 5, 6, 7], 2)
    hit = kv.find_longest_hit(b, 4)
    assert len(hit) == 1
    assert not kv.allocate_slots(b, 5, hit)  # needs 2 new + the evictable hit = 3 > 2
    assert hit[0].ref_cnt == 0  # nothing changed on failure
    assert kv.allocate_slots(b, 4, hit)


def test_reset_prefix_cache_refused_while_blocks_are_in_use() -> None:
    pool = BlockPool(4)
    kv = KVCacheManager(pool, 2)
    a = _Req([1, 2, 3, 4], 2)
    assert kv.allocate_slots(a, 4)
    kv.cache_full_blocks(a, 4)
    assert pool.reset_prefix_cache() is False
    assert pool.num_cached_blocks == 2
    kv.free(a)
    assert pool.reset_prefix_cache() is True
    assert pool.num_cached_blocks == 0
    assert kv.find_longest_hit(_Req([1, 2, 3, 4, 5], 2), 4) == []


def test_disabled_caching_never_hits() -> None:
    pool = BlockPool(4, enable_caching=False)
    kv = KVCacheManager(pool, 2)
    a = _Req([1, 2, 3, 4], 2)
    assert kv.allocate_slots(a, 4)
    kv.cache_full_blocks(a, 4)
    kv.free(a)
    assert kv.find_longest_hit(_Req([1, 2, 3, 4, 5], 2), 4) == []
