"""The offload manager's rules, one at a time, on a pool of block_size 4 (host side, no jax).

Each test narrates what the manager must do and checks the exact keys, pins and hit counts.
"""

import numpy as np

from paged_jax.core.config import CacheConfig
from paged_jax.core.kv_cache_manager import KVCacheManager
from paged_jax.core.offload import OffloadConfig, OffloadManager
from paged_jax.core.page_codec import PageCodec, PageLeaf
from paged_jax.core.request import Request, SamplingParams

BS = 4


def table_of(kv, request_id):
    """The request's block ids in the manager's one KV-cache group."""
    (ids,) = kv.get_block_ids(request_id)
    return ids


def make(num_blocks=8, host_entries=8):
    codec = PageCodec([PageLeaf((BS, 1, 1), "float32")])
    offload = OffloadManager(OffloadConfig(host_entries * codec.nbytes), codec, BS)
    kv = KVCacheManager(CacheConfig(BS, num_blocks, 32, hash_seed=0), offload)
    return kv, offload


def request(request_id, tokens):
    return Request(request_id, tokens, SamplingParams(max_tokens=4, ignore_eos=True))


def apply(offload, pages_of=lambda ids: [np.zeros((len(ids), BS, 1, 1), np.float32)]):
    """Runs the step's copies on a fake device (zero pages)."""
    copies = offload.take_step_copies()
    if copies is not None:
        if copies.store_block_ids.size:
            copies.store(pages_of(copies.store_block_ids))
        if copies.load_block_ids.size:
            copies.load()
    return copies


def test_swap_out_keys_full_blocks_by_hash_and_the_partial_one_privately():
    kv, offload = make()
    r = request("r", list(range(1, 11)))
    kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, 6) is not None  # a 6-token chunk: block 0 full, block 1 half
    r.num_computed_tokens = 6
    table = table_of(kv, "r")
    assert kv.swap_out(r)
    h0 = r.block_hashes[0]
    assert offload.swapped["r"].keys == [[h0, ("swap", "r", 0, 1)]] and offload.swapped["r"].num_tokens == 6
    assert table_of(kv, "r") == [] and kv.get_num_free_blocks() == 7
    copies = apply(offload)
    assert copies.store_block_ids.tolist() == table  # both pages go down before the next step
    assert offload.host.is_pinned(h0) and offload.host.is_pinned(("swap", "r", 0, 1))


def test_a_swapped_partial_block_ends_the_lookup():
    """Tokens past the swapped ones were never computed: even if a later block of the same
    prompt is in the host tier (another request computed it), the hit stops at token 6."""
    kv, offload = make()
    prompt = list(range(1, 15))  # 14 tokens: 3 full blocks can hit
    r = request("r", prompt)
    kv.get_computed_blocks(r)
    kv.allocate_slots(r, 6)
    r.num_computed_tokens = 6
    assert kv.swap_out(r)
    apply(offload)
    r.num_computed_tokens = 0
    h2 = r.block_hashes[2]
    assert offload.host.reserve(h2) and offload.host.fill(h2, np.zeros(offload.codec.nbytes, np.uint8))
    blocks, num_hit_tokens = kv.get_computed_blocks(r)
    assert [b.block_hash for b in blocks.blocks[0]] == [r.block_hashes[0]]  # still on the device (freed, cached)
    assert num_hit_tokens == 6, "the lookup ran past the swapped request's partial block"
    assert kv.allocate_slots(r, 14 - 6, num_hit_tokens, blocks) is not None
    copies = apply(offload)
    assert copies.load_block_ids.tolist() == table_of(kv, "r")[1:2]  # the partial page comes back
    assert "r" not in offload.swapped and ("swap", "r", 0, 1) not in offload.host  # consumed
    assert offload.stats.num_swap_ins == 1 and offload.host.num_pinned == 0


def test_swap_falls_back_when_the_host_tier_cannot_hold_the_pages():
    kv, offload = make(host_entries=1)
    r = request("r", list(range(1, 11)))
    kv.get_computed_blocks(r)
    kv.allocate_slots(r, 10)
    r.num_computed_tokens = 10
    table = table_of(kv, "r")
    assert not kv.swap_out(r), "3 pages cannot fit a host tier of 1"
    assert table_of(kv, "r") == table and len(offload.host) == 0 and offload.stats.num_swap_fallbacks == 1
    assert offload.take_step_copies() is None


def test_freeing_a_swapped_request_drops_its_private_pages_and_pins():
    kv, offload = make()
    r = request("r", list(range(1, 11)))
    kv.get_computed_blocks(r)
    kv.allocate_slots(r, 10)
    r.num_computed_tokens = 10
    assert kv.swap_out(r)
    apply(offload)
    assert not kv.reset_prefix_cache(), "a swapped request still holds host entries"
    kv.free(r)  # aborted while waiting
    assert offload.host.keys() == r.block_hashes[:2], "only the prefix-cache pages stay (evictable)"
    offload.check_invariants(idle=True)
    assert kv.reset_prefix_cache() and len(offload.host) == 0


def test_eviction_copies_down_only_hashes_that_leave_the_device():
    kv, offload = make(num_blocks=4)  # 3 usable blocks
    a = request("a", list(range(1, 10)))  # 2 full blocks + 1 token
    kv.get_computed_blocks(a)
    kv.allocate_slots(a, 9)
    kv.free(a)  # free queue: [block 3 (unhashed, head), block 2, block 1] -> cached blocks at the tail
    b = request("b", [50, 51, 52, 53, 54])
    kv.get_computed_blocks(b)
    kv.allocate_slots(b, 5)  # takes block 3, then evicts block 2 (a's second block)
    copies = apply(offload)
    assert copies.store_block_ids.tolist() == [2] and offload.host.keys() == [a.block_hashes[1]]
    blocks, num_hit_tokens = kv.get_computed_blocks(request("a2", list(range(1, 10))))
    assert blocks.get_block_ids() == ([1],) and num_hit_tokens == 8  # device, then host
