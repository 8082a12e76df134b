"""StepInputs builder: a hand-computed example, incremental vs one-shot, random slot checks."""

import subprocess
import sys

import numpy as np
import pytest

from paged_jax.core.batch import StepInputsBuilder, build_step_inputs, pad_step_inputs
from paged_jax.core.config import CacheConfig, KVCacheGroupSpec, SchedulerConfig, make_buckets
from paged_jax.core.request import Request, SamplingParams
from paged_jax.core.scheduler import SchedulerOutput


def _output(entries, finished=(), preempted=()):
    """entries: (request, num_computed, num_scheduled, new_block_ids, is_new); new_block_ids is
    one group's list, or a tuple of one list per KV-cache group."""
    out = SchedulerOutput(finished_req_ids=list(finished), preempted_req_ids=list(preempted))
    for request, computed, scheduled, block_ids, is_new in entries:
        out.requests.append(request)
        out.num_computed_tokens.append(computed)
        out.num_scheduled_tokens.append(scheduled)
        out.samples.append(computed + scheduled == request.num_tokens)
        out.new_block_ids.append(block_ids if isinstance(block_ids, tuple) else (block_ids,))
        out.is_new.append(is_new)
        out.total_num_scheduled_tokens += scheduled
    return out


def _configs(block_size=4, max_blocks_per_seq=4, token_buckets=(4, 16), seq_buckets=(2, 4), num_groups=1):
    """Configs whose derived table width and buckets are the given ones (buckets as (min, max))."""
    max_model_len = block_size * max_blocks_per_seq
    groups = tuple(KVCacheGroupSpec((g,)) for g in range(num_groups)) if num_groups > 1 else (KVCacheGroupSpec(),)
    cache = CacheConfig(block_size, num_blocks=1024, max_model_len=max_model_len, kv_cache_groups=groups)
    scheduler = SchedulerConfig(max_num_seqs=seq_buckets[1], max_num_batched_tokens=token_buckets[1],
                                max_model_len=max_model_len, min_token_bucket=token_buckets[0],
                                min_seq_bucket=seq_buckets[0])
    return cache, scheduler


def _builder(seed=0, **kw):
    cache, scheduler = _configs(**kw)
    assert scheduler.token_buckets == make_buckets(scheduler.max_num_batched_tokens, scheduler.min_token_bucket)
    return StepInputsBuilder(cache, scheduler, seed=seed)


@pytest.mark.parametrize(
    "args,expected",
    [((100, 8), [8, 16, 32, 64, 100]), ((64,), [1, 2, 4, 8, 16, 32, 64]), ((5, 5), [5]), ((1,), [1]),
     ((48, 3), [4, 8, 16, 32, 48])],
)
def test_make_buckets(args, expected):
    assert make_buckets(*args) == expected


@pytest.mark.parametrize("args", [(0,), (8, 0), (8, 16), (8.0,)])
def test_make_buckets_rejects_bad_values(args):
    with pytest.raises(ValueError):
        make_buckets(*args)


def _hand_example():
    r0 = Request("r0", list(range(10, 16)), SamplingParams(temperature=0.5, top_k=3, top_p=0.9, seed=7))
    r1 = Request("r1", list(range(20, 27)), SamplingParams(temperature=0.0))
    r1.append_output_token_ids([27, 28])
    r2 = Request("r2", list(range(30, 42)))
    return r0, r1, r2


