"""KVCacheManager: exact block ids and free-queue order, step by step (vLLM v1 semantics).

Pools are tiny (11 blocks of 16 tokens unless said otherwise: block 0 is the null block, so
ids 1..10 are usable and the initial free queue is [1, ..., 10]). Every test ends with the
manager's invariant check.
"""

import pytest

from paged_jax.core.config import CacheConfig
from paged_jax.core.hashing import hash_block_tokens, sha256_cbor
from paged_jax.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from paged_jax.core.request import Request

BS = 16


def ids(blocks: KVCacheBlocks | None):
    """The block ids of a one-group manager's KVCacheBlocks (None stays None)."""
    if blocks is None:
        return None
    (group,) = blocks.get_block_ids()
    return group


def table(mgr, request_id):
    """The request's block table in the manager's one group."""
    return mgr.coordinator.managers[0].req_to_blocks[request_id]


def num_cached(mgr):
    return mgr.coordinator.managers[0].num_cached_block


def queue(mgr):
    return [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]


def make_manager(num_blocks=11, block_size=BS, max_model_len=8192, enable_caching=True, **kw):
    return KVCacheManager(CacheConfig(block_size, num_blocks, max_model_len, enable_prefix_caching=enable_caching,
                                      **kw))


def root(mgr):
    """The manager's chain root (each manager owns its own)."""
    return mgr.block_hasher.none_hash


def prefill(mgr, req):
    """Lookup + allocate the whole prompt, as the scheduler does for a waiting request."""
    blocks, num_hit = mgr.get_computed_blocks(req)
    new = mgr.allocate_slots(req, req.num_tokens - num_hit, num_hit, blocks)
    if new is not None:
        req.num_computed_tokens = req.num_tokens
    return blocks, num_hit, new


COMMON = [i for i in range(3) for _ in range(BS)]  # 3 full blocks: 0*16, 1*16, 2*16


# ---------------------------------------------------------------- pinned replay facts
def test_pinned_prefill_sharing_and_free_order():
    mgr = make_manager()
    r0 = Request("r0", COMMON + [3] * 7)  # 55 tokens: 3 full blocks + 7
    blocks, num_hit = mgr.get_computed_blocks(r0)
    assert (ids(blocks), num_hit) == ([], 0)  # empty cache
    assert ids(mgr.allocate_slots(r0, 55, 0, blocks)) == [1, 2, 3, 4]
    # Full blocks carry the chain hash, the partial one none.
    parent = root(mgr)
    for block_id in (1, 2, 3):
        h = hash_block_tokens(sha256_cbor, parent, COMMON[(block_id - 1) * BS : block_id * BS])
        assert mgr.block_pool.blocks[block_id].block_hash == h
        parent = h
    assert mgr.block_pool.blocks[4].block_hash is None
    assert len(mgr.block_pool.cached_block_hash_to_block) == 3

    r1 = Request("r1", COMMON + [3] * 5)  # 53 tokens sharing the first 48
    blocks, num_hit = mgr.get_computed_blocks(r1)
    assert ids(blocks) == [1, 2, 3] and num_hit == 48
    assert ids(mgr.allocate_slots(r1, 53 - 48, 48, blocks)) == [5]
    assert [mgr.block_pool.blocks[i].ref_cnt for i in range(1, 7)] == [2, 2, 2, 1, 1, 0]
    assert mgr.get_num_free_blocks() == 5
    assert mgr.usage == pytest.approx(0.5)
    mgr.check_invariants()

    # r0 frees [4, 3, 2, 1]: 4 (unhashed) to the head; 1..3 still held by r1.
    mgr.free(r0)
    assert queue(mgr) == [4, 6, 7, 8, 9, 10]
    # r1 frees [5, 3, 2, 1]: 5 to the head, the hashed 3, 2, 1 to the tail in that order.
    mgr.free(r1)
    assert queue(mgr) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    assert mgr.get_block_ids("r1") == ([],)
    mgr.check_invariants()

    # Hit while the blocks are free: touch takes them out of the queue; 5 is taken next.
    r2 = Request("r2", COMMON + [3] * 6)
    _, num_hit, new = prefill(mgr, r2)
    assert num_hit == 48 and ids(new) == [5]
    assert queue(mgr) == [4, 6, 7, 8, 9, 10]
    mgr.free(r2)
    assert queue(mgr) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]

    # A 160-token miss takes the whole queue head first, evicting 3, 2, 1 last.
    r3 = Request("r3", [99] * (BS * 10))
    _, num_hit, new = prefill(mgr, r3)
    assert num_hit == 0 and ids(new) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    assert mgr.get_num_free_blocks() == 0
    assert len(mgr.block_pool.cached_block_hash_to_block) == 10  # r3's own 10 full blocks
    mgr.check_invariants()


