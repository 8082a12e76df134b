"""The offload tiers per KV-cache group: a full-attention group beside a sliding-window one.

Host-only (no jax): a KVCacheManager over a 12-block pool (block_size 4, block 0 null) with
an OffloadManager whose host tier holds 20 blocks. The device is simulated by a dict of
page values (block id -> a float that names where the page came from), copied as the runner
copies: stores before the step that reuses a block, loads into the blocks allocate_slots
gave. The rules each expectation is derived from:
- a group's cached blocks are keyed by hash_with_group_id, so the host tier holds each
  group's own pages of a prefix;
- a lookup past the device hit grows while the full-attention group finds every block in
  the host tier, and ends at the longest length for which the sliding group (window W = 5:
  the next token sees itself and the 4 before it) finds the blocks inside its window before
  that point: after L hit tokens, blocks from max(0, L - W + 1) // 4 on;
- the sliding group's blocks before that window are null in the new table and never copied;
- swap preemption keeps each group's written blocks but a sliding group's blocks before the
  window, and brings them back into the blocks of the resumed tables.
"""

import numpy as np
import pytest

from paged_jax.core.block_pool import hash_with_group_id
from paged_jax.core.config import CacheConfig, KVCacheGroupSpec
from paged_jax.core.kv_cache_manager import KVCacheManager
from paged_jax.core.offload import OffloadConfig, OffloadManager
from paged_jax.core.page_codec import PageCodec, PageLeaf
from paged_jax.core.request import Request

BS = 4
W = 5
GROUPS = (KVCacheGroupSpec((0,)), KVCacheGroupSpec((1,), "sliding_window", sliding_window=W))
PAGE = (BS, 2)  # one page: [block_size, 2] float32


class Device:
    """The pool's pages as one value per block, and the runner's copies around each step."""

    def __init__(self, mgr: KVCacheManager):
        self.mgr = mgr
        self.value: dict[int, float] = {}

    def run_copies(self, written: dict[int, float] | None = None) -> tuple[list[int], list[int]]:
        """Copy-downs, then copy-ups, then the step writes `written`; (stored ids, loaded ids)."""
        copies = self.mgr.take_step_copies()
        stored, loaded = [], []
        if copies is not None:
            stored = copies.store_block_ids.tolist()
            if stored:
                copies.store([np.stack([np.full(PAGE, self.value.get(b, -1.0), np.float32) for b in stored])])
            loaded = copies.load_block_ids.tolist()
            if loaded:
                (pages,) = copies.load()
                for b, page in zip(loaded, pages):
                    assert (page == page.flat[0]).all()
                    self.value[b] = float(page.flat[0])
        self.value.update(written or {})
        return stored, loaded


def make(num_blocks=13, host_blocks=20):
    codec = PageCodec([PageLeaf(PAGE, "float32")])
    offload = OffloadManager(OffloadConfig(host_blocks * codec.nbytes), codec, BS, sliding_windows=(None, W))
    mgr = KVCacheManager(CacheConfig(BS, num_blocks, 8192, kv_cache_groups=GROUPS), offload=offload)
    return mgr, offload, Device(mgr)


