"""Sliding-window KV-cache groups (vLLM v1's SlidingWindowManager and hybrid coordinator).

Tiny pools (block_size 4, block 0 null), narrated step by step with exact block ids. The
rules, from vLLM, that every expectation below is derived from (W = sliding_window):
- skipped tokens after n computed: max(0, n - W + 1); allocate_slots first frees the blocks
  wholly inside them, right to left, stopping at the first null entry, and puts the null
  block (id 0) in their place. A freed block keeps its hash (it stays a hit until evicted).
- a sliding hit of L blocks needs the cdiv(W - 1, 4) blocks before position L cached (the
  earlier ones are null in the hit); searched right to left, the first such run wins and
  trailing blocks are cut; with no run, the cached blocks from block 0 to the first miss.
- with several groups: groups of one spec are looked up together (a block counts only if
  every one of them has it), full attention first, then the others with the length so far.
- a new request's hits before the window of its hit tokens are null in its table: never
  touched, never counted as needed.
- this pool's free order (as for full attention): a table is freed tail first, group by
  group; hashed blocks go to the queue's tail, unhashed ones to its head.
"""

import math

import pytest

from paged_jax.core.config import CacheConfig, KVCacheGroupSpec
from paged_jax.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from paged_jax.core.request import Request, SamplingParams
from paged_jax.core.single_type_kv_cache_manager import SlidingWindowManager, max_blocks_per_request

BS = 4
FULL = KVCacheGroupSpec((0,))


def sliding(layer, window=8):
    return KVCacheGroupSpec((layer,), "sliding_window", sliding_window=window)


def make_manager(groups, num_blocks=21, block_size=BS, max_model_len=8192):
    return KVCacheManager(CacheConfig(block_size, num_blocks, max_model_len, kv_cache_groups=tuple(groups)))


def queue(mgr):
    return [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]


def prefill(mgr, req, sample=None):
    """Lookup + allocate the whole prompt (as the scheduler does for a waiting request),
    then append the sampled token `sample`, if given."""
    hits, num_hit = mgr.get_computed_blocks(req)
    new = mgr.allocate_slots(req, req.num_tokens - num_hit, num_hit, hits)
    if new is not None:
        req.num_computed_tokens = req.num_tokens
        if sample is not None:
            req.append_output_token_ids(sample)
    return hits, num_hit, new


def decode(mgr, req, sample):
    """One decode step: the last token gets a slot and is computed, `sample` is appended."""
    new = mgr.allocate_slots(req, 1)
    assert new is not None
    req.num_computed_tokens += 1
    req.append_output_token_ids(sample)
    return new