def test_pinned_caching_disabled_frees_to_head_in_reverse():
    mgr = make_manager(enable_caching=False)
    req = Request("r0", list(range(48)))
    assert (ids(mgr.get_computed_blocks(req)[0]), mgr.get_computed_blocks(req)[1]) == ([], 0)
    assert ids(mgr.allocate_slots(req, 48)) == [1, 2, 3]
    assert len(mgr.block_pool.cached_block_hash_to_block) == 0
    assert req.block_hashes == []  # nothing is hashed when nothing is cached
    mgr.free(req)  # blocks go back as [3, 2, 1], none hashed -> head, order kept
    assert queue(mgr) == [3, 2, 1, 4, 5, 6, 7, 8, 9, 10]
    mgr.check_invariants()


def test_pinned_block_aligned_prompt_recomputes_last_block():
    mgr = make_manager()
    prefill(mgr, Request("a", COMMON))
    b = Request("b", COMMON)  # identical 48 tokens
    blocks, num_hit = mgr.get_computed_blocks(b)
    # (48 - 1) // 16 = 2 blocks: the last token must be computed to get logits.
    assert ids(blocks) == [1, 2] and num_hit == 32
    assert ids(mgr.allocate_slots(b, 16, 32, blocks)) == [4]
    # Block 4 holds the same tokens as block 3: cached too, not de-duplicated.
    assert mgr.block_pool.blocks[4].block_hash == mgr.block_pool.blocks[3].block_hash
    assert mgr.block_pool.get_cached_block(mgr.block_pool.blocks[3].block_hash).block_id == 3  # earliest
    assert len(mgr.block_pool.cached_block_hash_to_block) == 3  # hashes, not blocks
    assert mgr.block_pool.cached_block_hash_to_block.num_blocks() == 4
    mgr.check_invariants()


# ---------------------------------------------------------------- the seed article, ids + 1
def test_seed_article_walkthrough_on_7_blocks():
    bs = 4
    mgr = make_manager(7, bs, 64)
    assert queue(mgr) == [1, 2, 3, 4, 5, 6]  # T0: all free, ascending
    # T1: A (10 tokens: two full blocks and a partial one) takes [1, 2, 3].
    a = Request("A", list(range(10)))
    assert ids(prefill(mgr, a)[2]) == [1, 2, 3]
    assert queue(mgr) == [4, 5, 6]
    # T2: A finishes and frees [3, 2, 1]: partial 3 to the head, hashed 2 then 1 to the tail.
    mgr.free(a)
    assert queue(mgr) == [3, 4, 5, 6, 2, 1]
    assert [mgr.block_pool.blocks[i].block_hash is not None for i in (3, 2, 1)] == [False, True, True]
    # T3: C (20 unrelated tokens) takes 5 blocks; taking 2 evicts its hash.
    c = Request("C", [100 + i for i in range(20)])
    assert ids(prefill(mgr, c)[2]) == [3, 4, 5, 6, 2]
    assert queue(mgr) == [1]
    # C's own full blocks 3, 4, 5, 6, 2 are cached now; A's block 2 hash is gone.
    a_hashes = Request("A2", list(range(10)), block_hasher=mgr.block_hasher).block_hashes
    assert mgr.block_pool.get_cached_block(a_hashes[1]) is None
    assert mgr.block_pool.get_cached_block(a_hashes[0]).block_id == 1
    # T4: B with A's prefix: the lookup hits block 1 and misses block 2.
    b = Request("B", list(range(8)) + [50, 51])
    blocks, num_hit = mgr.get_computed_blocks(b)
    assert ids(blocks) == [1] and num_hit == 4
    # B needs 2 new blocks plus its hit block (itself in the free queue); 1 is free.
    assert mgr.coordinator.get_num_blocks_to_allocate("B", 10, blocks.blocks) == 3
    assert mgr.allocate_slots(b, 6, 4, blocks) is None
    # All or nothing: block 1 stays cached in the queue, B holds nothing.
    assert queue(mgr) == [1] and mgr.block_pool.blocks[1].ref_cnt == 0
    assert mgr.block_pool.blocks[1].block_hash == a_hashes[0]
    assert mgr.get_block_ids("B") == ([],)
    mgr.check_invariants()


