"""KV-cache groups: one block table per group per request, all drawn from one pool.

Two full-attention groups over one pool of 11 blocks (block 0 null, ids 1..10), narrated
step by step with exact ids; then the tiny model with its two layers in two groups (each
layer reads its own group's tables and slots) against the dense greedy reference.
"""

import numpy as np
import pytest

from models.kv_cache_spec import (FullAttentionSpec, check_kv_cache_groups, kv_cache_bytes_per_block, kv_cache_group_specs,
                                  kv_cache_tensors)
from paged_jax.core.batch import StepInputsBuilder
from paged_jax.core.config import CacheConfig, KVCacheGroupSpec, SchedulerConfig
from paged_jax.core.kv_cache_manager import KVCacheManager
from paged_jax.core.request import Request, SamplingParams
from paged_jax.core.scheduler import Scheduler
from paged_jax.engine_config import EngineConfig, ResolvedConfig
from paged_jax.runner import ModelRunner
from tests.engine_reference import dense_greedy, greedy_params, make_prompts, model

BS = 16
TWO_GROUPS = (KVCacheGroupSpec((0,)), KVCacheGroupSpec((1,)))
COMMON = [i for i in range(3) for _ in range(BS)]  # 3 full blocks


def queue(mgr):
    return [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]


def two_group_manager(num_blocks=11):
    return KVCacheManager(CacheConfig(BS, num_blocks, 1024, kv_cache_groups=TWO_GROUPS))


def prefill(mgr, request):
    hits, num_hit = mgr.get_computed_blocks(request)
    new = mgr.allocate_slots(request, request.num_tokens - num_hit, num_hit, hits)
    if new is not None:
        request.num_computed_tokens = request.num_tokens
    return hits, num_hit, new


def test_each_group_gets_its_own_blocks_and_hits():
    mgr = two_group_manager()
    r0 = Request("r0", COMMON + [3] * 4)  # 52 tokens: 3 full blocks + 4, in each group
    hits, num_hit, new = prefill(mgr, r0)
    assert hits.get_block_ids() == ([], []) and num_hit == 0
    assert new.get_block_ids() == ([1, 2, 3, 4], [5, 6, 7, 8])  # group 0 allocates first
    # Group 1's full blocks are cached under the chain hashes tagged with its id.
    assert mgr.block_pool.get_cached_block(r0.block_hashes[0], 1).block_id == 5
    assert mgr.block_pool.get_cached_block(r0.block_hashes[0]).block_id == 1
    r1 = Request("r1", COMMON + [9] * 4)  # shares the 3 full blocks
    hits, num_hit, new = prefill(mgr, r1)
    assert hits.get_block_ids() == ([1, 2, 3], [5, 6, 7]) and num_hit == 48
    assert new.get_block_ids() == ([9], [10])
    assert [b.ref_cnt for b in mgr.block_pool.blocks[1:]] == [2, 2, 2, 1, 2, 2, 2, 1, 1, 1]
    r2 = Request("r2", [8] * 17)  # 2 blocks a group, 0 free: all or nothing
    assert prefill(mgr, r2)[2] is None and mgr.get_block_ids("r2") == ([], [])
    mgr.check_invariants({"r0": r0, "r1": r1})


def test_a_hit_is_the_longest_prefix_every_group_accepts():
    mgr = two_group_manager()
    r0 = Request("r0", COMMON + [3] * 4)
    prefill(mgr, r0)
    mgr.free(r0)
    # Group 0 frees first (tail first: unhashed 4 to the head, 3, 2, 1 to the tail), then group 1.
    assert queue(mgr) == [8, 4, 9, 10, 3, 2, 1, 7, 6, 5]
    other = Request("x", [7] * (3 * BS))  # 3 blocks a group: takes 8, 4, 9 | 10, 3, 2
    assert prefill(mgr, other)[2].get_block_ids() == ([8, 4, 9], [10, 3, 2])
    # Group 0 lost the prefix's 2nd and 3rd blocks, group 1 kept all three: one block hits.
    hits, num_hit = mgr.get_computed_blocks(Request("r2", COMMON + [5]))
    assert hits.get_block_ids() == ([1], [5]) and num_hit == BS
    # A router's question, per block: cached in every group?
    assert [mgr.has_cached_block(h) for h in r0.block_hashes] == [True, False, False]
    mgr.check_invariants()


def test_a_request_needs_room_in_every_group():
    mgr = two_group_manager()
    with pytest.raises(ValueError, match="in each of 2 KV-cache groups"):
        mgr.check_request(Request("big", list(range(6 * BS)), SamplingParams(max_tokens=1)))  # 6 x 2 > 10
    mgr.check_request(Request("ok", list(range(5 * BS)), SamplingParams(max_tokens=1)))


