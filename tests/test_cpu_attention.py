"""The native CPU decode attention (cpu_kernels/paged_attention.py) inside the XLA backend:
used on a CPU for float caches, absent from GPU programs, and equal to the float64 reference
and to the XLA path without it on hostile batches (NaN in every unowned slot)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import paged_attention as cpu_attention
from paged_jax.attention.xla import ragged_paged_attention_xla
from native_builds import BUILDS, register
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
# head_dim 64 and 128 run the AVX-512 or AVX2 loops (groups 1..8), 32 and 96 the generic ones
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


def _poison_before(batch, first_keys):
    """NaN in every slot before each sequence's first visible key: the kernel's key loop starts
    there, so reading any one of them (a page wholly outside the window, or a stale slot of
    the first page) makes the row NaN."""
    q, k, v, tables, seq_lens, qsl, num_seqs = batch
    k, v = k.copy(), v.copy()
    block_size = k.shape[1]
    for i, first in enumerate(first_keys):
        for pos in range(first):
            k[tables[i, pos // block_size], pos % block_size] = np.nan
            v[tables[i, pos // block_size], pos % block_size] = np.nan
    return q, k, v, tables, seq_lens, qsl, num_seqs


def _jnp_args(batch, dtype):
    q, k, v, tables, seq_lens, qsl, num_seqs = batch
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(tables),
            jnp.asarray(seq_lens), jnp.asarray(qsl), jnp.asarray(num_seqs))


@needs_native
@pytest.mark.parametrize("heads,head_dim", [((8, 2), 64), ((6, 2), 32)])  # AVX-512 loops where built; generic
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("sliding_window", [1, 5, 16, 40, 512])
def test_windowed_decodes_read_only_their_window(heads, head_dim, dtype, sliding_window):
    rng = np.random.default_rng(sliding_window + head_dim)
    seq_lens = [1, 15, 16, 67, 81, 300]
    batch = build_batch(rng, [1] * len(seq_lens), seq_lens, num_q_heads=heads[0], num_kv_heads=heads[1],
                        head_dim=head_dim, block_size=16, dtype=dtype, num_tokens=8, max_num_seqs=7,
                        max_blocks_per_seq=19)
    batch = _poison_before(batch, [max(0, n - sliding_window) for n in seq_lens])
    real = slice(0, len(seq_lens))
    out = np.asarray(jax.jit(cpu_attention.decode_attention, static_argnames=("sm_scale", "sliding_window"))(
        *_jnp_args(batch, dtype), sm_scale=float(head_dim ** -0.5), sliding_window=sliding_window))
    assert np.isfinite(out).all(), "a key before the window was read"
    np.testing.assert_allclose(out[real], attention_f64(*batch, sliding_window=sliding_window)[real],
                               **TOLERANCE[dtype])


@needs_native
@pytest.mark.parametrize("sliding_window", [5, 40])
def test_windowed_kernel_inside_the_xla_path_matches_its_loop(sliding_window, monkeypatch):
    batch, _, real = _batch("mixed", 8, 2, 64, jnp.float32, seed=sliding_window)
    _, _, _, _, seq_lens, qsl, num_seqs = batch
    firsts = [max(0, int(seq_lens[i]) - int(qsl[i + 1] - qsl[i]) - sliding_window + 1) for i in range(num_seqs)]
    batch = _poison_before(batch, [first // 16 * 16 for first in firsts])  # pages wholly before each window
    args = _jnp_args(batch, jnp.float32)
    attend = jax.jit(ragged_paged_attention_xla, static_argnames="sliding_window")
    native = np.asarray(attend(*args, sliding_window=sliding_window))
    monkeypatch.setattr(cpu_attention, "usable", lambda k_cache: False)
    loop = np.asarray(jax.jit(ragged_paged_attention_xla, static_argnames="sliding_window")(
        *args, sliding_window=sliding_window))
    assert np.isfinite(native).all()
    np.testing.assert_allclose(native[real], attention_f64(*batch, sliding_window=sliding_window)[real],
                               **TOLERANCE[jnp.float32])
    np.testing.assert_allclose(native, loop, **TOLERANCE[jnp.float32])


def test_token_rows_make_each_query_token_a_decode_row():
    """Two sequences, 3 tokens at positions 4..6 and 1 at position 9, in a 6-token bucket:
    4 rows of their own (keys 0..p through their sequence's table), padding rows left out."""
    from pallas_kernels.ragged_batch import ragged_batch
    from paged_jax.attention.xla import token_rows

    tables = jnp.array([[3, 4, 0], [7, 0, 0], [0, 0, 0]], jnp.int32)
    batch = ragged_batch(jnp.array([7, 10, 0]), jnp.array([0, 3, 4, 4]), jnp.array(2))
    rows, lens, qsl, num = token_rows(tables, batch, 6)
    assert lens.tolist() == [5, 6, 7, 10, 0, 0] and int(num) == 4 and qsl.tolist() == list(range(7))
    assert rows[:4].tolist() == [[3, 4, 0]] * 3 + [[7, 0, 0]]


@needs_native
@pytest.mark.parametrize("sliding_window", [None, 6, 40])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_every_query_token_runs_as_a_decode_row(sliding_window, dtype, monkeypatch):
    """On a CPU every query token runs as a native decode row (token_rows): a speculative
    verification step's shape (sequences of 1 to 8 query tokens over contexts of 2 to 300 keys),
    a 9-token chunk beside a decode, and prefill chunks of 40 and 100 tokens (one a whole
    prompt, one after 260 cached keys) beside a decode. Each equals the float64 reference and
    the blocked XLA loop."""
    for q_lens, seq_lens, num_tokens in (([5, 1, 3, 8, 2], [300, 40, 17, 129, 2], 32), ([9, 1], [60, 33], 32),
                                         ([40, 1, 100], [300, 33, 100], 160)):
        rng = np.random.default_rng(len(q_lens))
        batch = build_batch(rng, q_lens, seq_lens, num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                            dtype=dtype, num_tokens=num_tokens, max_num_seqs=6, max_blocks_per_seq=20)
        if sliding_window is not None:  # keys wholly before every row's window are NaN
            firsts = [max(0, n - q - sliding_window + 1) for q, n in zip(q_lens, seq_lens)]
            batch = _poison_before(batch, [first // 16 * 16 for first in firsts])
        args = _jnp_args(batch, dtype)
        real = slice(0, sum(q_lens))
        attend = jax.jit(ragged_paged_attention_xla, static_argnames="sliding_window")
        native = np.asarray(attend(*args, sliding_window=sliding_window).astype(jnp.float32))
        assert np.isfinite(native).all()
        np.testing.assert_allclose(native[real], attention_f64(*batch, sliding_window=sliding_window)[real],
                                   **TOLERANCE[dtype])
        with monkeypatch.context() as m:
            m.setattr(cpu_attention, "usable", lambda k_cache: False)
            loop = np.asarray(jax.jit(ragged_paged_attention_xla, static_argnames="sliding_window")(
                *args, sliding_window=sliding_window).astype(jnp.float32))
        np.testing.assert_allclose(native, loop, **TOLERANCE[dtype])


def _token_rows_np(tables, seq_lens, query_start_loc, num_seqs, num_tokens):
    """Every query token as a decode row of its own, built here from the batch (not with
    token_rows): token j of sequence i's q_len sees keys 0 .. seq_len - q_len + j."""
    rows, lens = np.zeros((num_tokens, tables.shape[1]), np.int32), np.zeros(num_tokens, np.int32)
    for i in range(num_seqs):
        q_len = query_start_loc[i + 1] - query_start_loc[i]
        for j in range(q_len):
            rows[query_start_loc[i] + j] = tables[i]
            lens[query_start_loc[i] + j] = seq_lens[i] - q_len + j + 1
    return rows, lens, np.arange(num_tokens + 1, dtype=np.int32), np.int32(query_start_loc[num_seqs])


@needs_native
@pytest.mark.parametrize("heads,head_dim", [((8, 1), 64), ((9, 3), 64), ((8, 8), 128), ((4, 2), 128), ((6, 2), 32)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("sliding_window", [None, 7, 24])
def test_prefill_rows_in_tiles_match_the_reference(heads, head_dim, dtype, sliding_window):
    """Prefill chunks as token rows, which the kernel runs in tiles of consecutive rows
    (paged_attention.h make_tiles, run_tile_avx2 where built): chunks of 1 to 13 tokens, so
    tiles are whole, partial and single; keys before each chunk's first window NaN. Two of the
    sequences share their first page (a cached prefix): sequence 5's chunk starts one position
    after sequence 4's ends, so their rows may share a tile only while they read the same
    pages; sequence 5's second page is its own (sequence 4 has none there)."""
    q_lens, seq_lens = [1, 2, 3, 5, 1, 4, 13, 9], [1, 40, 19, 70, 15, 19, 13, 100]
    rng = np.random.default_rng(head_dim + heads[1])
    batch = build_batch(rng, q_lens, seq_lens, num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
                        block_size=16, dtype=dtype, num_tokens=64, max_num_seqs=8, max_blocks_per_seq=7)
    q, k, v, tables, lens, qsl, num_seqs = batch
    tables = tables.copy()
    shared = tables[5, 0]
    tables[5, 0] = tables[4, 0]  # sequence 5's keys 0..14 are sequence 4's, its key 15 beside them
    k, v = k.copy(), v.copy()
    k[tables[4, 0]], v[tables[4, 0]] = k[shared], v[shared]
    if sliding_window is not None:  # keys wholly before every row's window are NaN
        firsts = [max(0, n - ql - sliding_window + 1) for ql, n in zip(q_lens, seq_lens)]
        firsts[4] = firsts[5] = min(firsts[4], firsts[5])  # one page, one poisoning
        q, k, v, tables, lens, qsl, num_seqs = _poison_before((q, k, v, tables, lens, qsl, num_seqs), firsts)
    batch = (q, k, v, tables, lens, qsl, num_seqs)
    rows = _token_rows_np(tables, lens, qsl, num_seqs, q.shape[0])
    args = (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), *map(jnp.asarray, rows))
    out = np.asarray(cpu_attention.decode_attention(*args, sm_scale=head_dim ** -0.5,
                                                    sliding_window=sliding_window).astype(jnp.float32))
    real = slice(0, sum(q_lens))
    assert np.isfinite(out[real]).all()
    np.testing.assert_allclose(out[real], attention_f64(*batch, sliding_window=sliding_window)[real],
                               **TOLERANCE[dtype])
    assert (out[sum(q_lens):] == 0).all()


@needs_native
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("build", sorted(BUILDS))
def test_loops_without_avx512_with_a_window(build, dtype):
    """The loops a CPU without AVX-512 runs (AVX2, or the portable ones), built under names of
    their own: on an AVX-512 machine the default build runs the other loops. Groups of 1, 3
    and 8 query heads, head_dim 64 and 128, windows that start inside a page."""
    prefix = register(cpu_attention, build, "attention")
    for case, (heads, head_dim) in enumerate([((8, 1), 64), ((9, 3), 64), ((8, 8), 128), ((6, 2), 32)]):
        rng = np.random.default_rng(3 + case)
        seq_lens = [1, 40, 70]
        batch = build_batch(rng, [1] * 3, seq_lens, num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
                            block_size=16, dtype=dtype, num_tokens=4, max_num_seqs=4, max_blocks_per_seq=5)
        for window in (None, 24):
            cut = [max(0, n - (window or n)) for n in seq_lens]
            poisoned = _poison_before(batch, cut) if window else batch
            out = np.asarray(cpu_attention.decode_attention(*_jnp_args(poisoned, dtype), sm_scale=head_dim ** -0.5,
                                                            sliding_window=window, prefix=prefix).astype(jnp.float32))
            expected = attention_f64(*batch, sliding_window=window)
            np.testing.assert_allclose(out[:3], expected[:3], **TOLERANCE[dtype])


@needs_native
@pytest.mark.parametrize("flags", [("-mavx512f", "-mavx512bw"), ("-mavx512f", "-mavx512bw", "-mavx512vnni")],
                         ids=["avx512-without-vnni", "avx512-vnni"])
def test_avx512_loops_compile(flags):
    """The AVX-512 loops build even where they cannot run (this machine may lack AVX-512), with
    VNNI (the int8 loops on vpdpbusd) and without it (Skylake-SP: the f32 loops on AVX-512, the
    int8 ones on AVX2)."""
    from cpu_kernels import native

    assert native.build(flags) is not None


def test_bad_window_for_the_kernel():
    _, args, _ = _batch("decode", 8, 2, 64, jnp.float32)
    with pytest.raises(ValueError, match="sliding_window"):
        cpu_attention.decode_attention(*args, sm_scale=0.125, sliding_window=0)