# ---------------------------------------------------------------- vLLM scenarios re-expressed
def test_decode_growth():
    mgr = make_manager()
    req = Request("r0", COMMON + [3] * 7)
    assert ids(prefill(mgr, req)[2]) == [1, 2, 3, 4]
    for _ in range(4):
        req.append_output_token_ids(8)
    assert ids(mgr.allocate_slots(req, 4)) == []  # 55 + 4 = 59 slots fit in 4 blocks
    assert table(mgr, "r0")[-1].block_hash is None
    req.num_computed_tokens = 59
    for _ in range(9 + 10):  # 9 fill block 4, 10 spill into a fifth block
        req.append_output_token_ids(7)
    assert ids(mgr.allocate_slots(req, 19)) == [5]
    assert table(mgr, "r0")[-2].block_hash is not None  # block 4 became full: cached
    assert table(mgr, "r0")[-1].block_hash is None
    assert num_cached(mgr)["r0"] == 4
    mgr.check_invariants({"r0": req})


def test_eviction_order():
    mgr = make_manager()
    r0 = Request("0", list(range(5 * BS + 7)))  # 5 full + 1 partial
    assert ids(prefill(mgr, r0)[2]) == [1, 2, 3, 4, 5, 6]
    r1 = Request("1", list(range(5 * BS + 7, 8 * BS + 7)))  # 3 full
    assert ids(prefill(mgr, r1)[2]) == [7, 8, 9]
    assert mgr.get_num_free_blocks() == 1
    mgr.free(r0)
    mgr.free(r1)
    assert queue(mgr) == [6, 10, 5, 4, 3, 2, 1, 9, 8, 7]
    # A prompt sharing r0's first two blocks touches 1 and 2 and takes the head block 6.
    r2 = Request("2", list(range(2 * BS + 3)))
    blocks, num_hit, new = prefill(mgr, r2)
    assert ids(blocks) == [1, 2] and num_hit == 32 and ids(new) == [6]
    assert queue(mgr) == [10, 5, 4, 3, 9, 8, 7]
    mgr.check_invariants()


def test_hit_block_not_evicted_by_own_allocation():
    bs = 4
    mgr = make_manager(4, bs, 64)  # 3 usable blocks
    a = Request("A", [1, 2, 3, 4])
    assert ids(prefill(mgr, a)[2]) == [1]
    mgr.free(a)
    assert queue(mgr) == [2, 3, 1]
    x = Request("X", [9] * 8)
    assert ids(prefill(mgr, x)[2]) == [2, 3]
    mgr.free(x)
    assert queue(mgr) == [1, 3, 2]  # A's block is now at the head, next to be evicted
    b = Request("B", [1, 2, 3, 4, 5, 6, 7, 8])
    blocks, num_hit = mgr.get_computed_blocks(b)
    assert ids(blocks) == [1] and num_hit == 4
    # Touching first takes 1 out of the queue, so the new block is 3, not B's own hit.
    assert ids(mgr.allocate_slots(b, 4, 4, blocks)) == [3]
    assert mgr.get_block_ids("B") == ([1, 3],)
    assert mgr.block_pool.blocks[1].block_hash is not None
    mgr.check_invariants({"B": b})


