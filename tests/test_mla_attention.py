"""MLA paged attention (pallas_kernels/mla_attention.py, paged_jax/attention/mla_xla.py) against a
float64 reference that decompresses every key and value and runs ordinary attention.

Batches are hostile as in test_paged_attention.py: pages a random permutation of the pool,
every slot nobody owns NaN (foreign pages, the null page, the tail of a last page), padded
tokens and padded sequences in the bucket. The XLA path runs absorbed and decompressing, per
kind of query block; the Pallas kernel (absorbed) in interpret mode.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.kv_cache_spec import MLAAttentionSpec
from paged_jax.attention import make_attention_backend
from paged_jax.attention.mla_xla import mla_paged_attention_xla
from pallas_kernels.mla_attention import MlaPallasConfig, mla_paged_attention, mla_paged_attention_reference

INTERPRET = jax.default_backend() == "cpu"
TOLERANCE = {jnp.float32: dict(atol=3e-5, rtol=3e-5), jnp.bfloat16: dict(atol=4e-2, rtol=3e-2)}
# Small MLA shapes: 4 heads, latent 32, rope 16, nope 16, v 16 (powers of two >= 16 for the kernel).
NUM_HEADS, LATENT, ROPE, NOPE, V = 4, 32, 16, 16, 16


def cdiv(a, b):
    return -(-a // b)


def build_mla_batch(rng, q_lens, seq_lens, *, block_size, num_tokens, max_num_seqs, max_blocks_per_seq, dtype):
    """Numpy arrays of a ragged MLA batch, rounded through dtype, unowned latent slots NaN."""
    pages_needed = [cdiv(n, block_size) for n in seq_lens]
    num_blocks = 4 + max_num_seqs * max_blocks_per_seq
    pool = iter(rng.permutation(np.arange(1, num_blocks)))
    block_tables = np.zeros((max_num_seqs, max_blocks_per_seq), np.int32)
    c_kv = np.full((num_blocks, block_size, LATENT), np.nan)
    k_rope = np.full((num_blocks, block_size, ROPE), np.nan)
    for i, seq_len in enumerate(seq_lens):
        block_tables[i, : pages_needed[i]] = [next(pool) for _ in range(pages_needed[i])]
        for pos in range(seq_len):
            page, offset = block_tables[i, pos // block_size], pos % block_size
            c_kv[page, offset] = rng.standard_normal(LATENT)
            k_rope[page, offset] = rng.standard_normal(ROPE)
    query_start_loc = np.full(max_num_seqs + 1, sum(q_lens), np.int32)
    query_start_loc[: len(q_lens) + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    seq_lens_arr = np.zeros(max_num_seqs, np.int32)
    seq_lens_arr[: len(seq_lens)] = seq_lens
    q_nope = rng.standard_normal((num_tokens, NUM_HEADS, NOPE))
    q_rope = rng.standard_normal((num_tokens, NUM_HEADS, ROPE))
    w_uk = rng.standard_normal((LATENT, NUM_HEADS, NOPE)) / np.sqrt(LATENT)
    w_uv = rng.standard_normal((LATENT, NUM_HEADS, V)) / np.sqrt(LATENT)
    floats = tuple(jnp.asarray(a, dtype) for a in (q_nope, q_rope, c_kv, k_rope, w_uk, w_uv))
    return floats + (jnp.asarray(block_tables), jnp.asarray(seq_lens_arr), jnp.asarray(query_start_loc),
                     jnp.int32(len(q_lens)))


# (q_lens, seq_lens): decodes of 1 token, lengths around block multiples, chunks with a cached prefix.
MIXED = ([1, 5, 1, 16, 1, 9], [1, 5, 33, 40, 16, 70])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_xla_mixed_batch_absorbed_and_decompressed_match_float64(dtype):
    rng = np.random.default_rng(0)
    args = build_mla_batch(rng, *MIXED, block_size=8, num_tokens=48, max_num_seqs=8, max_blocks_per_seq=10,
                           dtype=dtype)
    sm_scale = 0.17
    expected = mla_paged_attention_reference(*args, sm_scale=sm_scale)
    real = slice(0, sum(MIXED[0]))
    outs = []
    # Two calls cover all four paths: decodes and prefill chunks, each absorbed in one call
    # and decompressed in the other.
    for decode_form, prefill_form in (("absorbed", "decompressed"), ("decompressed", "absorbed")):
        out = mla_paged_attention_xla(*args, sm_scale=sm_scale, decode_form=decode_form, prefill_form=prefill_form)
        assert out.shape == (48, NUM_HEADS, V) and out.dtype == dtype
        out = np.asarray(out.astype(jnp.float32))
        assert np.isfinite(out).all(), "NaN pages leaked into the output"
        np.testing.assert_allclose(out[real], expected[real], **TOLERANCE[dtype],
                                   err_msg=f"xla {decode_form=} {prefill_form=} vs float64")
        outs.append(out[real])
    np.testing.assert_allclose(outs[0], outs[1], **TOLERANCE[dtype], err_msg="absorbed vs decompressing")


@pytest.mark.parametrize("config", [MlaPallasConfig(), MlaPallasConfig(decode_num_splits=2, prefill_rows=16)],
                         ids=["default", "split2"])
def test_pallas_mixed_batch_matches_float64(config):
    rng = np.random.default_rng(1)
    args = build_mla_batch(rng, [1, 3, 1, 6], [1, 3, 20, 22], block_size=8, num_tokens=16, max_num_seqs=4,
                           max_blocks_per_seq=4, dtype=jnp.float32)
    expected = mla_paged_attention_reference(*args, sm_scale=0.2)
    out = np.asarray(mla_paged_attention(*args, sm_scale=0.2, interpret=INTERPRET, config=config))
    assert np.isfinite(out).all(), "NaN pages leaked into the output"
    np.testing.assert_allclose(out[:11], expected[:11], **TOLERANCE[jnp.float32], err_msg="pallas vs float64")


def test_backend_writes_the_latent_then_attends():
    """The MLA backend stores c_kv / k_rope at slot_mapping and attends over the stored pool."""
    from paged_jax.core.step_inputs import AttentionMetadata

    rng = np.random.default_rng(2)
    block_size, num_blocks = 4, 6
    spec = MLAAttentionSpec(LATENT, ROPE, "float32")
    cache = spec.allocate(num_blocks, block_size)
    assert [a.shape for a in cache] == [(num_blocks, block_size, LATENT), (num_blocks, block_size, ROPE)]
    assert spec.bytes_per_token == (LATENT + ROPE) * 4
    q_nope, q_rope = (jnp.asarray(rng.standard_normal((6, NUM_HEADS, d)), jnp.float32) for d in (NOPE, ROPE))
    c_kv, k_rope = (jnp.asarray(rng.standard_normal((6, d)), jnp.float32) for d in (LATENT, ROPE))
    w_uk = jnp.asarray(rng.standard_normal((LATENT, NUM_HEADS, NOPE)) / 6, jnp.float32)
    w_uv = jnp.asarray(rng.standard_normal((LATENT, NUM_HEADS, V)) / 6, jnp.float32)
    # one sequence of 5 tokens on pages [3, 1], a padding token into the null page
    md = AttentionMetadata(slot_mapping=jnp.asarray([12, 13, 14, 15, 4, 0], jnp.int32),
                           block_tables=jnp.asarray([[3, 1], [0, 0]], jnp.int32),
                           seq_lens=jnp.asarray([5, 0], jnp.int32), query_start_loc=jnp.asarray([0, 5, 5], jnp.int32),
                           num_seqs=jnp.asarray([1], jnp.int32))
    for impl in ("xla", "triton"):
        attention = make_attention_backend(spec, impl, interpret=INTERPRET and impl == "triton")
        assert attention.name == impl
        out, (c_cache, r_cache) = attention(q_nope, q_rope, c_kv, k_rope, cache, md, w_uk=w_uk, w_uv=w_uv,
                                            sm_scale=0.3)
        np.testing.assert_array_equal(np.asarray(c_cache[3]), np.asarray(c_kv[:4]))
        np.testing.assert_array_equal(np.asarray(r_cache[1, 0]), np.asarray(k_rope[4]))
        expected = mla_paged_attention_reference(q_nope, q_rope, c_cache, r_cache, w_uk, w_uv, md.block_tables,
                                                 md.seq_lens, md.query_start_loc, md.num_seqs, sm_scale=0.3)
        np.testing.assert_allclose(np.asarray(out)[:5], expected[:5], atol=3e-5, rtol=3e-5, err_msg=impl)