def test_hand_computed_two_steps():
    r0, r1, r2 = _hand_example()
    builder = _builder()
    # step 1: r0 prefills 6 tokens; r1 decodes its 9th token; r2 computes prompt chunk 4..6.
    s1 = builder.build(_output([(r0, 0, 6, [3, 7], True), (r1, 8, 1, [5, 2, 9], True), (r2, 4, 3, [4, 6], True)]))
    np.testing.assert_array_equal(s1.model.token_ids, [10, 11, 12, 13, 14, 15, 28, 34, 35, 36, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(s1.model.positions, [0, 1, 2, 3, 4, 5, 8, 4, 5, 6, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(s1.attention.for_group(0).slot_mapping, [12, 13, 14, 15, 28, 29, 36, 24, 25, 26, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(s1.attention.for_group(0).block_tables, [[3, 7, 0, 0], [5, 2, 9, 0], [4, 6, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(s1.attention.for_group(0).seq_lens, [6, 9, 7, 0])
    np.testing.assert_array_equal(s1.attention.for_group(0).query_start_loc, [0, 6, 7, 10, 10])
    np.testing.assert_array_equal(s1.attention.for_group(0).num_seqs, [3])
    np.testing.assert_array_equal(s1.model.logits_indices, [5, 6, 9, 0])
    np.testing.assert_allclose(s1.sampling.temperature, [0.5, 0.0, 1.0, 0.0])
    np.testing.assert_array_equal(s1.sampling.top_k, [3, -1, -1, -1])
    np.testing.assert_allclose(s1.sampling.top_p, [0.9, 1.0, 1.0, 1.0])
    # key word 1 = output tokens so far when the sampled token is drawn (r1 has 2).
    np.testing.assert_array_equal(s1.sampling.rng_keys[:, 1], [0, 2, 0, 0])
    np.testing.assert_array_equal(s1.sampling.rng_keys[3], [0, 0])
    for a in (*s1.model, *s1.attention):
        assert a.dtype == np.int32
    assert s1.sampling.rng_keys.dtype == np.uint32 and s1.sampling.rng_keys.shape == (4, 2)

    # step 2: r1 finished; r0 decodes the token it sampled; r2 gets block 8 for positions 7..11.
    r0.append_output_token_ids(50)
    s2 = builder.build(_output([(r0, 6, 1, [], False), (r2, 7, 5, [8], False)], finished=["r1"]))
    np.testing.assert_array_equal(s2.model.token_ids, [50, 37, 38, 39, 40, 41, 0, 0])
    np.testing.assert_array_equal(s2.model.positions, [6, 7, 8, 9, 10, 11, 0, 0])
    np.testing.assert_array_equal(s2.attention.for_group(0).slot_mapping, [30, 27, 32, 33, 34, 35, 0, 0])
    np.testing.assert_array_equal(s2.attention.for_group(0).block_tables, [[3, 7, 0, 0], [4, 6, 8, 0]])
    np.testing.assert_array_equal(s2.attention.for_group(0).seq_lens, [7, 12])
    np.testing.assert_array_equal(s2.attention.for_group(0).query_start_loc, [0, 1, 6])
    np.testing.assert_array_equal(s2.model.logits_indices, [0, 5])
    np.testing.assert_array_equal(s2.sampling.rng_keys[:, 1], [1, 0])
    assert s2.sampling.rng_keys[0, 0] == s1.sampling.rng_keys[0, 0] and s2.sampling.rng_keys[1, 0] == s1.sampling.rng_keys[2, 0]
    assert "r1" not in builder._row_of


def test_two_kv_cache_groups_get_their_own_tables_and_slots():
    # The hand example's step 1 with a second group whose blocks are other ids: each group's
    # slots come from its own table; the ragged layout is shared.
    r0, r1, r2 = _hand_example()
    builder = _builder(num_groups=2)
    s1 = builder.build(_output([(r0, 0, 6, ([3, 7], [11, 12]), True), (r1, 8, 1, ([5, 2, 9], [13, 14, 15]), True),
                                (r2, 4, 3, ([4, 6], [16, 17]), True)]))
    assert s1.attention.slot_mapping.shape == (2, 16) and s1.attention.block_tables.shape == (2, 4, 4)
    g0, g1 = s1.attention.for_group(0), s1.attention.for_group(1)
    np.testing.assert_array_equal(g0.slot_mapping, [12, 13, 14, 15, 28, 29, 36, 24, 25, 26, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(g1.slot_mapping, [44, 45, 46, 47, 48, 49, 60, 68, 69, 70, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(g1.block_tables, [[11, 12, 0, 0], [13, 14, 15, 0], [16, 17, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(g1.seq_lens, g0.seq_lens)
    # step 2: r2 gets a new block in group 1 only; r0 decodes.
    r0.append_output_token_ids(50)
    s2 = builder.build(_output([(r0, 6, 1, ([], []), False), (r2, 7, 5, ([8], [18]), False)], finished=["r1"]))
    np.testing.assert_array_equal(s2.attention.for_group(0).slot_mapping, [30, 27, 32, 33, 34, 35, 0, 0])
    np.testing.assert_array_equal(s2.attention.for_group(1).slot_mapping, [50, 71, 72, 73, 74, 75, 0, 0])
    np.testing.assert_array_equal(s2.attention.for_group(1).block_tables, [[11, 12, 0, 0], [16, 17, 18, 0]])


def test_padding_further_is_what_a_larger_bucket_builds():
    # The runner may run a step in a larger compiled bucket: pad_step_inputs must give what
    # the builder itself gives when that bucket is the smallest one.
    r0, r1, r2 = _hand_example()
    entries = [(r0, 0, 6, [3, 7], True), (r1, 8, 1, [5, 2, 9], True), (r2, 4, 3, [4, 6], True)]
    small = _builder().build(_output(entries))
    large = _builder(token_buckets=(32, 32), seq_buckets=(8, 8)).build(_output(entries))
    assert small.model.token_ids.shape == (16,) and large.model.token_ids.shape == (32,)
    padded = pad_step_inputs(small, 32, 8)
    for part_a, part_b in zip(padded, large):
        for name, x, y in zip(part_a._fields, part_a, part_b):
            assert x.dtype == y.dtype, name
            np.testing.assert_array_equal(x, y, err_msg=name)


def test_one_shot_matches_incremental():
    r0, r1, r2 = _hand_example()
    tables = {"r0": [3, 7], "r1": [5, 2, 9], "r2": [4, 6]}
    out = _output([(r0, 0, 6, [3, 7], True), (r1, 8, 1, [5, 2, 9], True), (r2, 4, 3, [4, 6], True)])
    a = _builder().build(out)
    b = build_step_inputs(out, lambda request_id: (tables[request_id],), *_configs(), seed=0)
    for part_a, part_b in zip(a, b):
        for name, x, y in zip(part_a._fields, part_a, part_b):
            np.testing.assert_array_equal(x, y, err_msg=name)


def test_seeded_keys_depend_on_seed_and_step_only():
    a = Request("a", [1, 2, 3], SamplingParams(seed=11))
    b = Request("b", [9, 9, 9, 9, 9], SamplingParams(seed=11))
    c = Request("c", [1, 2, 3], SamplingParams(seed=12))
    s = _builder(seed=1).build(_output([(c, 0, 3, [1], True), (a, 0, 3, [2], True)]))
    t = _builder(seed=2).build(_output([(b, 0, 5, [3, 4], True)]))
    assert s.sampling.rng_keys[1, 0] == t.sampling.rng_keys[0, 0], "same seed must give the same stream in any batch"
    assert s.sampling.rng_keys[0, 0] != s.sampling.rng_keys[1, 0]


def test_unseeded_stream_survives_preemption():
    r = Request("r", [1, 2, 3, 4, 5])
    builder = _builder()
    k1 = builder.build(_output([(r, 0, 5, [1, 2], True)])).sampling.rng_keys[0, 0]
    r.append_output_token_ids(6)
    # preempted, then resumed from scratch with a new table
    builder.build(_output([], preempted=["r"]))
    k2 = builder.build(_output([(r, 0, 6, [5, 6], True)])).sampling.rng_keys[0]
    assert k2[0] == k1 and k2[1] == 1


def test_tables_grow_past_initial_capacity():
    builder = _builder(max_blocks_per_seq=2, token_buckets=(512, 512), seq_buckets=(128, 256))
    reqs = [Request(f"r{i}", [i, i + 1]) for i in range(200)]
    s = builder.build(_output([(r, 0, 2, [i + 1], True) for i, r in enumerate(reqs)]))
    np.testing.assert_array_equal(s.attention.for_group(0).block_tables[:200, 0], np.arange(1, 201))
    np.testing.assert_array_equal(s.attention.for_group(0).slot_mapping[:400:2], np.arange(1, 201) * 4)


@pytest.mark.parametrize("seed", range(5))
def test_random_batches_against_a_per_token_reference(seed):
    rng = np.random.default_rng(seed)
    bs, width = 8, 12
    builder = _builder(seed=seed, block_size=bs, max_blocks_per_seq=width, token_buckets=(16, 512),
                       seq_buckets=(1, 32))
    num_seqs = int(rng.integers(1, 20))
    entries, tables, expected_tokens = [], [], []
    pool = rng.permutation(np.arange(1, 400))  # distinct block ids in random order
    for i in range(num_seqs):
        total = int(rng.integers(1, width * bs))
        request = Request(f"q{i}", rng.integers(0, 1000, total).tolist())
        computed = int(rng.integers(0, total))
        scheduled = int(rng.integers(1, min(total - computed, 40) + 1))
        table = pool[: -(-(computed + scheduled) // bs)].tolist()
        pool = pool[len(table):]
        entries.append((request, computed, scheduled, table, True))
        tables.append(table)
        expected_tokens += request.all_token_ids[computed : computed + scheduled]
    s = builder.build(_output(entries))
    t = 0
    for i, (request, computed, scheduled, table, _) in enumerate(entries):
        assert s.attention.for_group(0).query_start_loc[i] == t and s.attention.for_group(0).seq_lens[i] == computed + scheduled
        for pos in range(computed, computed + scheduled):
            assert s.model.positions[t] == pos
            assert s.attention.for_group(0).slot_mapping[t] == table[pos // bs] * bs + pos % bs
            t += 1
        assert s.model.logits_indices[i] == t - 1
        assert s.attention.for_group(0).block_tables[i, : len(table)].tolist() == table and not s.attention.for_group(0).block_tables[i, len(table):].any()
    assert s.model.token_ids[:t].tolist() == expected_tokens
    assert not s.attention.for_group(0).slot_mapping[t:].any() and not s.model.token_ids[t:].any()
    assert s.model.token_ids.shape[0] == min(b for b in make_buckets(512, 16) if b >= t)
    assert s.attention.for_group(0).seq_lens.shape[0] == min(b for b in make_buckets(32, 1) if b >= num_seqs)
    assert (s.attention.for_group(0).query_start_loc[num_seqs:] == t).all() and not s.attention.for_group(0).block_tables[num_seqs:].any()
    assert (s.attention.for_group(0).slot_mapping >= 0).all() and (s.attention.for_group(0).block_tables >= 0).all()


def test_a_token_without_a_block_is_caught():
    r = Request("r", list(range(9)))
    with pytest.raises(AssertionError, match="allocate_slots"):
        _builder().build(_output([(r, 0, 9, [1, 2], True)]))


def test_host_modules_import_no_jax():
    code = ("import sys, paged_jax.core.batch, paged_jax.core.scheduler, paged_jax.core.config; "
            "assert 'jax' not in sys.modules, 'a host module imported jax'")
    subprocess.run([sys.executable, "-c", code], check=True)