def test_not_enough_blocks_leaves_hits_untouched():
    mgr = make_manager()
    r0 = Request("0", COMMON)
    prefill(mgr, r0)
    r1 = Request("1", COMMON * 2)  # hits 3, adds 3 of its own
    blocks, num_hit, new = prefill(mgr, r1)
    assert num_hit == 48 and ids(new) == [4, 5, 6]
    part1 = mgr.get_blocks("1")
    mgr.free(r1)
    r2 = Request("2", [7] * 2 * BS)
    assert ids(prefill(mgr, r2)[2]) == [7, 8]
    assert mgr.get_num_free_blocks() == 5
    r3 = Request("3", COMMON * 3)  # hits r1's 6 blocks; 3 of them are free
    blocks, num_hit = mgr.get_computed_blocks(r3)
    assert blocks == part1 and num_hit == 96
    before = queue(mgr)
    assert mgr.allocate_slots(r3, 48, 96, blocks) is None  # needs 3 new + 3 evictable > 5
    assert [b.ref_cnt for b in part1.blocks[0]] == [1, 1, 1, 0, 0, 0]
    assert queue(mgr) == before and mgr.get_block_ids("3") == ([],)
    mgr.check_invariants()


def test_cache_salt_isolates_and_enters_only_block_0():
    mgr = make_manager()
    tokens = COMMON + [3] * 7
    r0 = Request("0", tokens, cache_salt="salt1")
    h = r0.block_hashes
    assert h == []  # no hasher yet: the manager attaches its own on first sight
    prefill(mgr, r0)
    h = r0.block_hashes
    assert h[0] == hash_block_tokens(sha256_cbor, root(mgr), tokens[:BS], ("salt1",))
    assert h[1] == hash_block_tokens(sha256_cbor, h[0], tokens[BS : 2 * BS], None)
    assert mgr.get_computed_blocks(Request("1", tokens, cache_salt="salt1"))[1] == 48
    assert mgr.get_computed_blocks(Request("2", tokens, cache_salt="salt2"))[1] == 0
    assert mgr.get_computed_blocks(Request("3", tokens))[1] == 0
    lora = Request("4", tokens, lora_name="adapter")
    assert mgr.get_computed_blocks(lora)[1] == 0
    mgr.check_invariants()


def test_reset_prefix_cache():
    mgr = make_manager()
    r0 = Request("0", COMMON + [3] * 7)
    assert ids(mgr.allocate_slots(r0, 55)) == [1, 2, 3, 4]  # no lookup first: still hashed
    r1 = Request("1", COMMON + [4] * 7)
    blocks, num_hit, new = prefill(mgr, r1)
    assert ids(blocks) == [1, 2, 3] and ids(new) == [5]
    assert not mgr.reset_prefix_cache()  # blocks in use
    assert len(mgr.block_pool.cached_block_hash_to_block) == 3
    mgr.free(r0)
    mgr.free(r1)
    order = queue(mgr)
    assert mgr.reset_prefix_cache()
    assert len(mgr.block_pool.cached_block_hash_to_block) == 0
    assert all(b.block_hash is None for b in mgr.block_pool.blocks)
    assert queue(mgr) == order  # reset forgets hashes, not the order
    assert mgr.prefix_cache_stats.num_resets == 1
    assert mgr.get_computed_blocks(Request("2", COMMON + [3]))[1] == 0
    mgr.check_invariants()


