"""BlockPool: null block, allocation/eviction, free order, touch, duplicate hashes, reset."""

import pytest

from paged_jax.core.config import CacheConfig
from paged_jax.core.block_pool import BlockHashToBlockMap, BlockPool


class FakeRequest:
    """Just what cache_full_blocks reads."""

    def __init__(self, block_hashes, request_id="req"):
        self.block_hashes = block_hashes
        self.request_id = request_id


def queue(pool):
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def H(i):
    return bytes([i]) * 32


def test_null_block_is_taken_at_start():
    pool = BlockPool(11)
    assert pool.null_block is pool.blocks[0] and pool.null_block.is_null
    assert queue(pool) == list(range(1, 11))
    assert pool.get_num_free_blocks() == 10 and pool.get_usage() == 0.0
    # Freeing or touching the null block (a padded table entry) changes nothing.
    pool.free_blocks([pool.null_block])
    pool.touch([pool.null_block])
    assert queue(pool) == list(range(1, 11)) and pool.null_block.ref_cnt == 0
    pool.check_invariants()
    # The user's value is checked once, in CacheConfig; the pool asserts what it was given.
    with pytest.raises(ValueError, match="num_blocks=1 must be >= 2: block 0 is the null block"):
        CacheConfig(block_size=16, num_blocks=1, max_model_len=64)
    with pytest.raises(AssertionError, match="null block plus one"):
        BlockPool(1)


def test_get_new_blocks_pops_head_with_ref_1_and_refuses_too_many():
    pool = BlockPool(6)
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [1, 2, 3] and [b.ref_cnt for b in got] == [1, 1, 1]
    assert pool.get_usage() == pytest.approx(0.6)
    with pytest.raises(ValueError, match="cannot get 3 blocks: only 2 are free"):
        pool.get_new_blocks(3)
    assert queue(pool) == [4, 5]  # the failed call took nothing
    pool.check_invariants({1: 1, 2: 1, 3: 1})


def test_free_blocks_hashed_to_tail_unhashed_to_head_in_given_order():
    pool = BlockPool(11)
    blocks = pool.get_new_blocks(6)  # 1..6
    pool.cache_full_blocks(FakeRequest([H(1), H(2), H(3), H(4)]), blocks, 0, 4, 16)
    assert [b.block_hash is not None for b in blocks] == [True] * 4 + [False] * 2
    pool.free_blocks(blocks[::-1])  # 6, 5 unhashed; 4, 3, 2, 1 hashed
    assert queue(pool) == [6, 5, 7, 8, 9, 10, 4, 3, 2, 1]
    assert all(b.block_hash is not None for b in pool.blocks[1:5])  # freeing keeps hashes
    pool.check_invariants({})


def test_shared_block_returns_only_at_ref_0():
    pool = BlockPool(5)
    a = pool.get_new_blocks(2)  # 1, 2
    pool.touch(a)  # a second holder
    assert [b.ref_cnt for b in a] == [2, 2]
    pool.free_blocks(a[::-1])
    assert queue(pool) == [3, 4]
    pool.free_blocks(a[::-1])
    assert queue(pool) == [2, 1, 3, 4]
    with pytest.raises(AssertionError, match="freed more often than it was taken"):
        pool.free_blocks([a[0]])


def test_touch_takes_free_hit_out_of_queue():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(FakeRequest([H(1), H(2)]), blocks, 0, 2, 16)
    pool.free_blocks(blocks[::-1])
    assert queue(pool) == [3, 4, 5, 2, 1]
    hit = pool.get_cached_block(H(2))
    assert hit.block_id == 2
    pool.touch([pool.get_cached_block(H(1)), hit])
    assert queue(pool) == [3, 4, 5] and (pool.blocks[1].ref_cnt, pool.blocks[2].ref_cnt) == (1, 1)
    pool.check_invariants({1: 1, 2: 1})


def test_eviction_drops_hash_when_popped():
    pool = BlockPool(3)  # blocks 1, 2
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(FakeRequest([H(1), H(2)]), blocks, 0, 2, 16)
    pool.free_blocks(blocks[::-1])  # queue [2, 1]
    (b,) = pool.get_new_blocks(1)
    assert b.block_id == 2 and b.block_hash is None and pool.get_cached_block(H(2)) is None
    assert pool.get_cached_block(H(1)).block_id == 1
    assert len(pool.cached_block_hash_to_block) == 1
    pool.check_invariants({2: 1})