def compute(mgr, device, req, num_tokens, value):
    """Lookup (for a request without tables) + allocate num_tokens more, run the step's copies
    and write `value` into every block the step writes; returns (hit tokens, stored, loaded)."""
    num_hit = 0
    hits = None
    if req.request_id not in mgr.coordinator.managers[0].req_to_blocks:
        hits, num_hit = mgr.get_computed_blocks(req)
    new = mgr.allocate_slots(req, num_tokens - num_hit, num_hit, hits)
    assert new is not None
    start, end = req.num_computed_tokens + num_hit, req.num_computed_tokens + num_tokens
    written = {}
    for table in mgr.coordinator.get_blocks(req.request_id):
        for i in range(start // BS, -(-end // BS)):
            if not table[i].is_null and value is not None:
                written[table[i].block_id] = value
    stored, loaded = device.run_copies(written)
    req.num_computed_tokens = end
    return num_hit, stored, loaded


PROMPT = list(range(100, 117))  # 17 tokens: 4 full blocks and one more token


def evicted_prompt():
    """A computed the prompt (its pages valued by block id), finished, and a 24-token request F
    took all 12 blocks: A's 8 cached blocks went down to the host tier."""
    mgr, offload, device = make()
    a = Request("A", list(PROMPT))
    compute(mgr, device, a, 17, None)
    tables = [[b.block_id for b in t] for t in mgr.coordinator.get_blocks("A")]
    assert tables == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    device.value.update({b: float(b) for t in tables for b in t})
    mgr.free(a)
    f = Request("F", list(range(500, 524)))
    _, stored, _ = compute(mgr, device, f, 24, -1.0)
    assert sorted(stored) == [1, 2, 3, 4, 6, 7, 8, 9]  # the hashed ones; 5 and 10 held no full block
    mgr.free(f)
    return mgr, offload, device, a


def keys(req, group):
    return [hash_with_group_id(h, group) for h in req.block_hashes]


def test_host_hit_loads_every_full_block_and_only_the_window_of_the_sliding_group():
    mgr, offload, device, a = evicted_prompt()
    b = Request("B", PROMPT + [200, 201, 202])  # 20 tokens: at most 4 hit blocks
    num_hit, _, loaded = compute(mgr, device, b, 20, 7.0)
    assert num_hit == 16  # 16 - 5 + 1 = 12 skipped: the sliding group needs its block 3 only
    full, window = mgr.coordinator.get_blocks("B")
    assert [blk.is_null for blk in window] == [True, True, True, False, False]
    assert sorted(loaded) == sorted([blk.block_id for blk in full[:4]] + [window[3].block_id])
    # Each page came back from the block that held it: A's full blocks 1-4 and sliding block 9.
    assert [device.value[blk.block_id] for blk in full[:4]] == [1.0, 2.0, 3.0, 4.0]
    assert device.value[window[3].block_id] == 9.0
    assert offload.stats.host_hit_tokens == 16 and offload.host.num_pinned == 0
    mgr.free(b)
    mgr.check_invariants()
    offload.check_invariants(idle=True)


def test_a_missing_window_block_shortens_the_hit_to_where_the_window_is_whole():
    mgr, offload, device, a = evicted_prompt()
    offload.host.pop(keys(a, 1)[3])  # the sliding group's block 3 (tokens 12-15) is gone
    b = Request("B", PROMPT + [200, 201, 202])
    num_hit, _, loaded = compute(mgr, device, b, 20, 7.0)
    assert num_hit == 12  # 12 - 5 + 1 = 8 skipped: needs sliding block 2, which is there
    full, window = mgr.coordinator.get_blocks("B")
    assert [blk.is_null for blk in window][:3] == [True, True, False]
    assert sorted(loaded) == sorted([blk.block_id for blk in full[:3]] + [window[2].block_id])
    assert device.value[window[2].block_id] == 8.0
    # The full group's block 3 was found but is not needed: not pinned, not loaded.
    assert offload.host.num_pinned == 0 and keys(a, 0)[3] in offload.host
    mgr.free(b)
    offload.check_invariants(idle=True)


def test_a_missing_full_block_ends_the_hit_there():
    mgr, offload, device, a = evicted_prompt()
    offload.host.pop(keys(a, 0)[2])  # the full group's block 2 (tokens 8-11)
    b = Request("B", PROMPT + [200, 201, 202])
    num_hit, _, loaded = compute(mgr, device, b, 20, 70.0)
    assert num_hit == 8  # 8 - 5 + 1 = 4 skipped: sliding block 1
    full, window = mgr.coordinator.get_blocks("B")
    assert sorted(loaded) == sorted([blk.block_id for blk in full[:2]] + [window[1].block_id])
    assert [device.value[blk.block_id] for blk in full[:2]] == [1.0, 2.0] and device.value[window[1].block_id] == 7.0
    mgr.free(b)
    offload.check_invariants(idle=True)


def test_without_the_window_blocks_nothing_past_the_device_hit_is_used():
    mgr, offload, device, a = evicted_prompt()
    for key in keys(a, 1):
        offload.host.pop(key)
    b = Request("B", PROMPT + [200, 201, 202])
    num_hit, _, loaded = compute(mgr, device, b, 20, 7.0)
    # n = 1: 4 tokens, nothing skipped, the sliding group needs its block 0: gone. n = 0.
    assert num_hit == 0 and loaded == []
    assert offload.host.num_pinned == 0 and offload.stats.host_hit_tokens == 0
    mgr.free(b)
    offload.check_invariants(idle=True)


def test_swap_keeps_the_window_and_brings_it_back():
    mgr, offload, device = make()
    a = Request("A", list(PROMPT))
    compute(mgr, device, a, 17, None)
    device.value.update({b.block_id: float(b.block_id) for t in mgr.coordinator.get_blocks("A") for b in t})
    a.append_output_token_ids(300)
    compute(mgr, device, a, 1, 55.0)  # the 18th token (decode): slot 17 in block 4
    a.append_output_token_ids(301)
    full, window = [[b.block_id for b in t] for t in mgr.coordinator.get_blocks("A")]
    # 17 computed before the step: 13 skipped, blocks 0-2 of the window freed: 6, 7, 8.
    assert full == [1, 2, 3, 4, 5] and window == [0, 0, 0, 9, 10]
    assert mgr.swap_out(a)
    record = offload.swapped["A"]
    # 18 computed: 14 skipped, block 3 (tokens 12-15) is still in the window.
    assert [k is None for k in record.keys[1]] == [True, True, True, False, False]
    assert record.keys[0][4] == ("swap", "A", 0, 4) and record.keys[1][4] == ("swap", "A", 1, 4)
    a.num_computed_tokens = 0
    stored, _ = device.run_copies()
    assert sorted(stored) == [1, 2, 3, 4, 5, 9, 10]
    # Something else takes every block, then A resumes: everything it had comes back.
    f = Request("F", list(range(500, 524)))
    compute(mgr, device, f, 24, -1.0)
    mgr.free(f)
    num_hit, _, loaded = compute(mgr, device, a, 19, None)
    assert num_hit == 18 and offload.stats.num_swap_ins == 1
    full, window = mgr.coordinator.get_blocks("A")
    assert [device.value[b.block_id] for b in full] == [1.0, 2.0, 3.0, 4.0, 55.0]
    assert [b.is_null for b in window[:3]] == [True] * 3
    assert [device.value[b.block_id] for b in window[3:]] == [9.0, 55.0]
    assert len(loaded) == 7
    mgr.free(a)
    mgr.check_invariants()
    offload.check_invariants(idle=True)


def test_offload_built_for_other_groups_is_refused():
    codec = PageCodec([PageLeaf(PAGE, "float32")])
    offload = OffloadManager(OffloadConfig(20 * codec.nbytes), codec, BS)  # one full group
    with pytest.raises(AssertionError, match="windows"):
        KVCacheManager(CacheConfig(BS, 13, 8192, kv_cache_groups=GROUPS), offload=offload)