# ---------------------------------------------------------------- other behaviour
def test_stats_count_preempted_requests_apart():
    mgr = make_manager()
    r0 = Request("0", COMMON + [3] * 7)
    prefill(mgr, r0)
    prefill(mgr, Request("1", COMMON + [5]))
    stats = mgr.prefix_cache_stats.copy()
    assert (stats.requests, stats.queries, stats.hits) == (2, 55 + 49, 48)
    assert stats.hit_rate == pytest.approx(48 / 104)
    assert mgr.prefix_cache_stats == stats  # reading changes nothing
    # Preempt r0 (recompute): its blocks return; on resume it hits its own full blocks.
    r0.append_output_token_ids([9] * 9)  # 64 tokens: block 3 is full now
    mgr.allocate_slots(r0, 9)
    mgr.free(r0)
    r0.num_computed_tokens = 0
    r0.num_preemptions += 1
    blocks, num_hit = mgr.get_computed_blocks(r0)
    # Block 4 is cached too, but (64 - 1) // 16 = 3 blocks at most: the last token is recomputed.
    assert mgr.block_pool.blocks[4].block_hash == r0.block_hashes[3]
    assert ids(blocks) == [1, 2, 3] and num_hit == 48
    assert mgr.prefix_cache_stats == stats  # a lookup counts when the request is admitted
    assert mgr.allocate_slots(r0, 64 - num_hit, num_hit, blocks) is not None
    now = mgr.prefix_cache_stats
    assert (now.requests, now.preempted_requests, now.preempted_queries, now.preempted_hits) == (2, 1, 64, 48)
    assert (now.queries, now.hits) == (stats.queries, stats.hits)  # the hit rate counts fresh requests only


def test_chunked_prefill_caches_full_blocks_per_chunk():
    mgr = make_manager()
    req = Request("r", list(range(100)))
    assert ids(mgr.allocate_slots(req, 40)) == [1, 2, 3]
    assert num_cached(mgr)["r"] == 2  # 40 // 16
    req.num_computed_tokens = 40
    assert ids(mgr.allocate_slots(req, 60)) == [4, 5, 6, 7]
    assert num_cached(mgr)["r"] == 6
    assert len(mgr.block_pool.cached_block_hash_to_block) == 6
    mgr.check_invariants({"r": req})


def test_lookahead_slots_are_allocated_but_never_cached_and_cap_at_max_model_len():
    mgr = make_manager(max_model_len=40)
    req = Request("r", list(range(15)))
    assert ids(mgr.allocate_slots(req, 15, num_lookahead_tokens=1)) == [1]
    assert num_cached(mgr).get("r", 0) == 0  # 15 real tokens: no full block
    req.num_computed_tokens = 15
    req.append_output_token_ids(list(range(20)))  # 35 tokens
    # 15 + 20 + 10 lookahead = 45 slots, capped at max_model_len 40 -> 3 blocks.
    assert ids(mgr.allocate_slots(req, 20, num_lookahead_tokens=10)) == [2, 3]
    assert num_cached(mgr)["r"] == 2  # 35 // 16
    assert mgr.block_pool.blocks[3].block_hash is None
    mgr.check_invariants({"r": req})


def test_free_of_request_holding_nothing_is_noop():
    mgr = make_manager()
    mgr.free(Request("ghost", [1, 2, 3]))
    assert queue(mgr) == list(range(1, 11))
    req = Request("r", [1] * 5)
    mgr.allocate_slots(req, 5)
    mgr.free(req)
    mgr.free(req)  # twice: the second is a no-op
    assert queue(mgr) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    mgr.check_invariants()


def test_xxhash_manager_hits_the_same_way():
    mgr = make_manager(hash_algo="xxhash")
    prefill(mgr, Request("a", COMMON + [3]))
    b = Request("b", COMMON + [4])
    assert mgr.get_computed_blocks(b)[1] == 48
    assert len(b.block_hashes[0]) == 16  # xxh3-128