def test_duplicate_hashes_are_not_deduplicated_lookup_returns_earliest():
    pool = BlockPool(6)
    a = pool.get_new_blocks(1)  # block 1
    b = pool.get_new_blocks(1)  # block 2, same content
    c = pool.get_new_blocks(1)  # block 3, same content
    pool.cache_full_blocks(FakeRequest([H(7)]), b, 0, 1, 16)
    pool.cache_full_blocks(FakeRequest([H(7)]), a, 0, 1, 16)
    pool.cache_full_blocks(FakeRequest([H(7)]), c, 0, 1, 16)
    assert pool.get_cached_block(H(7)).block_id == 2  # earliest inserted
    assert len(pool.cached_block_hash_to_block) == 1
    assert pool.cached_block_hash_to_block.num_blocks() == 3
    pool.free_blocks(b + a)  # queue [4, 5, 2, 1]
    pool.get_new_blocks(3)  # 4, 5, then 2: evicts the earliest copy
    assert pool.get_cached_block(H(7)).block_id == 1
    pool.check_invariants({1: 0, 2: 1, 3: 1, 4: 1, 5: 1})


def test_cache_full_blocks_only_new_range_and_refuses_double_caching():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(3)
    req = FakeRequest([H(1), H(2), H(3)])
    pool.cache_full_blocks(req, blocks, 0, 1, 16)
    pool.cache_full_blocks(req, blocks, 1, 3, 16)
    assert [b.block_hash for b in blocks] == [H(1), H(2), H(3)]
    pool.cache_full_blocks(req, blocks, 3, 3, 16)  # nothing new: no-op
    with pytest.raises(AssertionError, match="caching block 2 twice"):
        pool.cache_full_blocks(req, blocks, 1, 2, 16)
    with pytest.raises(AssertionError, match="hasher fell behind"):
        pool.cache_full_blocks(FakeRequest([H(1)]), blocks, 0, 2, 16)


def test_reset_prefix_cache_only_when_idle_and_keeps_order():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(FakeRequest([H(1), H(2)]), blocks, 0, 2, 16)
    assert not pool.reset_prefix_cache()
    assert len(pool.cached_block_hash_to_block) == 2
    pool.free_blocks(blocks[::-1])
    assert pool.reset_prefix_cache()
    assert len(pool.cached_block_hash_to_block) == 0 and queue(pool) == [3, 4, 2, 1]
    assert all(b.block_hash is None for b in pool.blocks)
    pool.check_invariants({})


def test_caching_disabled_pool():
    pool = BlockPool(4, enable_caching=False)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks(blocks[::-1])
    assert queue(pool) == [3, 2, 1]
    pool.check_invariants({})


def test_hash_map_pop_semantics():
    m = BlockHashToBlockMap()
    pool = BlockPool(4)
    b1, b2, b3 = pool.blocks[1:]
    m.insert(H(1), b1)
    assert m.pop(H(1), 2) is None and H(1) in m  # wrong id: stays
    m.insert(H(1), b2)
    m.insert(H(1), b3)
    assert m.pop(H(1), 2) is b2 and m.get_one_block(H(1)) is b1
    assert m.pop(H(1), 1) is b1 and m.get_one_block(H(1)) is b3
    assert m.pop(H(1), 3) is b3 and H(1) not in m and len(m) == 0
    assert m.pop(H(9), 1) is None and m.get_one_block(H(9)) is None


def test_check_invariants_names_the_bug():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(2)
    pool.check_invariants({1: 1, 2: 1})
    blocks[0].ref_cnt = 0  # dropped a reference without queueing the block
    with pytest.raises(AssertionError, match="block 1 ref_cnt=0 but not in the free queue"):
        pool.check_invariants()
    blocks[0].ref_cnt = 1
    blocks[1].block_hash = H(5)  # a hash the cache does not know
    with pytest.raises(AssertionError, match="carry a hash the cache lacks"):
        pool.check_invariants()
    blocks[1].block_hash = None
    pool.free_block_queue.num_free_blocks += 1  # a counting bug
    with pytest.raises(AssertionError, match="num_free_blocks=4 but the queue holds 3"):
        pool.check_invariants()
    pool.free_block_queue.num_free_blocks -= 1
    pool.free_block_queue.fake_free_list_tail.prev_free_block.next_free_block = pool.blocks[3]  # a cycle
    with pytest.raises(AssertionError, match="cycle|prev link"):
        pool.check_invariants()
