"""write_kv_cache: only the addressed slots change, and a donated cache is updated in place."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kv_cache_write import write_kv_cache, write_kv_cache_reference
from models.kv_cache_spec import FullAttentionSpec
from paged_jax.attention import make_attention_backend
from paged_jax.core.step_inputs import AttentionMetadata

NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 64, 16, 2, 64


def random_step(rng, num_real, num_tokens, dtype, num_blocks=NUM_BLOCKS):
    """New K/V rows, their distinct real slots (outside the null page), padding -> null page."""
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = jnp.asarray(rng.standard_normal(shape), dtype)
    v_cache = jnp.asarray(rng.standard_normal(shape), dtype).at[5].set(jnp.nan)  # NaN rows must survive
    k = jnp.asarray(rng.standard_normal((num_tokens, NUM_KV_HEADS, HEAD_DIM)), dtype)
    v = jnp.asarray(rng.standard_normal((num_tokens, NUM_KV_HEADS, HEAD_DIM)), dtype)
    slots = np.zeros(num_tokens, np.int32)
    slots[:num_real] = rng.choice(np.arange(BLOCK_SIZE, num_blocks * BLOCK_SIZE), num_real, replace=False)
    slots[num_real:] = rng.integers(0, BLOCK_SIZE, num_tokens - num_real)  # padded tokens: the null page
    return k, v, k_cache, v_cache, jnp.asarray(slots)


def expected_cache(cache, new, slots, num_real):
    """Numpy: copy the cache and set the real tokens' slots row by row."""
    out = np.array(cache.astype(jnp.float32)).reshape(NUM_BLOCKS * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    for t in range(num_real):
        out[int(slots[t])] = np.asarray(new[t].astype(jnp.float32))
    return out.reshape(cache.shape)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("num_real, num_tokens", [(1, 1), (13, 16), (40, 64)])
def test_only_addressed_slots_change(dtype, num_real, num_tokens):
    rng = np.random.default_rng(num_tokens)
    k, v, k_cache, v_cache, slots = random_step(rng, num_real, num_tokens, dtype)
    new_k, new_v = write_kv_cache(k, v, k_cache, v_cache, slots)
    ref_k, ref_v = write_kv_cache_reference(k, v, k_cache, v_cache, slots)
    for new, ref, cache, rows in ((new_k, ref_k, k_cache, k), (new_v, ref_v, v_cache, v)):
        assert new.shape == cache.shape and new.dtype == dtype
        got = np.asarray(new.astype(jnp.float32))
        want = expected_cache(cache, rows, slots, num_real)
        # The null page takes the padded writes in an unspecified order; everything else is exact.
        np.testing.assert_array_equal(got[1:], want[1:])
        np.testing.assert_array_equal(np.asarray(ref.astype(jnp.float32))[1:], want[1:])


def test_donated_cache_is_consumed_and_never_copied():
    rng = np.random.default_rng(0)
    k, v, k_cache, v_cache, slots = random_step(rng, 12, 16, jnp.float32)
    cache_bytes = k_cache.nbytes
    donating = jax.jit(write_kv_cache, donate_argnums=(2, 3))
    stats = donating.lower(k, v, k_cache, v_cache, slots).compile().memory_analysis()
    # Both outputs alias their donated inputs and no cache-sized temporary exists.
    assert stats.alias_size_in_bytes == 2 * cache_bytes, stats
    assert stats.temp_size_in_bytes < cache_bytes // 8, stats
    # The same function without donation must allocate new outputs: the check can fail.
    plain = jax.jit(write_kv_cache).lower(k, v, k_cache, v_cache, slots).compile().memory_analysis()
    assert plain.alias_size_in_bytes == 0
    expected_k = expected_cache(k_cache, k, slots, 12)
    new_k, _ = donating(k, v, k_cache, v_cache, slots)
    assert k_cache.is_deleted() and v_cache.is_deleted(), "donated caches must be consumed"
    np.testing.assert_array_equal(np.asarray(new_k)[1:], expected_k[1:])


def test_engine_step_shape_updates_in_place():
    """Write, then attend, under one donating jit (the engine step): no cache-sized copy."""
    rng = np.random.default_rng(1)
    num_tokens, max_num_seqs = 8, 4
    # A cache much larger than the step's working set, so that any copy of it stands out.
    k, v, k_cache, v_cache, slots = random_step(rng, num_tokens, num_tokens, jnp.float32, num_blocks=1024)
    q = jnp.asarray(rng.standard_normal((num_tokens, 4, HEAD_DIM)), jnp.float32)
    block_tables = jnp.asarray(rng.integers(1, NUM_BLOCKS, (max_num_seqs, 4)), jnp.int32)
    seq_lens = jnp.asarray([40, 17, 1, 0], jnp.int32)
    query_start_loc = jnp.asarray([0, 5, 7, 8, 8], jnp.int32)

    # The engine's attention backend: the KV write, then the XLA attention over the pages.
    attention = make_attention_backend(FullAttentionSpec(NUM_KV_HEADS, HEAD_DIM, "float32"), "xla")

    def step(q, k, v, caches, slots):
        metadata = AttentionMetadata(slots, block_tables, seq_lens, query_start_loc, jnp.asarray([3], jnp.int32))
        return attention(q, k, v, caches, metadata, sm_scale=HEAD_DIM ** -0.5)

    compiled = jax.jit(step, donate_argnums=(3,)).lower(q, k, v, (k_cache, v_cache), slots).compile()
    stats = compiled.memory_analysis()
    assert stats.alias_size_in_bytes == 2 * k_cache.nbytes, stats
    assert stats.temp_size_in_bytes < k_cache.nbytes, stats


@pytest.mark.parametrize("change, match", [
    (dict(k=jnp.zeros((4, NUM_KV_HEADS, HEAD_DIM), jnp.bfloat16)), "cast k and v"),
    (dict(v=jnp.zeros((4, NUM_KV_HEADS + 1, HEAD_DIM))), "k and v must both be"),
    (dict(slot_mapping=jnp.zeros((4,), jnp.uint32)), "slot_mapping must be i32"),
    (dict(slot_mapping=jnp.zeros((5,), jnp.int32)), "slot_mapping must be i32"),
    (dict(v_cache=jnp.zeros((NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, 32))), "k_cache and v_cache must both be"),
])
def test_bad_input_raises_with_fix(change, match):
    cache = jnp.zeros((NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM))
    args = dict(k=jnp.zeros((4, NUM_KV_HEADS, HEAD_DIM)), v=jnp.zeros((4, NUM_KV_HEADS, HEAD_DIM)),
                k_cache=cache, v_cache=cache, slot_mapping=jnp.zeros((4,), jnp.int32))
    args.update(change)
    with pytest.raises(ValueError, match=match):
        write_kv_cache(**args)