def test_request_built_with_managers_hasher_matches_lazy_attach():
    mgr = make_manager()
    eager = Request("e", COMMON + [1, 2], block_hasher=mgr.block_hasher)
    lazy = Request("l", COMMON + [1, 2])
    mgr.get_computed_blocks(lazy)
    assert eager.block_hashes == lazy.block_hashes and len(eager.block_hashes) == 3
    foreign = make_manager(11, 8, 100).block_hasher
    other = Request("o", COMMON, block_hasher=foreign)
    with pytest.raises(ValueError, match="block_hasher=None"):
        mgr.get_computed_blocks(other)


def test_managers_share_hits_only_with_the_same_hash_seed():
    a, b, c = make_manager(hash_seed=5), make_manager(hash_seed=5), make_manager(hash_seed=6)
    prefill(a, Request("a", COMMON + [3]))
    prefill(b, Request("b", COMMON + [3]))
    prefill(c, Request("c", COMMON + [3]))
    assert a.block_pool.blocks[1].block_hash == b.block_pool.blocks[1].block_hash
    assert a.block_pool.blocks[1].block_hash != c.block_pool.blocks[1].block_hash
    # A request hashed by a's hasher carries a's chain: c refuses it rather than missing silently.
    with pytest.raises(ValueError, match="block_hasher=None"):
        c.get_computed_blocks(Request("x", COMMON + [4], block_hasher=a.block_hasher))
    # b's hasher makes the same hashes as a's: a accepts it and hits.
    assert a.get_computed_blocks(Request("y", COMMON + [4], block_hasher=b.block_hasher))[1] == 48


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_blocks=1), "num_blocks"),
        (dict(block_size=12), "power of two"),
        (dict(block_size=0), "power of two"),
        (dict(max_model_len=0), "max_model_len"),
        (dict(hash_algo="md5"), "hash_algo"),
    ],
)
def test_bad_config_raises_value_error(kwargs, match):
    args = dict(num_blocks=11, block_size=16, max_model_len=64) | kwargs
    with pytest.raises(ValueError, match=match):
        CacheConfig(**args)


def test_bad_requests_raise_value_error():
    mgr = make_manager(max_model_len=32)
    with pytest.raises(ValueError, match="prompt_token_ids is empty"):
        Request("e", [])
    long = Request("l", list(range(33)))
    with pytest.raises(ValueError, match="shorten the prompt or raise max_model_len"):
        mgr.get_computed_blocks(long)
    with pytest.raises(ValueError, match="max_model_len"):
        mgr.allocate_slots(long, 33)
    ok = Request("ok", list(range(20)))
    for kw in (dict(num_new_tokens=-1), dict(num_new_tokens=1, num_new_computed_tokens=-16),
               dict(num_new_tokens=1, num_lookahead_tokens=-2)):
        with pytest.raises(ValueError, match=">= 0"):
            mgr.allocate_slots(ok, **kw)
    assert mgr.get_block_ids("ok") == ([],) and mgr.get_num_free_blocks() == 10
    mgr.allocate_slots(ok, 20)
    with pytest.raises(ValueError, match="must be the KVCacheBlocks get_computed_blocks returned"):
        mgr.allocate_slots(Request("list", list(range(20))), 4, 16, mgr.block_pool.blocks[1:2])
    hit = KVCacheBlocks((mgr.block_pool.blocks[1:2],))
    with pytest.raises(ValueError, match="first allocation"):
        mgr.allocate_slots(ok, 1, 16, hit)
    off = make_manager(enable_caching=False)
    with pytest.raises(ValueError, match="prefix caching is disabled"):
        off.allocate_slots(Request("x", list(range(20))), 4, 16, hit)
    mgr.check_invariants()


def test_invariant_check_catches_a_leaked_reference():
    mgr = make_manager()
    prefill(mgr, Request("a", COMMON + [3]))
    mgr.block_pool.blocks[2].ref_cnt += 1  # a bug: a reference nobody holds
    with pytest.raises(AssertionError, match="block 2 ref_cnt=2 but 1 live requests hold it"):
        mgr.check_invariants()

