"""The native CPU decode attention (cpu_kernels/paged_attention.py) inside the XLA backend:
used on a CPU for float caches, absent from GPU programs, and equal to the float64 reference
and to the XLA path without it on hostile batches (NaN in every unowned slot)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import paged_attention as cpu_attention
from paged_jax.attention.xla import ragged_paged_attention_xla
from test_paged_attention import TOLERANCE, attention_f64, build_batch, scenario

NATIVE = jax.default_backend() == "cpu" and cpu_attention.native_available()
needs_native = pytest.mark.skipif(not NATIVE, reason="no native CPU kernel here (no compiler, or not a CPU)")


def _batch(name, num_q_heads, num_kv_heads, head_dim, dtype, seed=0):
    rng = np.random.default_rng(seed)
    q_lens, seq_lens = scenario(name, 16, rng)
    batch = build_batch(rng, q_lens, seq_lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                        head_dim=head_dim, block_size=16, dtype=dtype, num_tokens=80, max_num_seqs=8,
                        max_blocks_per_seq=8)
    q, k, v, tables, seq_lens, qsl, num_seqs = batch
    args = (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(tables),
            jnp.asarray(seq_lens), jnp.asarray(qsl), jnp.asarray(num_seqs))
    return batch, args, slice(0, int(qsl[num_seqs]))


@needs_native
def test_cpu_programs_call_the_kernel_for_float_caches():
    _, args, _ = _batch("decode", 8, 2, 64, jnp.float32)
    text = jax.jit(ragged_paged_attention_xla).lower(*args).as_text()
    assert "pj_paged_decode_attention_f32" in text
    cuda = jax.jit(ragged_paged_attention_xla).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "pj_paged_decode_attention" not in cuda


@needs_native
# head_dim 64 and 128 run the AVX-512 loops (groups 1..8), 32 and 96 the generic ones
@pytest.mark.parametrize("heads,head_dim", [((8, 8), 64), ((9, 3), 64), ((8, 1), 128), ((6, 2), 32), ((4, 1), 96)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("name", ["decode", "mixed"])
def test_kernel_matches_float64_and_the_xla_loop(heads, head_dim, dtype, name, monkeypatch):
    batch, args, real = _batch(name, *heads, head_dim, dtype, seed=head_dim + heads[0])
    expected = attention_f64(*batch)
    native = np.asarray(jax.jit(ragged_paged_attention_xla)(*args).astype(jnp.float32))
    monkeypatch.setattr(cpu_attention, "usable", lambda k_cache: False)
    loop = np.asarray(jax.jit(ragged_paged_attention_xla)(*args).astype(jnp.float32))
    assert np.isfinite(native).all()
    np.testing.assert_allclose(native[real], expected[real], **TOLERANCE[dtype])
    np.testing.assert_allclose(native, loop, **TOLERANCE[dtype])  # padding rows too: both zero


@needs_native
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("seq_lens", [[1000], [777, 2], [300, 129, 1]])
def test_long_decodes_match(dtype, seq_lens):
    # Contexts far past the other tests' 128 keys (a real model's decode at 300-1000 tokens),
    # beside 1- and 2-key sequences, with few (sequence, KV head) tasks for the threads.
    rng = np.random.default_rng(len(seq_lens))
    batch = build_batch(rng, [1] * len(seq_lens), seq_lens, num_q_heads=9, num_kv_heads=3, head_dim=64,
                        block_size=16, dtype=dtype, num_tokens=8, max_num_seqs=4, max_blocks_per_seq=64)
    q, k, v, tables, lens, qsl, num_seqs = batch
    args = (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(tables),
            jnp.asarray(lens), jnp.asarray(qsl), jnp.asarray(num_seqs))
    real = slice(0, int(qsl[num_seqs]))
    out = np.asarray(jax.jit(cpu_attention.decode_attention, static_argnames="sm_scale")(
        *args, sm_scale=float(1 / np.sqrt(64))))
    loop = np.asarray(jax.jit(ragged_paged_attention_xla, static_argnames="sm_scale")(
        *args, sm_scale=float(1 / np.sqrt(64)))[real].astype(jnp.float32))
    np.testing.assert_allclose(out[real], attention_f64(*batch)[real], **TOLERANCE[dtype])
    np.testing.assert_allclose(out[real], loop, **TOLERANCE[dtype])


@needs_native
def test_kernel_leaves_prefill_rows_zero():
    _, args, _ = _batch("mixed", 8, 2, 64, jnp.float32)
    q, k, v, tables, seq_lens, qsl, num_seqs = args
    out = np.asarray(jax.jit(cpu_attention.decode_attention, static_argnames="sm_scale")(
        q, k, v, tables, seq_lens, qsl, num_seqs, sm_scale=0.125))
    lens = np.diff(np.asarray(qsl))[: int(num_seqs)]
    decode_rows = [int(qsl[i]) for i in range(int(num_seqs)) if lens[i] == 1]
    others = np.setdiff1d(np.arange(out.shape[0]), decode_rows)
    assert np.all(out[others] == 0) and np.all(np.abs(out[decode_rows]).sum(axis=(1, 2)) > 0)