T = [i // BS for i in range(20)]  # 20 tokens, 5 full blocks
OUT = [100, 101, 102, 103, 104]


# ---------------------------------------------------------------- the group spec
def test_group_spec_validates_the_window():
    assert sliding(0, 512).sliding_window == 512
    with pytest.raises(ValueError, match="sliding_window=None must be a positive int"):
        KVCacheGroupSpec((0,), "sliding_window")
    with pytest.raises(ValueError, match="sliding_window=0 must be a positive int"):
        KVCacheGroupSpec((0,), "sliding_window", sliding_window=0)
    with pytest.raises(ValueError, match="sliding_window=True must be a positive int"):
        KVCacheGroupSpec((0,), "sliding_window", sliding_window=True)
    with pytest.raises(ValueError, match="only for attention_type='sliding_window'"):
        KVCacheGroupSpec((0,), "full_attention", sliding_window=8)


# ---------------------------------------------------------------- one sliding group
def test_lone_sliding_group_frees_blocks_as_the_window_moves():
    mgr = make_manager([sliding(0)], num_blocks=11)  # W = 8: a query sees itself and 7 before
    a = Request("A", list(range(10)))
    # Prefill: nothing computed, nothing skipped: cdiv(10, 4) = 3 blocks; the 2 full ones cached.
    assert prefill(mgr, a, 100)[2].get_block_ids() == ([1, 2, 3],)
    assert queue(mgr) == [4, 5, 6, 7, 8, 9, 10]
    # Decode at 10 computed: skipped max(0, 10 - 7) = 3 tokens, no whole block; 11 slots fit in 3.
    assert decode(mgr, a, 101).get_block_ids() == ([],)
    assert mgr.get_block_ids("A") == ([1, 2, 3],)
    # At 11: 4 skipped tokens = block 1 (tokens 0..3) freed: hashed, to the tail, still cached.
    decode(mgr, a, 102)
    assert mgr.get_block_ids("A") == ([0, 2, 3],)
    assert queue(mgr) == [4, 5, 6, 7, 8, 9, 10, 1]
    assert mgr.block_pool.get_cached_block(a.block_hashes[0]).block_id == 1
    # At 12: 5 skipped (still 1 block; the walk stops at the null entry); 13 slots need a 4th block.
    assert decode(mgr, a, 103).get_block_ids() == ([4],)
    decode(mgr, a, 104)  # 13: 6 skipped
    decode(mgr, a, 105)  # 14: 7 skipped
    assert mgr.get_block_ids("A") == ([0, 2, 3, 4],)
    # At 15: 8 skipped = blocks 0 and 1; block 2 freed now (block 1 was null already).
    decode(mgr, a, 106)
    assert mgr.get_block_ids("A") == ([0, 0, 3, 4],)
    assert queue(mgr) == [5, 6, 7, 8, 9, 10, 1, 2]
    mgr.check_invariants({"A": a})
    # Free: tail first, the null entries passed over; block 4 (tokens 12..15, full) is hashed.
    mgr.free(a)
    assert queue(mgr) == [5, 6, 7, 8, 9, 10, 1, 2, 4, 3]
    mgr.check_invariants()


def test_a_long_generation_holds_at_most_the_window_plus_one_block():
    """4,096 tokens decoded one by one with window 512 and block_size 16: never more than
    cdiv(511, 16) + 1 = ceil(512 / 16) + 1 = 33 non-null blocks, on a pool of 40."""
    block_size, window = 16, 512
    mgr = make_manager([sliding(0, window)], num_blocks=40, block_size=block_size)
    bound = max_blocks_per_request(sliding(0, window), block_size, 4096, 1)
    assert bound == math.ceil(window / block_size) + 1 == 33
    req = Request("A", [7], SamplingParams(max_tokens=4096))
    prefill(mgr, req, 0)
    peak = 0
    while req.num_tokens < 4096:
        decode(mgr, req, req.num_tokens % 50)
        (table,) = mgr.get_block_ids("A")
        held = sum(1 for i in table if i != 0)
        peak = max(peak, held)
        assert held <= bound, f"{held} blocks held at {req.num_computed_tokens} computed tokens"
        # This step freed what lay before the window of the tokens computed before it.
        num_skipped_blocks = max(0, (req.num_computed_tokens - 1) - window + 1) // block_size
        assert table[:num_skipped_blocks] == [0] * num_skipped_blocks and 0 not in table[num_skipped_blocks:]
    assert peak == bound  # reached: the window starts at a block's last token (c % 16 == 14)
    mgr.check_invariants({"A": req})
    mgr.free(req)
    assert mgr.get_num_free_blocks() == 39
    mgr.check_invariants()


def test_max_blocks_per_request_bounds_every_step():
    """The closed form against every (computed, new) step of a request, brute force: never
    below any step's holding, equal to the largest once the request is long."""
    def held(window, block_size, c, n):
        return -(-(c + n) // block_size) - max(0, c - window + 1) // block_size

    for window in (1, 2, 7, 8, 9, 16):
        for chunk in (1, 3, 4, 5, 16):
            for num_tokens in (1, 5, 24, 60):
                spec = sliding(0, window)
                bound = max_blocks_per_request(spec, BS, num_tokens, chunk)
                worst = max(held(window, BS, c, min(chunk, num_tokens - c)) for c in range(num_tokens))
                assert worst <= bound, (window, chunk, num_tokens)
                if num_tokens >= window + chunk + BS:
                    assert worst == bound, (window, chunk, num_tokens)
    assert max_blocks_per_request(FULL, BS, 60, 1) == 15
    assert max_blocks_per_request(sliding(0, 8), BS, 60, 1) == 3  # cdiv(7, 4) + 1
    assert max_blocks_per_request(sliding(0, 8), BS, 60, 16) == 7  # cdiv(8 + 16 - 2, 4) + 1: a chunk
    with pytest.raises(ValueError, match="max_num_batched_tokens=0"):
        max_blocks_per_request(FULL, BS, 60, 0)


def test_check_request_counts_each_groups_own_need():
    # 11 usable blocks; a 60-slot request needs 15 in a full group but 3 in a W = 8 group (decode).
    mgr = make_manager([sliding(0)], num_blocks=12)
    req = Request("r", list(range(20)), SamplingParams(max_tokens=41))  # 60 slots
    mgr.check_request(req, max_num_batched_tokens=1)
    # A 16-token chunk holds the window before it too: cdiv(22, 4) + 1 = 7 blocks, still fits.
    mgr.check_request(req, max_num_batched_tokens=16)
    # Unbounded steps (the whole request at once) need all 15.
    with pytest.raises(ValueError, match="may need 15 KV blocks"):
        mgr.check_request(req)
    pair = make_manager([FULL, sliding(1)], num_blocks=16)  # 15 usable: 15 + 3 do not fit
    with pytest.raises(ValueError, match=r"may need 18 KV blocks .*per KV-cache group \[15, 3\]"):
        pair.check_request(req, max_num_batched_tokens=1)


# ---------------------------------------------------------------- full + sliding
def test_full_and_sliding_hits_need_the_window_before_the_hit_point():
    mgr = make_manager([FULL, sliding(1)])  # 20 usable blocks; W = 8: a hit needs 2 blocks before it
    a = Request("A", list(T))
    # Prefill 20 tokens: 5 blocks a group, group 0 first; all 5 full blocks cached in both.
    assert prefill(mgr, a, OUT[0])[2].get_block_ids() == ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
    # Decode at 20 computed: 13 skipped tokens = 3 blocks; the sliding group frees 8, 7, 6
    # (right to left) before allocating; 21 slots: one more block each (11, then 12).
    assert decode(mgr, a, OUT[1]).get_block_ids() == ([11], [12])
    assert mgr.get_block_ids("A") == ([1, 2, 3, 4, 5, 11], [0, 0, 0, 9, 10, 12])
    assert queue(mgr) == [13, 14, 15, 16, 17, 18, 19, 20, 8, 7, 6]
    decode(mgr, a, OUT[2])  # 21: 14 skipped, still 3 blocks
    decode(mgr, a, OUT[3])  # 22: 15 skipped
    # At 23: 16 skipped = 4 blocks: 9 freed; 24 tokens fill block 6: 11 and 12 get cached.
    decode(mgr, a, OUT[4])
    assert mgr.get_block_ids("A") == ([1, 2, 3, 4, 5, 11], [0, 0, 0, 0, 10, 12])
    assert queue(mgr) == [13, 14, 15, 16, 17, 18, 19, 20, 8, 7, 6, 9]
    mgr.check_invariants({"A": a})
    # A finishes: group 0 frees 11, 5, 4, 3, 2, 1, then group 1 12, 10 (all hashed: to the tail).
    mgr.free(a)
    assert queue(mgr) == [13, 14, 15, 16, 17, 18, 19, 20, 8, 7, 6, 9, 11, 5, 4, 3, 2, 1, 12, 10]
    # The sliding blocks freed early sit ahead of the rest: X (24 tokens, 6 blocks a group)
    # takes 13..18 and then 19, 20, 8, 7, 6, 9, evicting A's sliding blocks 0..3 first.
    x = Request("X", [50 + i for i in range(24)])
    assert prefill(mgr, x)[2].get_block_ids() == ([13, 14, 15, 16, 17, 18], [19, 20, 8, 7, 6, 9])
    # T + one token: full attention hits 5 blocks, but the sliding group holds only block 10
    # at position 4, and a hit of 5 needs positions 3 and 4; no run of 2 anywhere, and no
    # cached block 0: the hit is empty.
    b = Request("B", T + [7])
    hits, num_hit = mgr.get_computed_blocks(b)
    assert hits.get_block_ids() == ([], []) and num_hit == 0
    # A's first 24 tokens + one: positions 4 and 5 (10, 12) are cached in the sliding group:
    # a 6-block hit, the 4 blocks before the window null.
    b2 = Request("B2", T + OUT[:4] + [7])
    hits, num_hit = mgr.get_computed_blocks(b2)
    assert hits.get_block_ids() == ([1, 2, 3, 4, 5, 11], [0, 0, 0, 0, 10, 12]) and num_hit == 24
    # Need: full 1 new + 6 hits in the queue; sliding 1 new + 2 hits (the 4 skipped are not
    # needed): 10, and X left 8 free: nothing changes.
    assert mgr.coordinator.get_num_blocks_to_allocate("B2", 25, hits.blocks, 24) == 10
    assert mgr.allocate_slots(b2, 1, 24, hits) is None
    assert mgr.get_block_ids("B2") == ([], []) and queue(mgr) == [11, 5, 4, 3, 2, 1, 12, 10]
    mgr.free(x)  # all 12 of X's blocks are full and hashed: to the tail
    assert queue(mgr) == [11, 5, 4, 3, 2, 1, 12, 10, 18, 17, 16, 15, 14, 13, 9, 6, 7, 8, 20, 19]
    assert mgr.allocate_slots(b2, 1, 24, hits).get_block_ids() == ([18], [17])
    assert mgr.get_block_ids("B2") == ([1, 2, 3, 4, 5, 11, 18], [0, 0, 0, 0, 10, 12, 17])
    mgr.check_invariants({"B2": b2})


def test_full_attention_limits_the_sliding_hit():
    mgr = make_manager([FULL, sliding(1)])
    a = Request("A", list(T))
    assert prefill(mgr, a)[2].get_block_ids() == ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
    mgr.free(a)  # no decode: nothing skipped; group 0 frees 5..1, then group 1 10..6
    assert queue(mgr) == [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 5, 4, 3, 2, 1, 10, 9, 8, 7, 6]
    x = Request("X", [50 + i for i in range(24)])  # 6 blocks a group: evicts full blocks 5, 4
    assert prefill(mgr, x)[2].get_block_ids() == ([11, 12, 13, 14, 15, 16], [17, 18, 19, 20, 5, 4])
    mgr.free(x)
    assert queue(mgr) == [3, 2, 1, 10, 9, 8, 7, 6, 16, 15, 14, 13, 12, 11, 4, 5, 20, 19, 18, 17]
    # Full attention hits 3 blocks (positions 3 and 4 were evicted); the sliding group, asked
    # for at most 3, finds positions 1, 2 (7, 8) cached: position 0 is null although block 6
    # still holds it.
    c = Request("C", T + [7])
    hits, num_hit = mgr.get_computed_blocks(c)
    assert hits.get_block_ids() == ([1, 2, 3], [0, 7, 8]) and num_hit == 12
    # 12 computed: 5 skipped tokens = 1 block, the null. Full: 3 new + 3 hits in the queue;
    # sliding: 3 new + 7, 8. Block 6 is not touched: it stays in the queue, and group 0 takes it.
    assert mgr.allocate_slots(c, 9, 12, hits).get_block_ids() == ([10, 9, 6], [16, 15, 14])
    assert mgr.get_block_ids("C") == ([1, 2, 3, 10, 9, 6], [0, 7, 8, 16, 15, 14])
    mgr.check_invariants({"C": c})


def test_hits_before_the_window_are_skipped_not_touched():
    """vLLM's rule for a new table, seen with hits a caller passes whole: of 5 sliding hits at
    20 computed tokens, the 13 skipped tokens' 3 blocks become null, untouched and not needed.
    (The search itself never returns real blocks there: its run is exactly the window's.)"""
    mgr = make_manager([FULL, sliding(1)])
    a = Request("A", list(T))
    prefill(mgr, a)
    mgr.free(a)
    assert queue(mgr) == [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 5, 4, 3, 2, 1, 10, 9, 8, 7, 6]
    blocks = mgr.block_pool.blocks
    hits = KVCacheBlocks(([blocks[i] for i in (1, 2, 3, 4, 5)], [blocks[i] for i in (6, 7, 8, 9, 10)]))
    b = Request("B", T + [7])
    # Full: 1 new + 5 hits in the queue; sliding: 1 new + 9, 10 (6, 7, 8 skipped): 9.
    assert mgr.coordinator.get_num_blocks_to_allocate("B", 21, hits.blocks, 20) == 9
    assert mgr.allocate_slots(b, 1, 20, hits).get_block_ids() == ([11], [12])
    assert mgr.get_block_ids("B") == ([1, 2, 3, 4, 5, 11], [0, 0, 0, 9, 10, 12])
    assert queue(mgr) == [13, 14, 15, 16, 17, 18, 19, 20, 8, 7, 6]
    assert [blocks[i].ref_cnt for i in (6, 7, 8, 9, 10)] == [0, 0, 0, 1, 1]
    mgr.check_invariants({"B": b})


def test_preempted_request_comes_back_with_a_hit():
    mgr = make_manager([FULL, sliding(1)])
    a = Request("A", list(T))
    prefill(mgr, a, OUT[0])
    for token in OUT[1:]:  # 4 decodes, as in the first pair test
        decode(mgr, a, token)
    assert mgr.get_block_ids("A") == ([1, 2, 3, 4, 5, 11], [0, 0, 0, 0, 10, 12])
    # Preempt by recompute: free everything (the sliding blocks 8, 7, 6, 9 were freed before).
    mgr.free(a)
    a.num_computed_tokens = 0
    a.num_preemptions += 1
    assert queue(mgr) == [13, 14, 15, 16, 17, 18, 19, 20, 8, 7, 6, 9, 11, 5, 4, 3, 2, 1, 12, 10]
    # Re-admitted with 25 tokens: at most 6 hit blocks; the sliding group has positions 4, 5.
    hits, num_hit = mgr.get_computed_blocks(a)
    assert hits.get_block_ids() == ([1, 2, 3, 4, 5, 11], [0, 0, 0, 0, 10, 12]) and num_hit == 24
    assert mgr.allocate_slots(a, 1, 24, hits).get_block_ids() == ([13], [14])
    assert mgr.get_block_ids("A") == ([1, 2, 3, 4, 5, 11, 13], [0, 0, 0, 0, 10, 12, 14])
    # The skipped blocks were not touched: still free and still cached.
    assert queue(mgr) == [15, 16, 17, 18, 19, 20, 8, 7, 6, 9]
    assert mgr.block_pool.get_cached_block(a.block_hashes[0], 1).block_id == 6
    assert mgr.prefix_cache_stats.preempted_hits == 24
    a.num_computed_tokens = 25
    mgr.check_invariants({"A": a})


# ---------------------------------------------------------------- several sliding groups
def test_two_sliding_groups_of_one_spec_are_looked_up_together():
    mgr = make_manager([sliding(0), sliding(1), KVCacheGroupSpec((2,))])
    coordinator = mgr.coordinator
    assert [(type(m).__name__, ids) for m, ids in coordinator.lookup_groups] == [
        ("FullAttentionManager", (2,)), ("SlidingWindowManager", (0, 1))]
    a = Request("A", list(T[:12]))
    assert prefill(mgr, a)[2].get_block_ids() == ([1, 2, 3], [4, 5, 6], [7, 8, 9])
    mgr.free(a)
    assert queue(mgr) == [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 3, 2, 1, 6, 5, 4, 9, 8, 7]
    x = Request("X", [50 + i for i in range(16)])  # 4 blocks a group: evicts group 0's block 3
    assert prefill(mgr, x)[2].get_block_ids() == ([10, 11, 12, 13], [14, 15, 16, 17], [18, 19, 20, 3])
    mgr.free(x)
    # Full attention hits 3 blocks. Together, the sliding groups have position 2 only in group 1
    # (block 6), so the run of 2 is positions 0, 1: a hit of 2 blocks in every group.
    b = Request("B", T[:12] + [7])
    hits, num_hit = mgr.get_computed_blocks(b)
    assert hits.get_block_ids() == ([1, 2], [4, 5], [7, 8]) and num_hit == 8
    assert queue(mgr) == [2, 1, 6, 5, 4, 9, 8, 7, 13, 12, 11, 10, 17, 16, 15, 14, 3, 20, 19, 18]
    # 8 computed: 1 skipped token, no block. Each group: 2 new blocks + its 2 hits.
    assert mgr.allocate_slots(b, 5, 8, hits).get_block_ids() == ([6, 9], [13, 12], [11, 10])
    b.num_computed_tokens = 13
    b.append_output_token_ids(100)
    # Decode at 13: 6 skipped tokens = block 0 of both sliding groups (1, then 4), each to the tail.
    assert decode(mgr, b, 101).get_block_ids() == ([], [], [])
    assert mgr.get_block_ids("B") == ([0, 2, 6, 9], [0, 5, 13, 12], [7, 8, 11, 10])
    assert queue(mgr)[-2:] == [1, 4]
    mgr.check_invariants({"B": b})


def test_five_sliding_groups_and_one_full_like_gemma3():
    groups = [sliding(i) for i in range(5)] + [KVCacheGroupSpec((5,))]
    mgr = make_manager(groups, num_blocks=31)
    assert [ids for _, ids in mgr.coordinator.lookup_groups] == [(5,), (0, 1, 2, 3, 4)]
    a = Request("A", list(T[:12]))
    assert prefill(mgr, a)[2].get_block_ids() == tuple([3 * g + 1, 3 * g + 2, 3 * g + 3] for g in range(6))
    mgr.free(a)
    # 12 tokens + one: 3 blocks at most. The sliding run of 2 found first (right to left) is
    # positions 1, 2, so position 0 is null in the sliding hits.
    b = Request("B", T[:12] + [7])
    hits, num_hit = mgr.get_computed_blocks(b)
    assert hits.get_block_ids() == tuple([0, 3 * g + 2, 3 * g + 3] for g in range(5)) + ([16, 17, 18],)
    assert num_hit == 12
    # 12 computed: 5 skipped tokens = block 0: sliding tables start null, their old block 0
    # (1, 4, 7, 10, 13) untouched in the queue; every group takes one new block.
    new = mgr.allocate_slots(b, 1, 12, hits)
    assert [len(g) for g in new.get_block_ids()] == [1] * 6
    assert [t[:3] for t in mgr.get_block_ids("B")] == [[0, 3 * g + 2, 3 * g + 3] for g in range(5)] + [
        [16, 17, 18]]
    assert set(queue(mgr)) >= {1, 4, 7, 10, 13}
    mgr.check_invariants({"B": b})
    mgr.free(b)
    assert mgr.get_num_free_blocks() == 30
    mgr.check_invariants()


def test_sliding_window_of_one_block_and_caching_off():
    """W = 5 (cdiv(4, 4) = 1 block before a hit point) with caching off: freed blocks carry
    no hash and go to the queue's head, and the next allocation takes them back."""
    mgr = KVCacheManager(CacheConfig(BS, 11, 64, enable_prefix_caching=False, kv_cache_groups=(sliding(0, 5),)))
    assert isinstance(mgr.coordinator.managers[0], SlidingWindowManager)
    assert mgr.coordinator.managers[0].sliding_window_contiguous_blocks == 1
    a = Request("A", list(range(8)))
    assert prefill(mgr, a, 9)[2].get_block_ids() == ([1, 2],)
    # At 8 computed: 4 skipped = block 1, freed to the head; 9 slots need a 3rd block: 1 again.
    assert decode(mgr, a, 9).get_block_ids() == ([1],)
    assert mgr.get_block_ids("A") == ([0, 2, 1],)
    mgr.check_invariants({"A": a})


def test_check_invariants_catches_misplaced_null_blocks():
    mgr = make_manager([FULL, sliding(1)])
    a = Request("A", list(T))
    prefill(mgr, a, OUT[0])
    decode(mgr, a, OUT[1])
    sliding_table = mgr.coordinator.managers[1].req_to_blocks["A"]
    assert [b.block_id for b in sliding_table] == [0, 0, 0, 9, 10, 12]
    # The same blocks, a null after a real one: only the prefix rule is broken.
    sliding_table[0], sliding_table[3] = sliding_table[3], sliding_table[0]
    with pytest.raises(AssertionError, match="null blocks after real ones"):
        mgr.check_invariants()
    sliding_table[0], sliding_table[3] = sliding_table[3], sliding_table[0]
    mgr.check_invariants()
    # A full-attention table never holds the null block (its block 1 freed to keep ref counts right).
    full_table = mgr.coordinator.managers[0].req_to_blocks["A"]
    mgr.block_pool.free_blocks([full_table[0]])
    full_table[0] = mgr.block_pool.null_block
    with pytest.raises(AssertionError, match="never skips blocks"):
        mgr.check_invariants()