def test_groups_are_checked_against_the_model():
    specs = model().kv_cache_specs()
    assert kv_cache_group_specs(specs) == (KVCacheGroupSpec((0, 1)),)
    check_kv_cache_groups(TWO_GROUPS, specs)  # equal specs may still be split
    with pytest.raises(ValueError, match="cover layers"):
        check_kv_cache_groups((KVCacheGroupSpec((0,)),), specs)
    with pytest.raises(ValueError, match="two groups"):
        CacheConfig(BS, 11, 64, kv_cache_groups=(KVCacheGroupSpec((0, 1)), KVCacheGroupSpec((1,))))


@pytest.mark.slow
def test_two_groups_generate_what_the_dense_model_does():
    """Each layer writes and reads through its own group's block table: the tiny model with
    its layers in two groups (so their pages sit at different block ids) generates the dense
    reference's tokens, and prefix hits are found in both groups."""
    cache = CacheConfig(BS, 96, 256, kv_cache_groups=TWO_GROUPS)
    sched_config = SchedulerConfig(8, 64, 256)
    kv = KVCacheManager(cache)
    scheduler = Scheduler(sched_config, kv)
    builder = StepInputsBuilder(cache, sched_config, seed=0)
    runner = ModelRunner(model(), ResolvedConfig(EngineConfig(), cache, sched_config))
    prompts, max_tokens = make_prompts(3, num=12)
    requests = [Request(f"r{i}", p, greedy_params(n)) for i, (p, n) in enumerate(zip(prompts, max_tokens))]
    for r in requests:
        scheduler.add_request(r)
    tables_differ = False
    for _ in range(1000):
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        inputs = builder.build(out)
        n = out.num_seqs
        tables_differ |= bool((inputs.attention.block_tables[0, :n] != inputs.attention.block_tables[1, :n]).any())
        token_ids, logprobs = runner.execute(inputs)
        scheduler.update_from_output(out, token_ids, logprobs)
        kv.check_invariants()
    expected, _ = dense_greedy(prompts, max_tokens)
    assert [r.output_token_ids for r in requests] == expected
    assert tables_differ, "the two groups' tables never differed: the test would not see a mix-up"
    assert kv.prefix_cache_stats.hits > 0, "no prefix hit in either group"
    assert kv.get_num_free_blocks() == cache.num_usable_blocks
    np.testing.assert_array_equal(runner.pool.layer_kv_cache_group, [0, 1])
    # Both layers keep their pages in one shared array: a block belongs to one group at a time.
    assert runner.pool.tensor_layers == [(0, 1)] and len(runner.kv_caches) == 1


def gemma3_like_specs(window=512):
    """Gemma 3 270M's layer pattern: five sliding-window layers, then a full one, three times."""
    return [FullAttentionSpec(1, 256, "bfloat16", None if (i + 1) % 6 == 0 else window) for i in range(18)]


def test_hybrid_layers_group_as_vllm_groups_them():
    """vLLM's uniform-page grouping: group size = the smaller kind's 3 layers; the 15 sliding
    layers make five groups of layers[i::5], the full layers one, in order of first layer."""
    specs = gemma3_like_specs()
    groups = kv_cache_group_specs(specs)
    assert [g.layer_ids for g in groups] == [(0, 6, 12), (1, 7, 13), (2, 8, 14), (3, 9, 15), (4, 10, 16),
                                             (5, 11, 17)]
    assert [(g.attention_type, g.sliding_window) for g in groups] == [("sliding_window", 512)] * 5 + [
        ("full_attention", None)]
    check_kv_cache_groups(groups, specs)
    # Array i holds the i-th layer of every group: each six consecutive layers share one array.
    assert kv_cache_tensors(groups, specs) == [tuple(range(0, 6)), tuple(range(6, 12)), tuple(range(12, 18))]
    # A block costs 3 layers' pages (1 head x 256, K and V, bf16), not 18.
    assert kv_cache_bytes_per_block(specs, groups, BS) == 3 * 2 * 256 * 2 * BS
    # One kind of layer: one group, one array per layer, as every Llama.
    full = [FullAttentionSpec(1, 256, "bfloat16")] * 4
    assert kv_cache_group_specs(full) == (KVCacheGroupSpec((0, 1, 2, 3)),)
    assert kv_cache_tensors(kv_cache_group_specs(full), full) == [(0,), (1,), (2,), (3,)]
    # Kinds of other page layouts keep their own arrays (nothing to share a page with).
    mixed = [FullAttentionSpec(1, 256, "bfloat16", 8), FullAttentionSpec(2, 64, "bfloat16")]
    assert kv_cache_tensors(kv_cache_group_specs(mixed), mixed) == [(0,), (1,)]


def test_a_sliding_window_must_be_positive():
    with pytest.raises(ValueError, match="sliding_window=0 must be a positive int"):
        FullAttentionSpec(1, 16, "float32", 0)
    with pytest.raises(ValueError, match="sliding_window"):
        KVCacheGroupSpec((0,), "sliding_window", sliding_window=-4)
